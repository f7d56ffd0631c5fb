"""PPO-clip policy loss and the KL to the reference policy for Gaussian step policies.

    loss, m = ppo_clip_loss(log_prob, log_prob_old, adv, clip_low=1e-4, clip_high=1e-4)   # [B, T] each
    kl = gaussian_step_kl(mean, mean_ref, std, h, form="flow_grpo")                      # [B, T]
    kl = k3_kl(log_prob, log_prob_ref)                                                     # per token (masked)

Per-step surrogate (docs/reference/specs/flow-grpo-family.md §1): rho = exp(l - l_old),
L = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)), averaged over valid (sample, step)
elements. Separate low/high ranges (Bagel's asymmetric clip) fall out of the same function.
"""

from __future__ import annotations

import torch

from difrl.samplers.kernels import reduce_elements


def ppo_clip_loss(log_prob: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                  clip_high: float, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """log_prob, log_prob_old: [B, T]; advantages: [B] or [B, T]; weight: optional [B, T] element weights.

    Returns the per-element loss [B, T] (the caller reduces it, so accumulation can keep a fixed
    denominator) and detached metrics tensors: approx_kl = 1/2 (l - l_old)^2, clip fractions above
    1 + eps_high and below 1 - eps_low (only where the clip is active for the sign of A), ratio."""
    adv = advantages if advantages.ndim == log_prob.ndim else advantages[:, None].expand_as(log_prob)
    log_ratio = log_prob - log_prob_old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if weight is not None:
        loss = loss * weight
    with torch.no_grad():
        metrics = {
            "ratio": ratio.detach(),
            "approx_kl": 0.5 * log_ratio.detach() ** 2,
            "clip_high": ((ratio > 1.0 + clip_high) & (adv > 0)).float(),
            "clip_low": ((ratio < 1.0 - clip_low) & (adv < 0)).float(),
        }
    return loss, metrics


def gaussian_step_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor, h: torch.Tensor,
                     form: str = "flow_grpo") -> torch.Tensor:
    """KL between two Gaussian steps with the same std, per element mean: [N, ...] -> [N].

    exact:     mean ||mu - mu_ref||^2 / (2 std^2)            (std = g sqrt(h), the transition std)
    flow_grpo: mean ||mu - mu_ref||^2 / (2 g^2), g^2 = std^2 / h  (Flow-GRPO's form: h omitted, issue #78;
               a per-step rescaling of beta that weights low-noise steps less)."""
    sq = reduce_elements((mean - mean_ref) ** 2, "mean")
    var = std.clamp_min(1e-12) ** 2
    if form == "exact":
        return sq / (2.0 * var)
    if form == "flow_grpo":
        return sq * h / (2.0 * var)
    raise ValueError(f"kl form must be 'exact' or 'flow_grpo', got {form!r}")


def k3_kl(log_prob: torch.Tensor, log_prob_ref: torch.Tensor) -> torch.Tensor:
    """Per-token (or per-element) k3 estimator of KL(pi || ref) under pi's samples:
    exp(l_ref - l) - (l_ref - l) - 1 >= 0 (Schulman's k3; d1 / MaskGRPO use it per answer token)."""
    d = log_prob_ref - log_prob
    return torch.exp(d) - d - 1.0
