"""The flow GRPO trainer end to end on tiny runs of the digits world (a few seconds each).

    .venv/bin/python -m pytest tests/test_train.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difrl.cli import main
from difrl.rewards import REWARDS, RewardError, register_reward
from difrl.rewards.digits import digit_prob
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import TIMING_KEYS, RatioCheckError, train
from difrl.utils.io import load_safetensors_checked
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

# 8 samples per iteration (2 prompts x 4), 4 steps, 2 optimizer updates per rollout, tiny evals
TINY = [
    "seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
    "train.micro_batch=6", "train.grad_accum=2", "train.iterations=1", "train.lr=1e-3",
    "train.clip_low=1e-3", "train.clip_high=1e-3", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3",
]


def run(out: Path, *overrides: str) -> tuple[dict, Path]:
    cfg = load_flow_config(None, [*TINY, *overrides])
    return train(cfg, out_dir=out), out


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def latest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_safetensors_checked(ckpt / "trainable.safetensors", "test")[0]


# ------------------------------------------------------------------------- artifacts and ratio


def test_run_writes_every_artifact(tmp_path):
    summary, d = run(tmp_path / "r", "train.iterations=2", "eval.every=1", "train.ema_decay=0.5")
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "reward_curve.png", "policy.safetensors"):
        assert (d / name).is_file(), name
    grids = sorted(p.name for p in (d / "samples").glob("*.png"))
    assert grids == ["after-iter-000002.png", "before-iter-000000.png", "eval-iter-000001.png"]
    saved = json.loads((d / "summary.json").read_text())
    for key in ("accuracy", "judge_accuracy", "fd", "diversity", "real_diversity"):
        assert isinstance(saved["eval_before"][key], float) and isinstance(saved["eval_after"][key], float)
    assert saved["fd_extractor"] == "difrl-digits-cnn-penultimate-64d"
    rows = metrics(d)
    assert [r["iteration"] for r in rows] == [1, 2]
    for key in ("reward_mean", "reward_std", "adv_mean", "adv_std", "loss", "approx_kl", "clip_high", "clip_low",
                "ratio_mean", "ratio_std", "zero_spread_groups", "ratio_per_step"):
        assert key in rows[0], key
    assert set(rows[0]["ratio_per_step"]) == {"0", "1", "2"}  # all steps but the last of 4
    assert "eval/accuracy" in rows[0] and "eval/accuracy" not in rows[1]  # the last eval is eval_after
    # the saved config reloads to the same run
    again = load_flow_config(d / "config.yaml")
    assert again.train.iterations == 2 and again.sampler.num_steps == 4
    # the trained policy is a plain generator checkpoint: `model.path` takes it
    out = tmp_path / "eval.json"
    assert main(["eval", str(d), "eval.per_digit=3", "eval.num_steps=3"]) == 0


@pytest.mark.parametrize("overrides", [
    (),
    ("sampler.kind=cps", "sampler.noise_level=0.8"),
    # train.micro_batch counts transitions: 2 samples x the T trained steps of each mode
    ("sampler.kind=dance_sde", "sampler.noise_level=0.3", "steps.mode=random_subset", "steps.fraction=0.5",
     "train.micro_batch=4"),
    ("steps.mode=sliding_window", "steps.window_size=2", "train.kl_beta=0.1", "train.lora.enabled=false",
     "train.micro_batch=4"),
    ("sampler.guidance=2.0", "steps.mode=random_window", "steps.window_size=1", "train.micro_batch=2"),
], ids=["flow_sde", "cps", "dance_subset", "sliding_full_ft_kl", "cfg_random_window"])
def test_first_micro_step_is_on_policy(tmp_path, overrides):
    _, d = run(tmp_path / "r", *overrides)
    row = metrics(d)[0]
    # ratio check passed (it raises otherwise) and the log-prob recomputation is exact here
    assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO  # 0 here; another CPU may round apart
    assert row["trained_samples"] + 4 * row["dropped_groups"] == 8


def test_ratio_check_names_the_likely_cause(tmp_path, monkeypatch):
    from difrl.models.digits import DigitsPolicy

    plain = DigitsPolicy.velocity

    def with_dropout(self, x, sigma, cond, guidance=1.0):  # a train/eval-mode difference
        v = plain(self, x, sigma, cond, guidance)
        return torch.nn.functional.dropout(v, 0.1, training=self.module.training)

    monkeypatch.setattr(DigitsPolicy, "velocity", with_dropout)
    with pytest.raises(RatioCheckError, match="dropout"):
        run(tmp_path / "r")
    # opting out runs
    run(tmp_path / "r2", "train.ratio_check=false")


# ------------------------------------------------------------------------- updates


@pytest.mark.parametrize("small", [3, 1], ids=["whole_samples", "single_transitions"])
def test_accumulation_1x8_equals_8x1(tmp_path, small):
    # one optimizer update over the same 8 samples (x 3 trained steps = 24 transitions), as 1 micro-batch of 24
    # transitions or 8 accumulated of 3 (whole samples) / 24 accumulated of 1 (samples split into transitions).
    # Adam's first step is ~lr * sign(g), which would hide the gradient; adam_eps = 1 makes the
    # update ~ lr * g / (|g| + 1), so the weights compare the accumulated (and clipped) gradient.
    common = ("rollout.prompts_per_iter=2", "rollout.group_size=4", "train.max_grad_norm=0.05", "train.kl_beta=0.2",
              "train.adam_eps=1.0", "train.lr=1.0", "train.weight_decay=0")
    _, a = run(tmp_path / "a", *common, "train.micro_batch=24", "train.grad_accum=1")
    _, b = run(tmp_path / "b", *common, f"train.micro_batch={small}", f"train.grad_accum={24 // small}")
    _, init = run(tmp_path / "init", *common, "train.iterations=0")
    wa, wb, w0 = latest_weights(a), latest_weights(b), latest_weights(init)
    assert wa.keys() == wb.keys()
    moved = 0.0
    for k in wa:
        delta_a, delta_b = wa[k] - w0[k], wb[k] - w0[k]
        moved = max(moved, float(delta_a.abs().max()))
        # fp32 sums in another order (1 micro-batch of 8 vs 8 of 1), through Adam's g / (|g| + 1): 1e-4 of the move
        torch.testing.assert_close(delta_a, delta_b, rtol=1e-4, atol=1e-4 * float(delta_a.abs().max()) + 1e-12, msg=k)
    assert moved > 1e-4  # the update is not trivially zero
    ra, rb = metrics(a)[0], metrics(b)[0]  # their metrics: fp32 means in another order
    for k in ("policy_loss", "kl", "loss", "grad_norm", "reward_mean"):
        assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_every_trainable_parameter_changes_and_base_stays(tmp_path, lora):
    flag = f"train.lora.enabled={str(lora).lower()}"
    # 0 iterations: the checkpoint holds the initial trainable weights (same seed, same init)
    _, d0 = run(tmp_path / "init", flag, "train.iterations=0", "train.weight_decay=0")
    _, d1 = run(tmp_path / "one", flag, "train.iterations=1", "train.weight_decay=0")
    w0, w1 = latest_weights(d0), latest_weights(d1)
    assert w0.keys() == w1.keys() and w0
    if lora:
        assert all("lora_" in k for k in w0)  # only the adapter is trained
        # LoRA B starts at 0, so A's gradient is 0 on the first update; the second moves it
        assert all(float(w0[k].abs().max()) == 0.0 for k in w0 if "lora_B" in k)
    unchanged = [k for k in w0 if torch.equal(w0[k], w1[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    if lora:  # the frozen base of the merged policy = bundled base + the LoRA delta only
        from difrl.models.digits import BUNDLED_BASE

        base = load_safetensors_checked(BUNDLED_BASE, "test")[0]
        merged = load_safetensors_checked(d0 / "policy.safetensors", "test")[0]
        for k in base:  # at init (B = 0) the merged policy is exactly the base
            assert torch.equal(base[k], merged[k]), k


def test_resume_continues_exactly(tmp_path):
    # random windows, EMA, KL and FD-based stopping state all cross the resume boundary
    extra = ("steps.mode=random_window", "steps.window_size=2", "train.ema_decay=0.7", "train.kl_beta=0.1",
             "eval.every=2", "stop.fd_rise=100", "train.micro_batch=4")  # 2 samples x 2 steps
    _, full = run(tmp_path / "full", *extra, "train.iterations=6")
    _, part = run(tmp_path / "part", *extra, "train.iterations=3")
    cfg = load_flow_config(None, [*TINY, *extra, "train.iterations=6", f"resume={part}"])
    train(cfg)
    assert metrics(full) == metrics(part)
    wf, wp = latest_weights(full), latest_weights(part)
    for k in wf:
        assert torch.equal(wf[k], wp[k]), k
    assert torch.equal(load_safetensors_checked(full / "policy.safetensors", "test")[0]["x_out.weight"],
                       load_safetensors_checked(part / "policy.safetensors", "test")[0]["x_out.weight"])
    sf, sp = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert sf["eval_before"] == sp["eval_before"] and sf["eval_after"] == sp["eval_after"]


def test_fd_rise_stops_and_saves(tmp_path):
    # a threshold below 1 means "any evaluation is worse than the best": stop after `patience` of them
    summary, d = run(tmp_path / "r", "train.iterations=10", "eval.every=1", "stop.fd_rise=0.5", "stop.patience=2")
    assert summary["iterations"] == 3 and "stop.fd_rise" in summary["stopped_early"]
    assert (d / "checkpoints" / "iter-000003").is_dir()


# ------------------------------------------------------------------------- bad input


@pytest.fixture
def nan_reward():
    @register_reward("test_nan_for_seed")
    def factory(bad_index: int = 5):
        def fn(images, prompts, metadata):
            scores = digit_prob()(images, prompts, metadata)["digit_prob"].clone()
            if len(scores) > bad_index:  # the reward probe before the run scores 2 samples
                scores[bad_index] = float("nan")
            return {"test_nan_for_seed": scores}
        return fn

    yield "test_nan_for_seed"
    REWARDS.pop("test_nan_for_seed")


def test_nan_reward_stops_with_prompt_and_seed(tmp_path, nan_reward):
    with pytest.raises(RewardError) as err:
        run(tmp_path / "r", f"reward.weights={{{nan_reward}: 1.0}}")
    msg = str(err.value)
    assert "iteration 1" in msg and "test_nan_for_seed" in msg and "nan" in msg
    assert "prompt ids [" in msg and "seeds [" in msg and "resume=" in msg
    # nothing is lost: a checkpoint was written before stopping
    assert (tmp_path / "r" / "checkpoints" / "iter-000000").is_dir()


def test_nan_reward_drop_group(tmp_path, nan_reward):
    summary, d = run(tmp_path / "r", f"reward.weights={{{nan_reward}: 1.0}}", "reward.on_error=drop_group",
                     "reward.max_failed_frac=0.5",
                     "train.iterations=2")
    rows = metrics(d)
    assert [r["failed_reward_groups"] for r in rows] == [1, 1]
    assert all(r["trained_samples"] <= 4 for r in rows)  # the failing sample's group (4 samples) is dropped
    assert all(r["reward_mean"] == r["reward_mean"] for r in rows)  # logged stats stay finite


def test_raising_reward_message(tmp_path):
    @register_reward("test_raises")
    def factory():
        def fn(images, prompts, metadata):
            raise OSError("reward server unreachable")
        return fn

    try:
        with pytest.raises(RewardError, match="raised OSError: reward server unreachable.*seeds"):
            run(tmp_path / "r", "reward.weights={test_raises: 1.0}")
    finally:
        REWARDS.pop("test_raises")


def test_cli_bad_key_missing_checkpoint_corrupted_state(tmp_path, capsys):
    cfg = str(Path(__file__).resolve().parent.parent / "configs" / "digits.yaml")
    assert main(["train", cfg, "train.lrr=1e-4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "train.lrr" in err and "train.lr" in err
    assert not (tmp_path / "x").exists()  # nothing written before the config is valid

    assert main(["train", cfg, "sampler.kind=cpss"]) == 2
    err = capsys.readouterr().err
    assert "sampler.kind" in err and "cps" in err

    missing = tmp_path / "nope" / "model.safetensors"
    assert main(["train", cfg, f"model.path={missing}", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "digits generator checkpoint" in err

    # a corrupted state file: resume names the file and stops before touching the run
    _, d = run(tmp_path / "r")
    ckpt = d / "checkpoints" / "iter-000001"
    (ckpt / "trainable.safetensors").write_bytes(b"not a safetensors file")
    before = (d / "metrics.jsonl").read_text()
    assert main(["train", "train.iterations=2", f"resume={d}"]) == 2  # the run's own config.yaml
    err = capsys.readouterr().err
    assert "trainable.safetensors" in err
    assert (d / "metrics.jsonl").read_text() == before

    (ckpt / "state.json").write_text("{ truncated")
    assert main(["train", "train.iterations=2", f"resume={d}"]) == 2
    assert "state.json" in capsys.readouterr().err

    assert main(["train", cfg, *TINY, f"resume={tmp_path / 'empty'}"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_startup_validation_messages(tmp_path):
    # 8 samples x 3 trained steps = 24 transitions per iteration; train.micro_batch counts transitions
    with pytest.raises(ValueError, match=r"24 transitions per iteration, not a multiple of train.micro_batch x "
                                         r"train.grad_accum = 5 x 1"):
        run(tmp_path / "r", "train.micro_batch=5", "train.grad_accum=1")
    # DiffusionNFT's loss takes every trained sigma of a sample together: a micro-batch of whole samples only
    with pytest.raises(ValueError, match=r"train.micro_batch=3 transitions is not a multiple of the 2 trained step\(s\) "
                                         r"per sample, and DiffusionNFT's loss needs .*: use train.micro_batch=2 or 4 "
                                         r"\(with train.grad_accum=1\), or train.micro_batch=auto \(8 sample"):
        run(tmp_path / "n", "train.objective=nft", "train.clip_low=1e-4", "train.clip_high=1e-4", "train.micro_batch=3",
            "train.grad_accum=1")  # (TINY's PPO clip range is refused under nft: reset to the default)
    from difrl.config import ConfigError

    with pytest.raises(ConfigError, match="steps.window_start"):
        load_flow_config(None, [*TINY, "steps.mode=fixed_window", "steps.window_start=2", "steps.window_size=2"])
