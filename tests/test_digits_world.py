"""The bundled digits world: assets reproduce, reward and judge behave, metrics are sane.

    .venv/bin/python -m pytest tests/test_digits_world.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difrl.eval.metrics import frechet_distance, within_class_diversity
from difrl.models.digits import BUNDLED_BASE, DigitsPolicy, parse_digit_prompt
from difrl.rewards import build_reward
from difrl.utils.io import load_safetensors_checked
from difrl.worlds import build_world
from conftest import weights_reproduced
from difrl.worlds.digits import ASSETS, FEATURE_EXTRACTOR, PROMPTS, DigitsWorld, evaluate_digits, load_split

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_pretrain_script_reproduces_bundled_assets(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_digits.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exact = {}
    for name in ("digits_base.safetensors", "digits_classifier.safetensors"):
        shipped, meta_a = load_safetensors_checked(ASSETS / name, "bundled")
        rebuilt, meta_b = load_safetensors_checked(tmp_path / name, "rebuilt")
        exact[name] = weights_reproduced(shipped, rebuilt, name)
        if exact[name]:
            assert meta_a == meta_b
        else:  # the same recipe, other float rounding: the same keys, and a classifier of the same test accuracy
            assert meta_a.keys() == meta_b.keys()
            assert {k: v for k, v in meta_a.items() if k != "test_accuracy"} == \
                {k: v for k, v in meta_b.items() if k != "test_accuracy"}
            if "test_accuracy" in meta_a:
                assert float(meta_b["test_accuracy"]) == pytest.approx(float(meta_a["test_accuracy"]), abs=0.015)
    # and the rebuilt files behave like the shipped ones
    split = load_split()
    rebuilt_clf, shipped_clf = DigitsWorld.load(tmp_path / "digits_classifier.safetensors"), DigitsWorld.load()
    agree = (rebuilt_clf.classifier_probs(split["x_test"]).argmax(-1) == shipped_clf.classifier_probs(split["x_test"]).argmax(-1))
    assert float(agree.float().mean()) >= (1.0 if exact["digits_classifier.safetensors"] else 0.97)
    world = DigitsWorld.load(tmp_path / "digits_classifier.safetensors")
    rebuilt_metrics, _ = evaluate_digits(DigitsPolicy.from_checkpoint(tmp_path / "digits_base.safetensors"), world, 20)
    shipped_metrics, _ = evaluate_digits(DigitsPolicy.from_checkpoint(), DigitsWorld.load(), 20)
    assert rebuilt_metrics["accuracy"] == pytest.approx(shipped_metrics["accuracy"], abs=0.02)


def test_bundled_base_is_weak_and_classifier_strong():
    world = build_world("digits")
    metrics, images = world.evaluate(world.policy, per_digit=50)
    assert images.shape == (500, 1, 8, 8) and 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert 0.5 <= metrics["accuracy"] <= 0.7  # deliberately weak base: room for RL
    assert metrics["fd_extractor"] == FEATURE_EXTRACTOR
    assert metrics["diversity"] > 0.5 * metrics["real_diversity"]
    split = load_split()
    dw = DigitsWorld.load()
    clf_acc = float((dw.classifier_probs(split["x_test"]).argmax(-1) == split["y_test"]).float().mean())
    judge_acc = float((dw.judge_predict(split["x_test"]) == split["y_test"]).float().mean())
    assert clf_acc > 0.95 and judge_acc > 0.95


def test_split_is_fixed_and_stratified():
    split = load_split()
    assert split["x_train"].shape == (1437, 1, 8, 8) and split["x_test"].shape == (360, 1, 8, 8)
    assert torch.bincount(split["y_test"]).min() >= 35
    assert float(split["x_train"].max()) == 1.0 and float(split["x_train"].min()) == 0.0


def test_reward_is_probability_of_prompted_digit():
    fn = build_reward("digit_prob")
    split = load_split()
    x, y = split["x_test"][:40], split["y_test"][:40]
    right = fn(x, [PROMPTS[int(d)] for d in y], [{}] * 40)["digit_prob"]
    wrong = fn(x, [PROMPTS[(int(d) + 1) % 10] for d in y], [{}] * 40)["digit_prob"]
    assert right.shape == (40,) and float(right.mean()) > 0.9 and float(wrong.mean()) < 0.1
    assert parse_digit_prompt("the digit three") == 3 and parse_digit_prompt("a handwritten 7") == 7


def test_frechet_distance_and_diversity():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    b = torch.randn(4000, 3, generator=g, dtype=torch.float64) * 2.0 + 1.0
    # N(0, I) vs N(1, 4I): |mu|^2 + tr(I + 4I - 2*2I) = 3 + 3
    assert frechet_distance(a, b) == pytest.approx(6.0, rel=0.05)  # 4000 draws: sampling error of the moments
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)  # float64 sqrtm round-off
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]])
    assert within_class_diversity(x, torch.tensor([0, 0, 1, 1])) == pytest.approx(2.5, rel=1e-6)  # (5 + 0) / 2, fp32


def test_configs_start_with_their_command():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        first = path.read_text().splitlines()[0]  # the command: difrl train, or an entry script (real models)
        assert first.startswith(("# difrl train ", "# python ", "# accelerate launch ")), path
        assert f"configs/{path.name}" in first, path


def test_missing_and_wrong_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="digits generator checkpoint not found: .*nope.safetensors"):
        DigitsPolicy.from_checkpoint(tmp_path / "nope.safetensors")
    bad = tmp_path / "classifier_as_generator.safetensors"
    bad.write_bytes((ASSETS / "digits_classifier.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is not a digits generator checkpoint"):
        DigitsPolicy.from_checkpoint(bad)
    assert BUNDLED_BASE.is_file()
