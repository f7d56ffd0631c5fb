"""The flow trainer's likelihood-free objectives beside DiffusionNFT: advantage-weighted matching (AWM), online
Diffusion-DPO and DGPO (docs/guides/methods.md; the formulas are difrl.algos.matching). Selected by config alone:

    difrl train configs/digits_awm.yaml        # train.objective=awm | dpo | dgpo

    sigmas = trained_sigmas(cfg, schedule)                   # [T] re-noising sigmas (NFT's too), None for grpo / dppo
    prepare_update(policy, batch, adv, keep, cfg, sigmas, reference_ctx, gather, rank, per, m)   # DPO / DGPO pre-pass
    loss = matching_micro_loss(policy, sub, adv, keep, m, denom, cfg, sigmas, ema, reference_ctx)

Each rollout's clean sample x0 is noised afresh at the T trained sigmas, x_sigma = (1 - sigma) x0 + sigma eps, with
eps drawn from the sample's seed (AWM) or its group's (DPO / DGPO: a group's samples share noise and sigma, so their
matching errors compare); the same (x_sigma, sigma) in the pre-pass and in every micro-step. DPO's and DGPO's losses
couple the samples of a group (possibly on several processes and in several micro-batches): `prepare_update` runs the
policy and the frozen reference once without gradients over this process's records, gathers the deltas
l - l_ref of every process and stores each record's coefficient c = d loss / d l in batch.extras["pref_coef"] [B, T];
a micro-step then trains sum c l(theta), whose gradient is the preference loss's at the weights of the pre-pass. The
pre-pass runs at the start of the policy update, so with one optimizer update per rollout (the default) the gradient
is exact and accumulation 1x8 equals 8x1; later updates of the same rollout keep those coefficients (like PPO's old
log-probs). Each loss is summed over its micro-batch and divided by the update's records x T (`denom`).
"""

from __future__ import annotations

import torch

from difrl.algos.matching import awm_loss, dgpo_coefficients, dpo_coefficients, matching_error
from difrl.algos.nft import nft_noised, velocity_kl
from difrl.models.base import cond_repeat
from difrl.train.flow.objectives import nft_sigmas
from difrl.train.method_config import MATCHING_OBJECTIVES
from difrl.utils.rng import counter_normal, mix_seed_tensor

NOISE_STREAM = 11  # the re-noising draws' stream (DiffusionNFT's is 7)


def trained_sigmas(cfg, sigmas: torch.Tensor) -> torch.Tensor | None:
    """The sigmas at which a likelihood-free objective re-noises the clean samples: DiffusionNFT's, or the first
    matching.timestep_fraction of the rollout schedule (AWM, DPO, DGPO). None: the objective trains the stored SDE
    transitions (grpo, dppo)."""
    if cfg.train.objective == "nft":
        return nft_sigmas(cfg, sigmas)
    if cfg.train.objective in MATCHING_OBJECTIVES:
        return sigmas[:max(1, int(cfg.sampler.num_steps * cfg.matching.timestep_fraction))]
    return None


def needs_reference(cfg) -> bool:
    """Whether the trainer keeps the frozen reference: a KL to it, or DPO / DGPO (their implicit reward is against it)."""
    t = cfg.train
    return t.kl_beta > 0 or (t.objective == "nft" and cfg.nft.ref_beta > 0) or t.objective in ("dpo", "dgpo")


def needs_old(cfg) -> bool:
    """Whether the trainer keeps an EMA "old" policy: DiffusionNFT's sampler, AWM's EMA-KL anchor (awm.ema_beta > 0)."""
    return cfg.train.objective == "nft" or (cfg.train.objective == "awm" and cfg.awm.ema_beta > 0)


def old_decay(cfg, iteration: int) -> float:
    """The old policy's decay after `iteration`: d = min(rate * iteration, max) with the objective's rate and max."""
    if cfg.train.objective == "awm":
        return min(cfg.awm.ema_decay_rate * iteration, cfg.awm.ema_decay_max)
    return min(cfg.nft.old_decay_rate * iteration, cfg.nft.old_decay_max)


def renoised(policy, sub, sigmas: torch.Tensor, cfg, per_group: bool):
    """x0 [b*T, *latent] (sample-major, like cond_repeat), sigma [b*T], eps, x_sigma and cond of `sub`'s clean samples
    at the T `sigmas`; eps from each sample's seed, or (per_group) from its group id and the run's seed."""
    B, Tn = len(sub), len(sigmas)
    x0 = sub.x_final.repeat_interleave(Tn, dim=0)
    sigma = sigmas.to(x0.device).repeat(B)
    key = mix_seed_tensor(sub.group_ids, cfg.seed, NOISE_STREAM) if per_group else mix_seed_tensor(sub.seeds, NOISE_STREAM)
    eps = counter_normal(key, list(range(Tn)), tuple(policy.latent_shape), x0.device)  # [T, b, *latent]
    eps = eps.transpose(0, 1).reshape(x0.shape)
    return x0, sigma, eps, nft_noised(x0, sigma, eps), cond_repeat(sub.cond, Tn)


@torch.no_grad()
def prepare_update(policy, batch, advantages: torch.Tensor, keep: torch.Tensor, cfg, sigmas: torch.Tensor,
                   reference_ctx, gather=None, rank: int = 0, per: int | None = None, m=None) -> None:
    """DPO / DGPO (no-op otherwise): each record's coefficient d loss / d l [B, T] into batch.extras["pref_coef"], from
    the deltas l - l_ref of every process's records (`gather`: t -> every process's t in rank order; every process
    has the same number of records, so the same forwards). In chunks of `per` records (a micro-batch). The losses'
    values go to `m` as policy_loss (identical on every process)."""
    obj = cfg.train.objective
    if obj not in ("dpo", "dgpo"):
        return
    per = per or len(batch)
    deltas = []
    for lo in range(0, len(batch), per):
        sub = batch.select(torch.arange(lo, min(lo + per, len(batch))))
        x0, sigma, eps, x_sigma, cond = renoised(policy, sub, sigmas, cfg, per_group=True)
        err = matching_error(policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance), x0, eps)
        with reference_ctx():
            err_ref = matching_error(policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance), x0, eps)
        deltas.append((err - err_ref).view(len(sub), len(sigmas)))
    delta = torch.cat(deltas)  # [B, T]
    device = delta.device
    adv, kept, groups = advantages.to(device).float(), keep.to(device) > 0, batch.group_ids.to(device)
    if obj == "dgpo":
        adv = adv.clamp(-cfg.dgpo.adv_clip, cfg.dgpo.adv_clip)
    adv = torch.where(kept, adv, 0.0)  # a dropped sample's advantage may be NaN (a failed reward)
    if gather is not None:
        delta, groups, adv, kept = gather(delta), gather(groups), gather(adv), gather(kept.long()).bool()
    rule, beta = (dpo_coefficients, cfg.dpo.beta) if obj == "dpo" else (dgpo_coefficients, cfg.dgpo.beta)
    coef, losses, metrics = rule(delta, groups, adv, beta, kept)
    own = slice(rank * len(batch), (rank + 1) * len(batch))
    batch.extras["pref_coef"] = coef[own]
    if m is not None and losses.numel():  # an iteration without a preference (every group tied) logs none
        m.add("policy_loss", losses)
        m.add("pref_delta", delta)
        for name, value in metrics.items():
            m.add(name, value)


def matching_micro_loss(policy, sub, adv: torch.Tensor, keep: torch.Tensor, m, denom: int, cfg, sigmas: torch.Tensor,
                        ema, reference_ctx) -> torch.Tensor:
    """One micro-batch of AWM, DPO or DGPO (module docstring): the policy's velocity on `sub`'s re-noised clean
    samples; AWM: A' w(l, sigma) plus ema_beta * mean((v - v_ema)^2) (`ema`: the EMA old policy, None when
    awm.ema_beta = 0); DPO / DGPO: pref_coef * l; all plus train.kl_beta * mean((v - v_ref)^2). adv, keep: [b]."""
    obj, Tn = cfg.train.objective, len(sigmas)
    x0, sigma, eps, x_sigma, cond = renoised(policy, sub, sigmas, cfg, per_group=obj != "awm")
    g = cfg.sampler.guidance
    with torch.no_grad():  # before the graph is built: swapping weights in place would invalidate it
        v_ema = None
        if obj == "awm" and ema is not None:
            with ema.swapped():
                v_ema = policy.velocity(x_sigma, sigma, cond, g)
        v_ref = None
        if cfg.train.kl_beta > 0:
            with reference_ctx():
                v_ref = policy.velocity(x_sigma, sigma, cond, g)
    v = policy.velocity(x_sigma, sigma, cond, g)
    w = keep.float().repeat_interleave(Tn)  # [b*T]
    mask = w > 0
    if obj == "awm":
        c = cfg.awm.adv_clip
        a = adv.float().clamp(-c, c) * (cfg.awm.adv_max / c)
        per, am = awm_loss(v, x0, eps, sigma, a.repeat_interleave(Tn), cfg.awm.weighting, cfg.awm.ghuber_power)
        m.add("policy_loss", per.detach(), mask)
        err = am["matching_error"]
    else:
        err_g = matching_error(v, x0, eps)
        per = sub.extras["pref_coef"].to(err_g.device).reshape(-1) * err_g  # [b*T]
        err = err_g.detach()
    m.add("matching_error", err, mask)
    loss = (per * w).sum() / denom
    if v_ref is not None:
        kl = velocity_kl(v, v_ref)
        loss = loss + cfg.train.kl_beta * (kl * w).sum() / denom
        m.add("kl", kl.detach(), mask)
    if v_ema is not None:
        ema_kl = velocity_kl(v, v_ema)
        loss = loss + cfg.awm.ema_beta * (ema_kl * w).sum() / denom
        m.add("ema_kl", ema_kl.detach(), mask)
    return loss
