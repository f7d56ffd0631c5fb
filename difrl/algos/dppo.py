"""Flow-DPPO: GRPO's ratio surrogate with the ratio clip replaced by a trust region on the exact KL between the old
and the new Gaussian SDE transition (docs/guides/methods.md "Flow-DPPO"; arXiv 2606.11025, Tencent-Hunyuan/UniRL FlowDPPO).

    pg, m = dppo_loss(log_prob, log_prob_old, mean, mean_old, std, h, adv, threshold=1e-5)   # per step [b, T]

A step kernel's transition is N(mu, std^2 I) with std fixed by the schedule (not by the network), so the old and new
policies of a transition differ only in their means and KL(old || new) = mean_elements (mu - mu_old)^2 / (2 std^2)
exactly (difrl.algos.gaussian_step_kl, form "exact"; per-element mean, as the reference reduces it, so the threshold
is per latent element). A transition is dropped from the gradient only when that KL is at least `threshold` and the
step pushes further in the advantage's direction (ratio > 1 with A > 0, or ratio < 1 with A < 0); a step that moves
back toward the old policy always passes.
"""

from __future__ import annotations

import torch

from difrl.algos.losses import gaussian_step_kl


def transition_kl(mean: torch.Tensor, mean_old: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mu_old, std^2) || N(mu, std^2)) per transition, element mean: mean, mean_old [N, *latent], std [N] -> [N]."""
    return gaussian_step_kl(mean.float(), mean_old.float(), std.float(), torch.ones_like(std, dtype=torch.float32), "exact")


def dppo_loss(log_prob: torch.Tensor, log_prob_old: torch.Tensor, mean: torch.Tensor, mean_old: torch.Tensor,
              std: torch.Tensor, advantages: torch.Tensor, threshold: float) -> tuple[torch.Tensor, dict]:
    """log_prob, log_prob_old: [b, T]; mean, mean_old: [b, T, *latent] (or [b*T, ...]); std: [b, T] or [b*T];
    advantages: [b]. Returns (-A rho on the kept transitions, 0 on the dropped ones [b, T], detached metrics:
    ratio, the transition KL, the dropped fraction `trust_masked`, approx_kl)."""
    b, T = log_prob.shape
    kl = transition_kl(mean.reshape(b * T, -1), mean_old.reshape(b * T, -1), std.reshape(-1)).view(b, T)
    log_ratio = log_prob - log_prob_old
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].float()
    r = ratio.detach()
    drop = (kl.detach() >= threshold) & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))
    pg = torch.where(drop, torch.zeros_like(ratio), -adv * ratio)
    lr = log_ratio.detach()
    return pg, {"ratio": r, "trust_kl": kl.detach(), "trust_masked": drop.float(), "approx_kl": 0.5 * lr**2}
