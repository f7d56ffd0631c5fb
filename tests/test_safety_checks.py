"""Safety checks that can fail: the on-policy ratio check with a rollout copy, and the rollout copy's weight sync.

    pytest tests/test_safety_checks.py -q

With a rollout copy, PPO's old log-probs are the trainer's own recompute, so comparing the first micro-step with
them tests the recompute against itself; `policy_ratio_check` evaluates the trained policy independently (the
sampler kernel on the same inputs) and must fire when the recompute is wrong. `RolloutCopy.verify` must fire when
a sync leaves one layer stale even though others changed.
"""

import json

import pytest
import torch
from difrl.models.digits import DigitsPolicy, digit_prompt
from difrl.quant import QUANT_PRESETS, QuantLinear, RolloutCopy, WeightSyncError, merged_state_dict
from difrl.quant import formats as F
from difrl.rollout import rollout
from difrl.samplers import sigma_schedule
from difrl.train.flow import objectives
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import train
from difrl.train.metrics import Metrics
from difrl.train.scaffold import RatioCheckError
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

TINY = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
        "train.grad_accum=2", "train.iterations=1", "eval.every=0", "eval.per_digit=2", "eval.num_steps=2"]


def rows(run_dir):
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------- the ratio check


def _copy_batch(fmt="fp8"):
    """A digits policy, its `fmt` rollout copy and a copy rollout of 4 samples with 3 trained steps each."""
    cfg = load_flow_config(None, [*TINY, f"rollout.precision={fmt}"])
    policy = DigitsPolicy.from_checkpoint()
    rc = RolloutCopy(policy.module, fmt, **QUANT_PRESETS["digits"])
    sigmas = sigma_schedule(cfg.sampler.num_steps)
    train_mask = torch.tensor([True, True, True, False])
    with rc.active(policy):
        batch = rollout(policy, [digit_prompt(d) for d in (1, 2, 3, 4)], torch.arange(4), sigmas, cfg.sampler.kind,
                        cfg.sampler.kernel_kwargs(), train_mask, train_mask)
    return cfg, policy, batch


def test_policy_ratio_check_passes_on_the_policy_and_measures_the_copy_gap():
    cfg, policy, batch = _copy_batch()
    log_prob_rollout = batch.log_prob_old.clone()
    batch, correction = objectives.proximal_correction(policy, batch, cfg)
    gap = (batch.log_prob_old - log_prob_rollout).abs()
    assert float(gap.min()) > 0  # the fp8 copy is another policy: every transition's log-prob moved
    # the diagnostics' fp32 mean / max against the same gaps reduced here: reordering only
    assert correction.diagnostics["copy_policy_log_prob_gap"] == pytest.approx(float(gap.mean()), rel=1e-6)
    assert correction.diagnostics["copy_policy_log_prob_gap_max"] == pytest.approx(float(gap.max()), rel=1e-6)
    assert objectives.policy_ratio_check(policy, batch.select(torch.arange(2)), cfg) <= FLOW_FIRST_STEP_LOG_RATIO


def test_policy_ratio_check_fires_where_the_recompute_against_itself_cannot(monkeypatch):
    """The fault: the trainer's recompute scores transitions with another noise level than the sampler used.
    The proximal log-probs and the first micro-step share the recompute, so they still agree (the old check
    passes); the independent evaluation through the sampler kernel does not."""
    cfg, policy, batch = _copy_batch()
    real = objectives.recompute

    def wrong(policy, batch, kernel, kernel_kwargs=None, guidance=1.0):
        return real(policy, batch, kernel, {**kernel_kwargs, "noise_level": kernel_kwargs["noise_level"] * 1.05}, guidance)

    monkeypatch.setattr(objectives, "recompute", wrong)
    batch, correction = objectives.proximal_correction(policy, batch, cfg)
    sub = batch.select(torch.arange(2))
    m = Metrics(cfg.sampler.num_steps)
    adv, keep = torch.tensor([1.0, -1.0]), torch.ones(2)
    with pytest.raises(RatioCheckError, match="on-policy ratio check failed"):
        objectives.grpo_micro_loss(policy, sub, adv, keep, (correction.weights[:2], correction.keep[:2]), m, True, 6,
                                   cfg, None)
    # the check against itself passed the fault
    assert m.result()["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    monkeypatch.undo()
    # the true recompute agrees again
    assert objectives.policy_ratio_check(policy, sub, cfg) <= FLOW_FIRST_STEP_LOG_RATIO


@pytest.mark.slow
def test_trainer_logs_both_checks_and_the_copy_gap(tmp_path):
    train(load_flow_config(None, [*TINY, "rollout.precision=nvfp4"]), out_dir=tmp_path)
    (r,) = rows(tmp_path)
    assert r["first_step_policy_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert r["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert r["correct/copy_policy_log_prob_gap_max"] >= r["correct/copy_policy_log_prob_gap"] > 1e-6


# ---------------------------------------------------------------------------------- the weight-sync check


def _lora_digits():
    from peft import LoraConfig, get_peft_model

    policy = DigitsPolicy.from_checkpoint()
    torch.manual_seed(0)
    net = get_peft_model(policy.module, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                   target_modules=policy.lora_target_modules))
    return net


def _update(net, scale=0.05):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_single", "mxfp8_floor", "fp8"])
def test_sync_that_skips_one_layer_is_caught(fmt, monkeypatch):
    net = _lora_digits()
    rc = RolloutCopy(net, fmt, **QUANT_PRESETS["digits"])
    real = QuantLinear.update_weight
    stale = rc.module.blocks[1].fc2

    def skip_one(self, w, b=None):  # the bug: one layer silently keeps its old weights
        return torch.zeros((), dtype=torch.bool) if self is stale else real(self, w, b)

    monkeypatch.setattr(QuantLinear, "update_weight", skip_one)
    _update(net)
    with pytest.raises(WeightSyncError, match=r"layer 'blocks.1.fc2' of the .* copy does not hold the policy's current"):
        rc.sync(net)  # other layers changed, so the "nothing changed" check alone would pass
    monkeypatch.undo()
    rc.sync(net)  # a correct sync passes the check


def test_sync_check_compares_high_precision_tensors_too(monkeypatch):
    net = _lora_digits()
    rc = RolloutCopy(net, "nvfp4", **QUANT_PRESETS["digits"])
    with torch.no_grad():
        next(p for n, p in net.named_parameters() if "x_out" in n and "lora" not in n).add_(0.1)  # a skipped layer
    sd = merged_state_dict(net)
    with pytest.raises(WeightSyncError, match="x_out.* differs from the policy's"):
        rc.verify(sd)
    rc.sync(net)


def test_sampled_rows_equal_the_whole_weights_quantization():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g) * torch.logspace(-3, 1, 300)[:, None]
    for fmt in F.FORMATS:
        full = F.qdq(w, fmt, "weight")
        tile = F.weight_tile_rows(fmt)
        starts = list(range(0, 300, tile))
        for start in (starts[0], starts[len(starts) // 2], starts[-1]):
            stop = min(start + 2 * tile, 300)
            assert torch.equal(F.qdq_weight_rows(w, fmt, start, stop), full[start:stop]), (fmt, start)  # grid: exact
        ql = QuantLinear(torch.nn.Linear(96, 300), fmt)
        with torch.no_grad():
            ql.set_weight(w)
        for start in (starts[0], starts[-1]):
            assert torch.equal(ql.weight_hat_rows(start, min(start + tile, 300)), ql.weight_hat()[start:start + tile]), fmt
    with pytest.raises(ValueError, match="do not lie on nvfp4's 16-row tiles"):
        F.qdq_weight_rows(w, "nvfp4", 3, 19)
