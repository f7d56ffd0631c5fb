"""The masked-diffusion GRPO trainer (difrl/train/masked.py) end to end on tiny Sudoku runs (seconds each).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_train_masked.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difrl.cli import main
from difrl.config import ConfigError
from difrl.train.masked import TIMING_KEYS, remask, token_logp, train
from difrl.train.masked_config import load_masked_config
from difrl.utils.io import load_safetensors_checked
from difrl.worlds import sudoku

# 8 rollouts per iteration (2 puzzles x 4), 2 inner updates of 2 optimizer steps, a 16-puzzle eval
TINY = ["seed=3", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4",
        "train.inner_updates=2", "train.iterations=1", "train.lr=1e-3", "eval.count=16", "eval.every=0"]

ESTIMATORS = {
    "maskgrpo_arlike": ("estimator.kind=maskgrpo", "estimator.remasking=arlike"),
    "maskgrpo_random": ("estimator.kind=maskgrpo", "estimator.remasking=random", "estimator.min_mask_rate=0.3"),
    "d1": ("estimator.kind=d1", "advantage.scale=mean"),
    "coupled": ("estimator.kind=coupled", "advantage.scale=loo"),
    "coupled_no_full_kl": ("estimator.kind=coupled", "estimator.full_view=false", "train.kl_beta=0.05"),
    "maskgrpo_lora_kl": ("estimator.kind=maskgrpo", "train.lora.enabled=true", "train.kl_beta=0.05"),
}


def run(out: Path, *overrides: str) -> tuple[dict, Path]:
    return train(load_masked_config(None, [*TINY, *overrides]), out_dir=out), out


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_safetensors_checked(path, "test")[0]


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_first_micro_step_is_on_policy_and_prompt_never_masked(tmp_path, name):
    _, d = run(tmp_path / "r", "train.iterations=2", *ESTIMATORS[name])
    rows = metrics(d)
    assert len(rows) == 2
    for row in rows:
        assert row["first_step_max_abs_log_ratio"] == 0.0  # checked (and enforced) by check_ratio
        assert row["prompt_masked_frac"] == 0.0  # the givens were never masked in any training input
        assert 0.0 < row["mask_frac"] <= 1.0
        assert row["trained_samples"] > 0
    if name.startswith("d1") or name.startswith("coupled"):
        assert rows[0]["mask_frac"] == 1.0  # d1's view masks every answer token (coupled: A + B cover them)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_remask_is_a_function_of_seed_and_iteration(name):
    cfg = load_masked_config(None, [*TINY, *ESTIMATORS[name]])
    puzzles, _ = sudoku.sample_training_puzzles(6, (3, 9), seed=1)
    tokens, prompt = sudoku.encode(puzzles)
    answer = ~prompt
    tokens = torch.where(answer, torch.randint(0, 4, tokens.shape), tokens)
    seeds = torch.arange(6, dtype=torch.int64) * 7919 + 3
    full = [remask(cfg, tokens, answer, prompt, seeds, n, 0.37, sudoku.MASK_ID) for n in (1, 2)]
    for rm in full:
        assert not (rm.masked & prompt[None]).any()  # the prompt is never masked
        assert not (rm.loss_mask & prompt).any()
        assert (rm.inputs[rm.masked] == sudoku.MASK_ID).all()
        assert torch.equal(rm.inputs[0][prompt], tokens[prompt])
    if cfg.estimator.kind == "maskgrpo":  # a new mask per inner update
        assert not torch.equal(full[0].masked, full[1].masked)
    sub = torch.tensor([4, 1])  # any sub-batch (a micro-batch) sees the same masks as the full batch
    part = remask(cfg, tokens[sub], answer[sub], prompt[sub], seeds[sub], 2, 0.37, sudoku.MASK_ID)
    assert torch.equal(part.masked, full[1].masked[:, sub]) and torch.equal(part.loss_mask, full[1].loss_mask[sub])
    policy = sudoku.load_base()
    with torch.no_grad():
        lp_full = token_logp(cfg, policy, tokens, full[1])[sub]
        lp_part = token_logp(cfg, policy, tokens[sub], part)
    assert torch.allclose(lp_full, lp_part, atol=1e-6)
    assert (lp_full[~full[1].loss_mask[sub]] == 0).all()


def test_d1_prompt_masking_is_the_only_prompt_masking():
    cfg = load_masked_config(None, [*TINY, "estimator.kind=d1", "estimator.p_mask_prompt=0.5"])
    puzzles, _ = sudoku.sample_training_puzzles(32, 6, seed=2)
    tokens, prompt = sudoku.encode(puzzles)
    rm = remask(cfg, tokens, ~prompt, prompt, torch.arange(32, dtype=torch.int64), 1, 0.5, sudoku.MASK_ID)
    assert (rm.masked[0] & prompt).any() and not (rm.loss_mask & prompt).any()  # masked input, never a loss target


def test_resume_continues_exactly(tmp_path):
    common = ("train.iterations=3", "checkpoint_every=1", "estimator.kind=maskgrpo")
    run(tmp_path / "a", *common)
    run(tmp_path / "b", "train.iterations=2", *common[1:])
    summary = train(load_masked_config(tmp_path / "b" / "config.yaml", ["train.iterations=3", f"resume={tmp_path / 'b'}"]))
    assert summary["iterations"] == 3
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    wa, wb = weights(tmp_path / "a" / "policy.safetensors"), weights(tmp_path / "b" / "policy.safetensors")
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((tmp_path / r / "summary.json").read_text()) for r in "ab")
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]


def test_unknown_or_bad_config_key_is_named(tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.lrr"):
        load_masked_config(None, ["train.lrr=1e-3"])
    with pytest.raises(ConfigError, match="estimator.kind"):
        load_masked_config(None, ["estimator.kind=grpo"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  kind: sudoku\nestimator:\n  mask_rate: 0.5\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "estimator.mask_rate" in err and "min_mask_rate" in err  # named, with the close match


def test_cli_routes_sudoku_to_the_masked_trainer_and_writes_artifacts(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "configs/sudoku.yaml", *TINY, "train.iterations=2", "eval.every=1", "checkpoint_every=1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cell_accuracy" in text and "solve_rate" in text
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "policy.safetensors", "reward_curve.png"):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000002"
    summary = json.loads((out / "summary.json").read_text())
    for when in ("eval_before", "eval_after"):
        assert 0.0 <= summary[when]["cell_accuracy"] <= 1.0 and 0.0 <= summary[when]["solve_rate"] <= 1.0
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2] and "eval/cell_accuracy" in rows[0]
    assert load_masked_config(out / "config.yaml").train.iterations == 2
    # the trained policy is a plain checkpoint: model.path takes it, and it is the trained weights
    trained = sudoku.load_base(out / "policy.safetensors")
    again, _ = sudoku.evaluate_sudoku(trained, count=16)
    assert again["cell_accuracy"] == summary["eval_after"]["cell_accuracy"]


def test_cli_eval_of_the_sudoku_config(capsys):
    from difrl.cli import main

    assert main(["eval", "configs/sudoku.yaml", "eval.count=16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_puzzles"] == 16 and 0.0 <= out["cell_accuracy"] <= 1.0 and 0.0 <= out["solve_rate"] <= 1.0
