"""The digit-tokens world: tokens, start state, reward, the bundled base, its eval and checkpoint errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_digit_tokens.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from difrl.discrete.policy import TinyMaskedPolicy
from difrl.utils.io import load_safetensors_checked
from difrl.worlds.digit_tokens import (
    BUNDLED_BASE,
    LEVELS,
    MASK_ID,
    SEQ_LEN,
    VOCAB,
    digit_token_reward,
    evaluate_digit_tokens,
    images_to_tokens,
    load_base,
    sample_training_labels,
    save_grid,
    start_tokens,
    tokens_to_images,
)
from difrl.worlds.digits import ASSETS, DigitsWorld, evaluate_digits, image_metrics, load_split

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
DIGITS_KEYS = {"accuracy", "judge_accuracy", "reward", "fd", "fd_extractor", "diversity", "real_diversity", "samples",
               "num_steps"}


@pytest.fixture(scope="module")
def world() -> DigitsWorld:
    return DigitsWorld.load()


def test_constants():
    assert (LEVELS, MASK_ID, VOCAB, SEQ_LEN) == (17, 17, 18, 64)


def test_token_round_trip_is_exact():
    levels = torch.arange(LEVELS).repeat(4)[:SEQ_LEN]  # every grey level appears
    tokens = torch.stack([levels, levels.flip(0)])
    images = tokens_to_images(tokens)
    assert images.shape == (2, 1, 8, 8) and images.dtype == torch.float32
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert torch.equal(images_to_tokens(images), tokens)
    x = load_split()["x_train"][:100]  # the data lie on the 17 levels: exact both ways
    assert torch.equal(tokens_to_images(images_to_tokens(x)), x)
    masked = tokens.clone()
    masked[:, :5] = MASK_ID
    assert (tokens_to_images(masked).flatten(1)[:, :5] == 0).all()


def test_start_tokens_and_labels():
    labels = sample_training_labels(256, seed=3)
    assert labels.shape == (256,) and labels.dtype == torch.long and set(labels.tolist()) == set(range(10))
    assert torch.equal(labels, sample_training_labels(256, seed=3)) and not torch.equal(labels, sample_training_labels(256, 4))
    tokens, cond = start_tokens(labels[:7])
    assert tokens.shape == (7, SEQ_LEN) and (tokens == MASK_ID).all()
    assert torch.equal(cond["label"], labels[:7])
    assert cond["prompt_mask"].shape == (7, SEQ_LEN) and cond["prompt_mask"].dtype == torch.bool
    assert not cond["prompt_mask"].any()  # the label is the prompt; no token position is


def test_reward_is_classifier_probability(world):
    split = load_split()
    x, y = split["x_test"][:30], split["y_test"][:30]
    tokens = images_to_tokens(x)
    wrong = (y + 1) % 10
    by_hand = torch.softmax(world.classifier(x), -1)
    r = digit_token_reward(tokens, y, world)
    assert r.shape == (30,) and r.dtype == torch.float32
    # tokens -> images is exact (17 levels), the classifier then runs in other batches: fp32 reordering
    torch.testing.assert_close(r, by_hand[torch.arange(30), y], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(digit_token_reward(tokens, wrong, world), by_hand[torch.arange(30), wrong], rtol=1e-5,
                               atol=1e-6)
    assert float(r.mean()) > 0.9


def test_bundled_base_loads_with_metadata():
    policy = load_base()
    cfg = policy.net.cfg
    assert (cfg.num_labels, cfg.vocab_size, cfg.mask_id, cfg.seq_len) == (10, VOCAB, MASK_ID, SEQ_LEN)
    _, meta = load_safetensors_checked(BUNDLED_BASE, "bundled")
    assert (meta["num_labels"], meta["vocab_size"], meta["seq_len"]) == ("10", "18", "64")
    assert BUNDLED_BASE.stat().st_size < 3 * 2**20  # as small as the other bundled checkpoints
    tokens, cond = start_tokens(torch.tensor([0, 9]))
    logits = policy.logits(tokens, cond)
    assert logits.shape == (2, SEQ_LEN, VOCAB) and (logits[..., MASK_ID] < -1e8).all()


def test_eval_is_reproducible_and_has_digits_keys(world, tmp_path):
    policy = load_base()
    policy.net.train()
    m1, images = evaluate_digit_tokens(policy, world, per_digit=4, seed=5, batch=16)
    assert policy.net.training  # mode restored
    m2, images2 = evaluate_digit_tokens(policy, world, per_digit=4, seed=5, batch=40)  # batching does not matter
    assert torch.equal(images, images2) and m1 == m2  # tokens -> images on 17 levels; per-sample seeded draws
    m3, images3 = evaluate_digit_tokens(policy, world, per_digit=4, seed=6)
    assert not torch.equal(images, images3)
    assert set(m1) == DIGITS_KEYS | {"nfe", "sampler"}
    assert images.shape == (40, 1, 8, 8) and m1["samples"] == 40 and m1["sampler"] == "emerge"
    assert 0 < m1["nfe"] <= m1["num_steps"] == 16 and m1["accuracy"] > 0.5  # the base model draws its digits
    # the metrics are the digits world's, on the decoded images
    labels = torch.arange(10).repeat_interleave(4)
    assert {k: v for k, v in m1.items() if k not in ("nfe", "sampler")} == image_metrics(world, images, labels, 16)
    m4, _ = evaluate_digit_tokens(policy, world, per_digit=2, sampler="llada", steps=8, temperature=0.0)
    assert m4["num_steps"] == 8 and m4["nfe"] == 8 and m4["sampler"] == "llada"
    with pytest.raises(ValueError, match="unknown sampler"):
        evaluate_digit_tokens(policy, world, per_digit=1, sampler="nope")
    save_grid(images, tmp_path / "grid.png")
    from PIL import Image

    assert Image.open(tmp_path / "grid.png").size == (4 * (8 * 4 + 1) + 1, 10 * (8 * 4 + 1) + 1)  # 10 rows of 4


def test_flow_digits_eval_uses_image_metrics(world):
    from difrl.models.digits import DigitsPolicy
    from difrl.worlds.digits import sample_eval_images

    m, images = evaluate_digits(DigitsPolicy.from_checkpoint(), world, per_digit=3, num_steps=4)
    _, labels = sample_eval_images(DigitsPolicy.from_checkpoint(), 3, 4)
    assert m == image_metrics(world, images, labels, 4)


def test_missing_and_wrong_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="digit-tokens masked transformer checkpoint not found: .*nope.safetensors"):
        load_base(tmp_path / "nope.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(BUNDLED_BASE.read_bytes()[:500])
    with pytest.raises(ValueError, match="corrupt.safetensors is not a readable safetensors file"):
        load_base(corrupt)
    with pytest.raises(ValueError, match="digits_classifier.safetensors is not a digit-tokens"):
        load_base(ASSETS / "digits_classifier.safetensors")
    with pytest.raises(ValueError, match="sudoku_base.safetensors is not a digit-tokens .*num_labels 0"):
        load_base(ASSETS / "sudoku_base.safetensors")


def test_pretrain_script_reproduces_on_a_few_steps(monkeypatch):
    """The script's training is a pure function of its seed (the full run is checked against the bundled
    file by hand: `python scripts/pretrain_digit_tokens.py --out /tmp/x`, then compare; it takes minutes)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import pretrain_digit_tokens as script

    a = script.train_base(seed=0, steps=3)
    b = script.train_base(seed=0, steps=3)
    c = script.train_base(seed=1, steps=3)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    _, meta = load_safetensors_checked(BUNDLED_BASE, "bundled")
    assert int(meta["steps"]) == script.STEPS and float(meta["label_noise"]) == script.LABEL_NOISE
    assert {k: v for k, v in meta.items() if k in ("dim", "layers", "heads", "num_labels")} == \
        {k: str(getattr(script.NET, k)) for k in ("dim", "layers", "heads", "num_labels")}
    sys.modules.pop("pretrain_digit_tokens", None)
