"""Likelihood-free objectives on the flow-matching loss of re-noised rollout samples: advantage-weighted matching
(AWM), online Diffusion-DPO and DGPO (docs/guides/methods.md has the equations, reference values and deviations).

    l = matching_error(v, x0, eps)                                  # [N] mean((v - (eps - x0))^2)
    per = awm_loss(v, x0, eps, sigma, adv, "ghuber", 0.25)          # [N] A * w(l, sigma)
    coef, loss, m = dpo_coefficients(delta, group_ids, adv, beta)   # delta = l - l_ref [B, T] -> d loss / d l
    coef, loss, m = dgpo_coefficients(delta, group_ids, adv, beta)

No log-probs enter: the clean sample x0 of a rollout is noised afresh, x_sigma = (1 - sigma) x0 + sigma eps, and the
network's velocity is compared with the flow-matching target eps - x0, as in pretraining. AWM weighs each sample's
matching loss by its advantage. DPO and DGPO compare the policy's matching loss with the frozen reference's
(delta = l - l_ref, the implicit reward is -beta delta) inside a group; their losses are functions of the deltas of
several samples at once, so the trainer evaluates them in a pre-pass without gradients and trains each sample with
its coefficient c = d loss / d l (detached): sum_i c_i l_i(theta) has the preference loss's gradient at the
pre-pass weights, whatever the micro-batching (difrl/train/flow/matching_objectives.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AWM_WEIGHTINGS = ("uniform", "t", "ghuber")
GHUBER_EPS = 1e-10  # the reference's epsilon inside (l + eps)^p: keeps the power's gradient finite at l = 0


def matching_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Per-sample flow-matching error mean((v - (eps - x0))^2): v, x0, eps [N, *latent] -> [N] fp32."""
    return ((v.float() - (eps.float() - x0.float())) ** 2).flatten(1).mean(1)


def awm_weighting(err: torch.Tensor, sigma: torch.Tensor, kind: str = "uniform", power: float = 0.25) -> torch.Tensor:
    """AWM's per-sample loss w(l, sigma) of the matching error l [N] at noise level sigma [N]:
    uniform: l;  t: sigma l;  ghuber: sigma ((l + e)^p - e^p) / p (a generalised Huber: large errors count less)."""
    if kind == "uniform":
        return err
    if kind == "t":
        return sigma.float() * err
    if kind == "ghuber":
        return sigma.float() * ((err + GHUBER_EPS) ** power - GHUBER_EPS**power) / power
    raise ValueError(f"awm weighting must be one of {AWM_WEIGHTINGS}, got {kind!r}")


def awm_loss(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor, advantages: torch.Tensor,
             weighting: str = "uniform", power: float = 0.25) -> tuple[torch.Tensor, dict]:
    """Advantage-weighted matching per sample [N]: A * w(l, sigma). Minimising it lowers the matching error of
    samples with A > 0 (more likely) and raises it for A < 0. With every A = 1 and uniform weighting it is the
    plain flow-matching loss. Returns (loss [N], detached metrics)."""
    err = matching_error(v, x0, eps)
    per = advantages.float() * awm_weighting(err, sigma, weighting, power)
    return per, {"matching_error": err.detach()}


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each record's dense group index [B] (in the sorted order of the ids) and the number of groups."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if len(inverse) else 0


def dpo_coefficients(delta: torch.Tensor, group_ids: torch.Tensor, advantages: torch.Tensor, beta: float,
                     keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Online Diffusion-DPO on each group's best-vs-worst pair (the highest and the lowest advantage):
    z = beta ((l_w - l_w,ref) - (l_l - l_l,ref)),  loss = -log sigmoid(-z) = softplus(z) per pair and trained sigma.
    delta = l - l_ref: [B, T] (T trained sigmas, each its own pair term); group_ids, advantages, keep: [B].
    Returns (coefficients [B, T] = d loss / d l: +beta sigmoid(z) on the winner, -beta sigmoid(z) on the loser,
    0 elsewhere and for groups whose best and worst tie or that are not kept; the pair losses [pairs, T];
    metrics: the implicit reward margin -z / beta and the pair accuracy z < 0)."""
    delta = delta.float()
    keep = torch.ones_like(advantages, dtype=torch.bool) if keep is None else keep.bool()
    idx, n = _group_index(group_ids)
    adv = torch.where(keep, advantages.float(), torch.nan)
    coef = torch.zeros_like(delta)
    losses, margins = [], []
    for g in range(n):
        members = (idx == g).nonzero().flatten()
        a = adv[members]
        if members.numel() < 2 or not keep[members].all() or a.max() <= a.min():  # no preference in this group
            continue
        w, lo = members[a.argmax()], members[a.argmin()]
        z = beta * (delta[w] - delta[lo])  # [T]
        coef[w] = beta * torch.sigmoid(z)
        coef[lo] = -beta * torch.sigmoid(z)
        losses.append(F.softplus(z))
        margins.append(-z / beta)
    if not losses:
        empty = delta.new_zeros((0, delta.shape[1]))
        return coef, empty, {}
    loss, margin = torch.stack(losses), torch.stack(margins)
    return coef, loss, {"dpo_margin": margin, "dpo_accuracy": (margin > 0).float()}


def dgpo_coefficients(delta: torch.Tensor, group_ids: torch.Tensor, advantages: torch.Tensor, beta: float,
                      keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """DGPO's group preference: the positive group (A > 0) preferred to the negative one (A < 0), each sample
    weighted by |A|; with the implicit reward -beta (l - l_ref):
    s_g = (beta / G) sum_i A_i (l_i - l_i,ref),  loss_g = -log sigmoid(-s_g) = softplus(s_g),
    d loss_g / d l_i = sigmoid(s_g) (beta / G) A_i. Like the reference implementation the coefficient drops the
    constant beta / G (its recipe's KL weights and learning rates are for that scale): c_i = sigmoid(s_g) A_i.
    delta: [B, T]; group_ids, advantages, keep: [B] (a group not kept, or of one sample, gets 0).
    Returns (coefficients [B, T], the group losses [groups, T], metrics: the group weight sigmoid(s_g))."""
    delta = delta.float()
    keep = torch.ones_like(advantages, dtype=torch.bool) if keep is None else keep.bool()
    adv = torch.where(keep, advantages.float(), 0.0)
    idx, n = _group_index(group_ids)
    size = torch.zeros(n, device=delta.device).index_add_(0, idx, keep.float())  # [groups] kept members G
    term = adv[:, None] * delta  # [B, T]
    s = torch.zeros(n, delta.shape[1], device=delta.device).index_add_(0, idx, term) * beta / size.clamp_min(1)[:, None]
    weight = torch.sigmoid(s)  # [groups, T]
    dropped = torch.zeros(n, device=delta.device).index_add_(0, idx, (~keep).float())
    valid = ((size >= 2) & (dropped == 0))[:, None]  # [groups, 1]: whole groups of 2 or more
    coef = torch.where(valid[idx], weight[idx] * adv[:, None], 0.0)
    loss = F.softplus(s)[valid.expand_as(s)].view(-1, s.shape[1])
    return coef, loss, {"dgpo_group_weight": weight[valid.expand_as(s)]}
