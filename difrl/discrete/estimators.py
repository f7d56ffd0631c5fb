"""The masked policy's log-prob estimators for GRPO (docs/reference/specs/discrete-diffusion-rl.md §3).

    rm = remask(cfg, tokens, answer, prompt, seeds, n, t, mask_id)   # inner update n's re-masked views
    logp = token_logp(cfg, policy, tokens, rm, cond)                   # [B, L] per-token estimate, one forward

``cfg`` is a MaskedConfig (its ``estimator`` section and ``train.inner_updates`` = mu). Estimators:
``maskgrpo`` (one re-masked copy per inner update, ratio r_n = min(c + (1 - c) n / mu, 0.999),
fading-out AR-like or uniform), ``unigrpo`` (i.i.d. Bernoulli with the per-sample structured ratio
sweep), ``d1`` (every answer token masked, optional prompt masking) and ``coupled`` (full view plus
complementary views A / B at t, weights 1/t and 1/(1 - t)). A re-mask is a pure function of
(sample seeds, n, t), so the old, reference and current passes, and any sub-batch, see the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difrl.discrete.losses import ar_fade_mask, coupled_masks, d1_mask, mask_uniforms, maskgrpo_ratios, unigrpo_ratios, uniform_mask
from difrl.models.base import cond_cat


@dataclass
class Remask:
    """One inner update's re-masked views of a batch (spec section 3)."""
    inputs: torch.Tensor  # [V, B, L] long: the tokens with the view's masked positions set to the mask id
    masked: torch.Tensor  # [V, B, L] bool
    weight: torch.Tensor  # [B, L] fp32: coupled's 1/t, 1/(1 - t) per answer token; ones otherwise
    loss_mask: torch.Tensor  # [B, L] bool: tokens that enter the loss


def remask(cfg, tokens: torch.Tensor, answer: torch.Tensor, prompt: torch.Tensor, seeds: torch.Tensor,
           n: int, t: float, mask_id: int) -> Remask:
    """The re-mask of inner update n (1-based) for samples with these seeds: a pure function of
    (seeds, n, t), so any sub-batch, and the old / reference / current passes, get the same masks."""
    est, L = cfg.estimator, tokens.shape[1]
    u = mask_uniforms(seeds, n, L)
    ones = torch.ones(tokens.shape, dtype=torch.float32)
    if est.kind == "maskgrpo":
        r = float(maskgrpo_ratios(cfg.train.inner_updates, est.min_mask_rate)[n - 1])
        m = (ar_fade_mask if est.remasking == "arlike" else uniform_mask)(answer, r, u)
        views, weight, loss_mask = [m], ones, m
    elif est.kind == "unigrpo":  # i.i.d. Bernoulli(p_n) with the per-sample structured ratio sweep
        r = unigrpo_ratios(seeds, n, cfg.train.inner_updates, est.timesteps)[:, None]
        m = uniform_mask(answer, r, u)
        views, weight, loss_mask = [m], ones, m
    elif est.kind == "d1":
        m = d1_mask(answer, prompt, u, est.p_mask_prompt)
        views, weight, loss_mask = [m], ones, answer.bool()
    elif est.kind == "coupled":
        full, a, b, weight = coupled_masks(answer, t, u)
        views, loss_mask = ([full] if est.full_view else []) + [a, b], answer.bool()
    else:
        raise ValueError(f"unknown estimator {est.kind!r}")
    masked = torch.stack(views)
    inputs = torch.where(masked, torch.full_like(masked, mask_id, dtype=tokens.dtype), tokens[None])
    return Remask(inputs, masked, weight, loss_mask)


def token_logp(cfg, policy, tokens: torch.Tensor, rm: Remask, cond: dict | None = None) -> torch.Tensor:
    """[B, L] fp32 per-token log-prob estimate under `policy` from ONE forward over the stacked views.
    maskgrpo / unigrpo / d1: log p(o_k | view) at masked positions. coupled: 1/2 [l_full + w_k l_view(k)]
    with view(k) the one of A / B where k is masked (w_k l_view(k) alone without the full view).
    `cond`: the rows' conditioning (e.g. the digit label), repeated for every view. The log-softmax over the
    vocabulary (and its backward) runs on the policy's device; the result, [B, L], is on `tokens`' device."""
    V, B, L = rm.inputs.shape
    logits = policy.logits(rm.inputs.reshape(V * B, L), None if cond is None else cond_cat([cond] * V)).view(V, B, L, -1)
    dev = logits.device  # [V, B, L, vocab] stays there: only the [B, L] estimate goes back
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.to(dev)[None, :, :, None].expand(V, B, L, 1))[..., 0]
    lp = lp * rm.masked.to(dev).float()  # only masked positions carry an estimate
    if cfg.estimator.kind != "coupled":
        return lp[0].to(tokens.device)
    partial = rm.weight.to(dev) * lp[-2:].sum(0)  # A and B are disjoint: each answer token in exactly one
    return (0.5 * (lp[0] + partial) if cfg.estimator.full_view else partial).to(tokens.device)


__all__ = ["Remask", "remask", "token_logp"]
