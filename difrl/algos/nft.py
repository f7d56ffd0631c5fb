"""DiffusionNFT: the likelihood-free objective Sol-RL trains with (docs/reference/specs/lowprec-and-correctors.md §1.6;
Zheng et al., arXiv:2509.16117).

    loss, m = nft_loss(v, v_old, x_sigma, x0, sigma, advantages, beta=1.0, adv_clip=5.0)   # per sample [B]

No log-probs enter it, so it needs no sampler density and no importance correction: the clean
sample x0 (regenerated at full precision) is noised afresh, x_sigma = (1 - sigma) x0 + sigma eps,
and the trained velocity is pulled toward the "positive" implicit policy where the advantage is
high and toward the "negative" one where it is low:

    r      = clamp(clip(A, -c, c) / (2c) + 1/2, 0, 1)                 optimality weight in [0, 1]
    v_pos  = beta v + (1 - beta) v_old,  v_neg = (1 + beta) v_old - beta v
    x0_pos = x_sigma - sigma v_pos,      x0_neg = x_sigma - sigma v_neg
    L_pm   = mean((x0_pm - x0)^2) / sg(max(mean|x0_pm - x0|, 1e-5))  (adaptive weighting)
    L      = c * (r L_pos + (1 - r) L_neg) / beta                       per sample

The caller adds the reference term ref_beta * mean((v - v_ref)^2) (`velocity_kl`).
"""

from __future__ import annotations

import torch


def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(1)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_sigma: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
             advantages: torch.Tensor, beta: float = 1.0, adv_clip: float = 5.0) -> tuple[torch.Tensor, dict]:
    """v (with grad), v_old (no grad), x_sigma, x0: [B, *latent]; sigma, advantages: [B].
    Returns the per-sample loss [B] and detached metrics."""
    shape = (-1,) + (1,) * (v.ndim - 1)
    s = sigma.float().view(shape)
    v, v_old = v.float(), v_old.float().detach()
    r = (advantages.float().clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5).clamp(0.0, 1.0)
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    err_pos = x_sigma.float() - s * v_pos - x0.float()
    err_neg = x_sigma.float() - s * v_neg - x0.float()
    w_pos = _per_sample_mean(err_pos.detach().abs()).clamp(min=1e-5)  # DiffusionNFT's adaptive loss weight
    w_neg = _per_sample_mean(err_neg.detach().abs()).clamp(min=1e-5)
    loss_pos = _per_sample_mean(err_pos**2) / w_pos
    loss_neg = _per_sample_mean(err_neg**2) / w_neg
    loss = adv_clip * (r * loss_pos + (1 - r) * loss_neg) / beta
    return loss, {"nft_loss_pos": loss_pos.detach(), "nft_loss_neg": loss_neg.detach(), "nft_r": r.detach(),
                  "nft_old_gap": _per_sample_mean((v.detach() - v_old) ** 2)}


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """mean((v - v_ref)^2) per sample [B]: DiffusionNFT's pull toward the reference policy."""
    return _per_sample_mean((v.float() - v_ref.float().detach()) ** 2)


def nft_noised(x0: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps (the flow-matching forward process)."""
    s = sigma.float().view((-1,) + (1,) * (x0.ndim - 1))
    return (1 - s) * x0.float() + s * eps.float()
