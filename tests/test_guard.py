"""GRPO-Guard RatioNorm and per-step weights (docs/reference/specs/branch-cps-guard.md §3-4), alone and in the trainer.

    pytest tests/test_guard.py -q
"""

import json
import math

import pytest
import torch

from difrl.algos import ratio_norm_log_ratio, step_weights
from difrl.samplers import gaussian_log_prob
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import train
from tolerances import FLOW_FIRST_STEP_LOG_RATIO


def _synthetic(B=4000, D=64, stds=(0.5, 0.2, 0.1, 0.05, 0.03, 0.02), delta=0.01, seed=0):
    """Rollout x = mu_old + s eps per step; the trained policy moved every mean by Delta mu ~ N(0, delta^2)."""
    g = torch.Generator().manual_seed(seed)
    T = len(stds)
    std = torch.tensor(stds).expand(B, T).contiguous()
    mean_old = torch.randn(B, T, D, generator=g)
    eps = torch.randn(B, T, D, generator=g)
    mean = mean_old + delta * torch.randn(B, T, D, generator=g)
    x = mean_old + std[..., None] * eps
    lp = lambda mu: gaussian_log_prob(x.view(B * T, D), mu.reshape(B * T, D), std.reshape(-1)).view(B, T)
    return lp(mean), lp(mean_old), mean, mean_old, std, eps


def test_ratio_norm_recentres_a_left_shifted_step_dependent_ratio():
    log_prob, log_prob_old, mean, mean_old, std, eps = _synthetic()
    raw = torch.exp(log_prob - log_prob_old).mean(0)  # [T]
    normed = torch.exp(ratio_norm_log_ratio(log_prob, log_prob_old, mean, mean_old, std)).mean(0)
    # the raw ratio is left-shifted, worst at the low-noise steps: bias mean(dmu^2) / (2 s^2) = 0.125 at s = 0.02
    assert float(raw[-1]) < 0.9 and float(raw[0]) > 0.999 and torch.all(raw[1:] <= raw[:-1] + 1e-4)
    # mean 1 at every step, up to the sampling noise of a mean over B = 4000 samples (not rounding)
    torch.testing.assert_close(normed, torch.ones_like(normed), rtol=0, atol=1e-3)
    spread = ratio_norm_log_ratio(log_prob, log_prob_old, mean, mean_old, std).std(0)
    assert float(spread.max() / spread.min()) < 1.1  # and one scale for all steps (raw: 1/s, a 25x range)


def test_ratio_norm_is_the_eps_projection_and_exactly_zero_on_policy():
    log_prob, log_prob_old, mean, mean_old, std, eps = _synthetic(B=8)
    lr = ratio_norm_log_ratio(log_prob, log_prob_old, mean, mean_old, std)
    # fp32 cancellation: the log-ratio is a difference of two log-probs ~1e3 x larger, so it keeps ~1e-3 of itself
    torch.testing.assert_close(lr, (eps * (mean - mean_old)).mean(-1), rtol=1e-3, atol=1e-6)
    on = ratio_norm_log_ratio(log_prob_old, log_prob_old, mean_old, mean_old, std)
    assert torch.all(on == 0)


def test_bias_is_per_sample_not_per_batch():
    """flow_grpo #244: a batch-mean b shifts every sample by the others' drift."""
    log_prob, log_prob_old, mean, mean_old, std, _ = _synthetic(B=2)
    mean = mean.clone()
    mean[1] = mean_old[1]  # sample 1 did not move
    lp_mix = torch.stack([log_prob[0], log_prob_old[1]])
    lr = ratio_norm_log_ratio(lp_mix, log_prob_old, mean, mean_old, std)
    assert torch.all(lr[1] == 0) and torch.all(lr[0] != 0)


def test_ratio_norm_gradient_is_the_eps_projection():
    log_prob, log_prob_old, mean, mean_old, std, eps = _synthetic(B=3, D=8)
    mu = mean.clone().requires_grad_(True)
    B, T, D = mu.shape
    x = mean_old + std[..., None] * eps
    lp = gaussian_log_prob(x.view(B * T, D), mu.view(B * T, D), std.reshape(-1)).view(B, T)
    ratio_norm_log_ratio(lp, log_prob_old, mu, mean_old, std).sum().backward()
    torch.testing.assert_close(mu.grad, eps / D, rtol=1e-4, atol=1e-6)  # d mean_d(eps * dmu) / d mu; fp32 cancellation


def test_ratio_norm_needs_noise():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="std > 0"):
        ratio_norm_log_ratio(z, z, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), z)


def test_step_weights():
    sigma, sigma_next, std = torch.tensor([[1.0, 0.5]]), torch.tensor([[0.9, 0.25]]), torch.tensor([[0.3, 0.1]])
    # fp32 of decimal sigmas (0.9, 0.3, ...): a few ulp
    torch.testing.assert_close(step_weights("inverse_dt", sigma, sigma_next, std), torch.tensor([[10.0, 4.0]]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(step_weights("tempflow", sigma, sigma_next, std), torch.tensor([[0.675, 0.225]]),
                               rtol=1e-5, atol=1e-6)
    assert step_weights("none", sigma, sigma_next, std) is None
    with pytest.raises(ValueError, match="step weight"):
        step_weights("linear", sigma, sigma_next, std)


TINY = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
        "train.grad_accum=2", "train.iterations=2", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3"]


@pytest.mark.parametrize("extra", [["train.ratio_norm=true", "train.step_weight=inverse_dt", "train.clip_low=2e-6",
                                    "train.clip_high=2e-6"], ["train.step_weight=tempflow"]])
def test_trainer_runs_with_guard_options(tmp_path, extra):
    train(load_flow_config(None, [*TINY, *extra]), out_dir=tmp_path)
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO for r in rows)
    if "train.ratio_norm=true" in extra:
        assert set(rows[0]["raw_ratio_per_step"]) == set(rows[0]["ratio_per_step"]) == {"0", "1", "2"}
        # the raw ratio pi / pi_old before re-centring: 1 on the first update, moved (slightly) by the second
        assert all(r["raw_ratio"] != 1.0 and abs(r["raw_ratio"] - 1.0) < 0.1 for r in rows)
    assert all(r["loss"] == r["policy_loss"] and math.isfinite(r["loss"]) for r in rows)  # kl_beta = 0: no KL term
