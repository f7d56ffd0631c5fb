"""GRPO-Guard (arXiv 2510.22319; docs/reference/specs/branch-cps-guard.md §3) and TempFlow-GRPO step weights (§4).

    lr = ratio_norm_log_ratio(log_prob, log_prob_old, mean, mean_old, std)   # [B, T]
    w = step_weights("inverse_dt", sigma, sigma_next, std)                    # [B, T]
    loss, m = ppo_clip_loss(lr, torch.zeros_like(lr), adv, eps, eps, weight=w)

For a Gaussian step with x = mu_old + s eps and Delta mu = mu_theta - mu_old, the per-element
log-ratio is log r = mean_d(eps * Delta mu) / s - mean_d(Delta mu^2) / (2 s^2): the second term
biases it below 0 by an amount that explodes as 1/s^2 at low-noise steps, and the spread scales
as 1/s, so one clip range cannot serve every step (§3.1). RatioNorm adds the bias back and
multiplies by s: log r~ = s (log r + b), b = mean_d(Delta mu^2) / (2 s^2), which equals
mean_d(eps * Delta mu) exactly, centred at 0 with a step-independent scale.

b is computed **per sample** (the reference code's reduction over an empty tuple averaged it over
the batch, flow_grpo issue #244), from the mean stored at rollout time, with the gradient kept: the
identity above is what is differentiated. On-policy (mean == mean_old, log_prob == log_prob_old)
the normalised log-ratio is exactly 0.
"""

from __future__ import annotations

import torch

from difrl.samplers.kernels import reduce_elements


def ratio_norm_log_ratio(log_prob: torch.Tensor, log_prob_old: torch.Tensor, mean: torch.Tensor, mean_old: torch.Tensor,
                         std: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """log_prob, log_prob_old, std: [B, T]; mean, mean_old: [B, T, *latent] -> normalised log-ratio [B, T].
    `reduce` must match the log-prob's reduction ("mean": per-element, difrl's default)."""
    B, T = log_prob.shape
    if std.device.type == "cpu":
        if (std <= 0).any():
            raise ValueError("RatioNorm needs a stochastic transition (std > 0) at every trained step")
    else:  # on a GPU a host read per micro-step would be a sync: the same check, raised by the device
        torch._assert_async((std > 0).all(), "RatioNorm needs a stochastic transition (std > 0) at every trained step")
    sq = reduce_elements((mean - mean_old).reshape(B * T, *mean.shape[2:]) ** 2, reduce).view(B, T)
    b = sq / (2.0 * std**2)
    return std * (log_prob - log_prob_old + b)


def step_weights(kind: str, sigma: torch.Tensor, sigma_next: torch.Tensor, std: torch.Tensor) -> torch.Tensor | None:
    """Per-(sample, step) loss weights [B, T], or None for "none".

    inverse_dt: 1 / (sigma - sigma_next), GRPO-Guard's reweighting (§3.3) that makes each step's gradient
                independent of its step size (pairs with RatioNorm);
    tempflow:   2.25 * std, TempFlow-GRPO's noise-aware weight (the transition std sigma_t sqrt(dt), §4)."""
    if kind == "none":
        return None
    if kind == "inverse_dt":
        return 1.0 / (sigma - sigma_next)
    if kind == "tempflow":
        return 2.25 * std
    raise ValueError(f"step weight must be none, inverse_dt or tempflow, got {kind!r}")
