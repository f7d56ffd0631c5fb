"""The flow trainer's per-micro-batch losses: GRPO and Flow-DPPO on stored SDE transitions, DiffusionNFT on clean
samples (AWM, DPO, DGPO: difrl/train/flow/matching_objectives.py).

    loss = grpo_micro_loss(policy, sub, adv, keep, correction, m, check, denom, cfg, reference_ctx, agree)
    loss = dppo_micro_loss(policy, sub, adv, keep, correction, m, check, denom, cfg, reference_ctx, agree)
    loss = nft_micro_loss(policy, sub, adv, keep, m, denom, cfg, nft_sigmas, old, reference_ctx)
    batch, correction = proximal_correction(policy, batch, cfg, micro.transitions)  # copy rollouts: pi_old, IS weights
    err = policy_ratio_check(policy, sub, cfg, agree)                # copy rollouts: the on-policy check that can fail

Each loss is summed over its micro-batch's elements and divided by a denominator fixed per optimizer
update (the update's records x steps), so gradient accumulation 1x8 equals 8x1; metrics go into `m`
(difrl.train.metrics.Metrics). `reference_ctx()` is the context in which the policy computes the
reference (difrl.train.scaffold.reference_policy). `agree` (x -> the largest x over processes,
difrl.utils.collectives.gather_max) makes the ratio checks one decision of all processes: all raise or none.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from difrl.algos import gaussian_step_kl, ppo_clip_loss, ratio_norm_log_ratio, step_weights
from difrl.algos.dppo import dppo_loss
from difrl.algos.nft import nft_loss, nft_noised, velocity_kl
from difrl.correct import METHODS as CORRECTORS
from difrl.correct import POLICY_LOSSES
from difrl.correct.core import Correction
from difrl.models.base import cond_repeat
from difrl.rollout import Rollout, recompute, sample_noise
from difrl.samplers.kernels import KERNELS
from difrl.train.scaffold import check_ratio
from difrl.utils.rng import counter_normal, mix_seed_tensor


def transition_log_prob(policy, batch: Rollout, cfg):
    """Recompute the stored transitions of `batch` (samples or tree edges) under the current policy.
    Returns (log_prob [B, T], mean [B*T, ...], std [B*T])."""
    out = recompute(policy, batch, cfg.sampler.kind, cfg.sampler.kernel_kwargs(), cfg.sampler.guidance)
    return out.log_prob, out.mean, out.std


def grpo_micro_loss(policy, sub: Rollout, adv: torch.Tensor, keep: torch.Tensor, correction, m, check: bool,
                    denom: int, cfg, reference_ctx, agree=None) -> torch.Tensor:
    """PPO-clip on the recomputed log-probs of `sub`'s transitions (Flow-GRPO), optionally with GRPO-Guard's
    RatioNorm / step weights, IS weights from difrl.correct (`correction` = (weights, keep) [b, T]) and the KL
    to the reference. adv, keep: [b]. `check`: the first on-policy micro-step, whose ratio checks take the max
    over processes through `agree` (module docstring; every process passes the same `check`)."""
    log_prob, mean, std = transition_log_prob(policy, sub, cfg)
    if check:
        first_step_checks(policy, sub, log_prob, correction, m, cfg, agree)
    elem_keep = keep[:, None].expand_as(log_prob)
    is_weight = 1.0
    if correction is not None:  # detached IS weights and rejections
        is_weight, correct_keep = correction
        elem_keep = elem_keep * correct_keep.float()
    # GRPO-Guard options (difrl.algos.guard): re-centred per-step ratio and/or per-step weights
    step_std = std.view_as(log_prob)
    weight = step_weights(cfg.train.step_weight, sub.sigma, sub.sigma_next, step_std)
    lp_new, lp_old = log_prob, sub.log_prob_old
    mask = elem_keep.bool()
    if cfg.train.ratio_norm:
        raw = torch.exp(log_prob.detach() - sub.log_prob_old)
        m.add("raw_ratio", raw, mask)
        m.add_ratio(raw, sub.step, mask, "raw_ratio_per_step")  # the left shift, per step
        lp_new = ratio_norm_log_ratio(log_prob, sub.log_prob_old, mean.view_as(sub.mean_old), sub.mean_old,
                                      step_std, cfg.sampler.log_prob_reduce)
        lp_old = torch.zeros_like(lp_new)  # the normalised log-ratio is already relative to old
    if cfg.train.policy_loss == "ppo_clip":
        pg, pm = ppo_clip_loss(lp_new, lp_old, adv, cfg.train.clip_low, cfg.train.clip_high, weight=weight)
    else:  # GSPO / CTPO / ASPO / VESPO (difrl.correct.POLICY_LOSSES), per step [b, T]
        pg, pm = policy_loss(lp_new, lp_old, adv, mask, cfg.train.policy_loss, cfg.train.policy_loss_options,
                             sub.extras.get("log_prob_rollout"))
        pg = pg if weight is None else pg * weight
    return policy_loss_terms(policy, sub, pg, pm, is_weight, elem_keep, mask, mean, std, m, denom, cfg, reference_ctx)


def policy_loss_terms(policy, sub: Rollout, pg, pm: dict, is_weight, elem_keep, mask, mean, std, m, denom: int, cfg,
                      reference_ctx) -> torch.Tensor:
    """The micro-step's loss from per-transition policy-gradient terms pg [b, T] (GRPO's, Flow-DPPO's): IS-weighted,
    kept, summed over the update's transitions (denom), plus the reference KL; their metrics into `m`."""
    loss = (pg * is_weight * elem_keep).sum() / denom
    if cfg.train.kl_beta > 0:
        loss = loss + reference_kl(policy, sub, mean, std, elem_keep, m, denom, cfg, reference_ctx)
    m.add("policy_loss", pg, mask)
    for name, value in pm.items():
        m.add(name, value, mask)
    m.add_ratio(pm["ratio"], sub.step, mask)
    return loss


def first_step_checks(policy, sub: Rollout, log_prob, correction, m, cfg, agree) -> None:
    """The first on-policy micro-step: ratio 1 against the stored log-probs, and with a rollout copy (whose
    log_prob_old is itself a recompute) against the sampler kernel's own evaluation (policy_ratio_check)."""
    m.add("first_step_max_abs_log_ratio", torch.tensor(check_ratio(log_prob, sub.log_prob_old, cfg.train.ratio_tol, agree)))
    if correction is not None:
        m.add("first_step_policy_max_abs_log_ratio", torch.tensor(policy_ratio_check(policy, sub, cfg, agree)))


def reference_kl(policy, sub: Rollout, mean, std, elem_keep, m, denom: int, cfg, reference_ctx) -> torch.Tensor:
    """train.kl_beta * the Gaussian step KL to the reference policy (train.kl_form) over `sub`'s transitions."""
    with torch.no_grad(), reference_ctx():
        _, mean_ref, _ = transition_log_prob(policy, sub, cfg)
    h = (sub.sigma - sub.sigma_next).reshape(-1)
    kl = gaussian_step_kl(mean, mean_ref, std, h, cfg.train.kl_form).view_as(elem_keep)
    kl_keep = sub.extras.get("kl_keep")  # GARDO: the KL on its flagged samples only, [b] (train/flow/method_stage.py)
    kl_elem = elem_keep if kl_keep is None else elem_keep * kl_keep.to(elem_keep)[:, None]
    m.add("kl", kl, kl_elem.bool())
    return cfg.train.kl_beta * (kl * kl_elem).sum() / denom


def dppo_micro_loss(policy, sub: Rollout, adv: torch.Tensor, keep: torch.Tensor, correction, m, check: bool,
                    denom: int, cfg, reference_ctx, agree=None) -> torch.Tensor:
    """Flow-DPPO (difrl.algos.dppo): -A rho on `sub`'s recomputed transitions, a transition dropped where the exact
    Gaussian KL(old || new) of its step reaches dppo.kl_threshold and the step pushes further; IS weights from a
    rollout copy and the reference KL as in grpo_micro_loss. adv, keep: [b]."""
    log_prob, mean, std = transition_log_prob(policy, sub, cfg)
    if check:
        first_step_checks(policy, sub, log_prob, correction, m, cfg, agree)
    elem_keep = keep[:, None].expand_as(log_prob)
    is_weight = 1.0
    if correction is not None:
        is_weight, correct_keep = correction
        elem_keep = elem_keep * correct_keep.float()
    mask = elem_keep.bool()
    pg, pm = dppo_loss(log_prob, sub.log_prob_old, mean, sub.mean_old, std.view_as(log_prob), adv, cfg.dppo.kl_threshold)
    return policy_loss_terms(policy, sub, pg, pm, is_weight, elem_keep, mask, mean, std, m, denom, cfg, reference_ctx)


def policy_loss(log_prob, log_prob_old, adv, mask, name: str, options: dict, log_prob_rollout=None):
    """A loss of difrl.correct.POLICY_LOSSES per step [b, T] and its metrics (ratio pi / pi_old, approx_kl).
    VESPO's sequence ratio takes the rollout copy's pi_old / mu factor when the batch came from a copy."""
    kw = dict(options)
    if name == "vespo" and log_prob_rollout is not None:
        kw["log_prob_rollout"] = log_prob_rollout
    pg = POLICY_LOSSES[name](log_prob, log_prob_old, adv, mask, **kw)
    lr = (log_prob - log_prob_old).detach()
    return pg, {"ratio": torch.exp(lr), "approx_kl": 0.5 * lr**2}


def nft_micro_loss(policy, sub: Rollout, adv: torch.Tensor, keep: torch.Tensor, m, denom: int, cfg,
                   sigmas: torch.Tensor, old, reference_ctx) -> torch.Tensor:
    """DiffusionNFT (difrl.algos.nft): each clean sample of `sub` noised afresh at the T trained `sigmas`
    (noise from its seed), the implicit positive/negative policies around the old policy's velocity (`old`:
    the EMA holding it), plus ref_beta * the velocity KL to the reference."""
    B, Tn = len(sub), len(sigmas)
    x0 = sub.x_final.repeat_interleave(Tn, dim=0)  # [B*T, *latent], sample-major like cond_repeat
    sigma = sigmas.to(x0.device).repeat(B)  # drawn and noised where the samples live (the policy's device)
    eps = counter_normal(mix_seed_tensor(sub.seeds, 7), list(range(Tn)), tuple(policy.latent_shape), x0.device)  # [T, B, ...]
    x_sigma = nft_noised(x0, sigma, eps.transpose(0, 1).reshape(x0.shape))
    cond = cond_repeat(sub.cond, Tn)
    with torch.no_grad():  # before the graph is built: swapping weights in place would invalidate it
        with old.swapped():
            v_old = policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance)
        v_ref = None
        if cfg.nft.ref_beta > 0:
            with reference_ctx():
                v_ref = policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance)
    v = policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance)
    per, nm = nft_loss(v, v_old, x_sigma, x0, sigma, adv.repeat_interleave(Tn), cfg.nft.beta, cfg.nft.adv_clip)
    w = keep.repeat_interleave(Tn)
    loss = (per * w).sum() / denom
    if v_ref is not None:
        kl = velocity_kl(v, v_ref)
        loss = loss + cfg.nft.ref_beta * (kl * w).sum() / denom
        m.add("kl", kl, w.bool())
    m.add("policy_loss", per, w.bool())
    for name, value in nm.items():
        m.add(name, value, w.bool())
    return loss


def nft_sigmas(cfg, sigmas: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's trained sigmas: the first timestep_fraction of the rollout schedule (Sol-RL: 6 of 10)."""
    return sigmas[:max(1, int(cfg.sampler.num_steps * cfg.nft.timestep_fraction))]


@torch.no_grad()
def proximal_correction(policy, batch: Rollout, cfg, micro_batch: int | None = None, gather=None, rank: int = 0):
    """Rollouts that came from another policy mu (a quantized or stale copy): recompute the proximal policy's
    log-probs and means (PPO's ratio and the first-step check are against it) and weigh each transition by
    pi_old / mu through difrl.correct. In micro-batches of about `micro_batch` transitions (the trainer passes
    train.micro_batch as difrl.train.flow.plan resolved it; None: an explicit train.micro_batch): a real model
    cannot take all B*T transitions at once. `gather` (t -> every process's t in rank order, the trainer's
    difrl.utils.collectives.gather; every process has the same B) and `rank`: the corrector sees the log-probs of
    every process, as one process with the same global batch does (batch-normalised TIS, AIS's ESS test and the
    diagnostics are statistics of the whole batch), and this process keeps its own rows [rank * B, (rank + 1) * B).
    Returns (batch with log_prob_old / mean_old replaced, the Correction)."""
    micro_batch = cfg.train.micro_batch if micro_batch is None else micro_batch
    if not isinstance(micro_batch, int):
        raise ValueError("proximal_correction needs train.micro_batch resolved (difrl.train.flow.plan.plan_flow_iteration)")
    per = max(1, micro_batch // max(1, batch.step.shape[1]))  # records of about micro_batch transitions
    parts = [transition_log_prob(policy, batch.select(torch.arange(lo, min(lo + per, len(batch)))), cfg)
             for lo in range(0, len(batch), per)]
    lp_prox, mean_prox = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    log_prob_rollout = batch.log_prob_old
    batch.log_prob_old, batch.mean_old = lp_prox, mean_prox.view_as(batch.mean_old)
    batch.extras["log_prob_rollout"] = log_prob_rollout  # [B, T] mu's log-probs (VESPO's pi_old / mu factor)
    lp_all, lr_all = (lp_prox, log_prob_rollout) if gather is None else (gather(lp_prox), gather(log_prob_rollout))
    correction = CORRECTORS[cfg.correct.method](lp_all, lr_all, None, **cfg.correct.options)  # [N * B, T]
    if gather is not None:
        own = slice(rank * len(batch), (rank + 1) * len(batch))
        correction = Correction(correction.weights[own], correction.keep[own], correction.diagnostics)
    # the copy-vs-policy gap on the rollout's own transitions, |log mu - log pi_old|, as metrics of its own
    gap = (lp_all - lr_all).abs()
    correction.diagnostics["copy_policy_log_prob_gap"] = gap.mean()
    correction.diagnostics["copy_policy_log_prob_gap_max"] = gap.max()
    return batch, correction


@torch.no_grad()
def policy_ratio_check(policy, sub: Rollout, cfg, agree=None) -> float:
    """The on-policy ratio check when rollouts come from a copy. There the stored log-probs are the copy's and
    log_prob_old is the trainer's own recompute, so "recompute == log_prob_old" tests the recompute against
    itself. This evaluates the trained policy independently, the way the rollout engine does: for every stored
    transition of `sub`, a forward per step column on the same inputs (x [b, T, ...], sigma, cond; the module in
    eval mode, as in rollouts), the sampler kernel draws x_next from the sample's own step noise and scores it.
    The trainer's recompute of those on-policy transitions (in the module's current mode) must give the same
    log-probs: ratio 1. Returns max |log ratio| (over processes with `agree`: all raise together); raises
    RatioCheckError above train.ratio_tol."""
    B, T = sub.step.shape
    module, lat = policy.module, tuple(policy.latent_shape)
    steps = sub.step.unique()
    all_noise = sample_noise(sub.seeds, steps.tolist(), lat, sub.x.device)  # [S, b, *latent], as the rollout drew it
    pos = torch.searchsorted(steps, sub.step)  # [b, T]
    was_training = module.training
    module.eval()
    try:
        x_next, log_prob = [], []
        for t in range(T):
            v = policy.velocity(sub.x[:, t], sub.sigma[:, t], sub.cond, cfg.sampler.guidance)
            out = KERNELS[cfg.sampler.kind](sub.x[:, t], v, sub.sigma[:, t], sub.sigma_next[:, t],
                                            all_noise[pos[:, t], torch.arange(B, device=pos.device)],
                                            **cfg.sampler.kernel_kwargs())
            x_next.append(out.x_next)
            log_prob.append(out.log_prob)
    finally:
        module.train(was_training)
    own = replace(sub, x_next=torch.stack(x_next, 1), log_prob_old=torch.stack(log_prob, 1), extras={})
    lp, _, _ = transition_log_prob(policy, own, cfg)
    return check_ratio(lp, own.log_prob_old, cfg.train.ratio_tol, agree)
