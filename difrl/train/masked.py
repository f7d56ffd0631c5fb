"""The GRPO trainer for masked (discrete) diffusion policies: MaskGRPO, d1 / diffu-GRPO, UniGRPO, coupled-GRPO.

    difrl train configs/sudoku.yaml [key=value ...] [--out DIR]      # resume: add resume=DIR
    difrl train configs/digit_tokens.yaml
    difrl train configs/sudoku.yaml external.source=solver          # ERILS: a solver's rollouts in every group

Reads top to bottom: setup -> (rollout -> reward -> advantage -> mu inner updates -> log ->
checkpoint) per iteration. Everything random is derived from (seed, iteration, index), so a
resumed run continues exactly as if it had never stopped.

Log-probs of a masked policy are estimated by re-masking the finished rollout and reading the
denoiser's log-softmax at the re-masked positions (specs/discrete-diffusion-rl.md section 3). Inner
update n = 1..mu has its own mask, a pure function of (sample seed, n, position) through
``mask_uniforms``, so the old-policy log-probs (computed once per rollout, before any update), the
reference log-probs and the current ones of update n all see the *same* mask; the prompt (the
puzzle's givens) is never masked (d1's optional prompt masking aside). The first micro-step of
update 1 is on-policy: its ratio must be exactly 1 (``check_ratio``).

External rollouts (``external``, our reading of ERILS; specs/discrete-diffusion-rl.md section 7
found no source): the last K of every group's G rollouts come from another policy (the world's
solver, or a stronger checkpoint), started from the same prompt so that they fill exactly the
group's answer positions (length control: no external answer is longer or shorter than the
policy's). Their rewards are normalised by source (``external.normalize=source``: the baseline is the
group's on-policy mean and std), and each of their tokens is importance-weighted by
pi_old(o_k | context) / mu_ext(o_k | context) through ``difrl.correct`` (TIS by default), with the
context the one the external policy committed o_k in (``trace_logp``) and mu_ext the probability it
recorded. The world (prompts, reward, eval) comes from ``difrl.worlds.masked``.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from difrl.algos import ppo_clip_loss
from difrl.algos.advantages import group_normalize
from difrl.config import save_config
from difrl.correct import METHODS as CORRECTORS
from difrl.discrete.losses import (ar_fade_mask, coupled_masks, d1_mask, mask_uniforms, maskgrpo_ratios, trace_logp,
                                   unigrpo_ratios, uniform_mask)
from difrl.discrete.samplers import SAMPLERS, DiscreteRollout
from difrl.models.base import cond_cat
from difrl.train.flow import RatioCheckError, _truncate_metrics, check_ratio, cores_available
from difrl.train.masked_config import MaskedConfig, MaskedSamplerConfig
from difrl.train.state import load_latest_checkpoint, restore_checkpoint, save_checkpoint, trainable_params
from difrl.utils.io import atomic_write_json, save_safetensors
from difrl.utils.rng import mix_seed
from difrl.worlds.masked import build_masked_world

__all__ = ["RatioCheckError", "Remask", "masked_advantages", "remask", "sampler_kwargs", "token_logp", "train"]

TIMING_KEYS = ("seconds", "seconds_rollout", "seconds_reward", "seconds_update", "seconds_eval")


# ---------------------------------------------------------------------------------- estimators
@dataclass
class Remask:
    """One inner update's re-masked views of a batch (spec section 3)."""
    inputs: torch.Tensor  # [V, B, L] long: the tokens with the view's masked positions set to the mask id
    masked: torch.Tensor  # [V, B, L] bool
    weight: torch.Tensor  # [B, L] fp32: coupled's 1/t, 1/(1 - t) per answer token; ones otherwise
    loss_mask: torch.Tensor  # [B, L] bool: tokens that enter the loss


def remask(cfg: MaskedConfig, tokens: torch.Tensor, answer: torch.Tensor, prompt: torch.Tensor, seeds: torch.Tensor,
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


def token_logp(cfg: MaskedConfig, policy, tokens: torch.Tensor, rm: Remask, cond: dict | None = None) -> torch.Tensor:
    """[B, L] fp32 per-token log-prob estimate under `policy` from ONE forward over the stacked views.
    maskgrpo / unigrpo / d1: log p(o_k | view) at masked positions. coupled: 1/2 [l_full + w_k l_view(k)]
    with view(k) the one of A / B where k is masked (w_k l_view(k) alone without the full view).
    `cond`: the rows' conditioning (e.g. the digit label), repeated for every view."""
    V, B, L = rm.inputs.shape
    logits = policy.logits(rm.inputs.reshape(V * B, L), None if cond is None else cond_cat([cond] * V)).view(V, B, L, -1)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[None, :, :, None].expand(V, B, L, 1))[..., 0]
    lp = lp * rm.masked.float()  # only masked positions carry an estimate
    if cfg.estimator.kind != "coupled":
        return lp[0]
    partial = rm.weight * lp[-2:].sum(0)  # A and B are disjoint: each answer token in exactly one
    return 0.5 * (lp[0] + partial) if cfg.estimator.full_view else partial


def masked_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: str, eps: float, clip: float,
                      baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] advantages, [N] zero_spread). scale 'std': (r - mean) / (std + eps) (MaskGRPO; population
    std); 'mean': r - mean (d1); 'loo': leave-one-out r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean)
    (coupled-GRPO). Mean and std are over the group's `baseline` members ([N] bool; None = all): with
    external rollouts (source normalisation) the on-policy ones, so an external sample's advantage is
    its reward against what the policy does now. A group whose rewards are all equal has zero spread
    (advantages 0); |A| <= clip."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    r = rewards.double()
    base = torch.ones_like(r, dtype=torch.bool) if baseline is None else baseline.bool()
    w = base.double()
    count = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, w)
    if bool((count == 0).any()):
        raise ValueError("a group has no baseline member")
    mean = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, r * w) / count
    adv = r - mean[inv]
    if scale == "std":
        var = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, adv**2 * w) / count
        adv = adv / (var.sqrt()[inv] + eps)
    elif scale == "loo":
        adv = torch.where(base, adv * (count / (count - 1).clamp_min(1.0))[inv], adv)
    elif scale != "mean":
        raise ValueError(f"unknown advantage scale {scale!r}; expected 'std', 'mean' or 'loo'")
    _, zero = group_normalize(rewards, group_ids)  # the shared zero-spread rule (all rewards of the group equal)
    adv = torch.where(zero, torch.zeros_like(adv), adv).clamp(-clip, clip)
    return adv.float(), zero


def sampler_kwargs(sc: MaskedSamplerConfig, temperature: float | None = None) -> dict:
    """The rollout sampler's keyword arguments from the config's sampler section."""
    if sc.kind == "llada":
        kw = dict(steps=sc.steps, block_length=sc.block_length)
    elif sc.kind == "eb":
        kw = dict(gamma=sc.gamma, block_length=sc.block_length)
    else:
        kw = dict(steps=sc.steps, schedule=sc.schedule)
    return kw | {"temperature": sc.temperature if temperature is None else temperature}


def merge_rollouts(n: int, parts: list[tuple[torch.Tensor, DiscreteRollout]]) -> DiscreteRollout:
    """One [n]-row rollout from row-disjoint parts (rows index, rollout of those rows); nfe adds up."""
    first = parts[0][1]
    fields = {}
    for name in ("tokens", "start", "gen_mask", "logp", "policy_logp", "step", "nfe_per_sample", "seeds"):
        ref = getattr(first, name)
        out = torch.zeros((n, *ref.shape[1:]), dtype=ref.dtype)
        for rows, part in parts:
            out[rows] = getattr(part, name)
        fields[name] = out
    return DiscreteRollout(nfe=sum(p.nfe for _, p in parts), **fields)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator exp(l_ref - l) - (l_ref - l) - 1 (d1 / MaskGRPO)."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


class _Means:
    def __init__(self):
        self.sums, self.counts = {}, {}

    def add(self, name: str, value: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        v = value.detach().double()
        v = v[mask] if mask is not None else v.reshape(-1)
        self.sums[name] = self.sums.get(name, 0.0) + float(v.sum())
        self.counts[name] = self.counts.get(name, 0) + v.numel()

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / max(self.counts[k], 1) for k in sorted(self.sums)}


# ---------------------------------------------------------------------------------- the loop
def train(cfg: MaskedConfig, out_dir: str | Path | None = None) -> dict:
    from tqdm.auto import tqdm

    # ======================================================================== setup
    torch.set_num_threads(cfg.threads or cores_available())
    run_dir = Path(cfg.resume or out_dir or cfg.out or f"runs/{cfg.model.kind}")
    P, G, mu = cfg.rollout.prompts_per_iter, cfg.rollout.group_size, cfg.train.inner_updates
    N, mbs, ga = P * G, cfg.train.micro_batch, cfg.train.grad_accum
    updates_per_inner = N // (mbs * ga)
    world = build_masked_world(cfg)
    policy = world.policy
    mask_id = policy.mask_id
    sampler = SAMPLERS[cfg.sampler.kind]
    sampler_kw = sampler_kwargs(cfg.sampler)
    ext = cfg.external
    K = ext.per_group if ext.source != "none" else 0
    print(f"difrl: masked GRPO ({cfg.estimator.kind}) on {cfg.model.kind}; {torch.get_num_threads()} thread(s); {N} "
          f"rollouts/iteration ({P} prompts x {G}{f', {K} of each group from {ext.source}' if K else ''}), "
          f"{cfg.sampler.kind} sampler at T={cfg.sampler.temperature}; {mu} inner update(s) x {updates_per_inner} "
          f"optimizer step(s) of {mbs} x {ga}; run dir {run_dir}")

    # external rollouts (ERILS): the world's solver or a frozen stronger checkpoint
    if ext.source == "solver":
        external_sample = world.external["solver"]
    elif ext.source == "checkpoint":
        ext_policy = world.load_policy(ext.path)
        ext_policy.module.requires_grad_(False).eval()
        ext_kw = sampler_kwargs(cfg.sampler, ext.temperature)
        external_sample = lambda tokens, cond, *, seeds: sampler(ext_policy, tokens, cond, seeds=seeds, **ext_kw)
    corrector = CORRECTORS[ext.correct.method]

    base = policy.module
    torch.manual_seed(mix_seed(cfg.seed, 5))  # LoRA init draws from the global RNG: same seed, same start
    if cfg.train.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lc = cfg.train.lora
        net = get_peft_model(base, LoraConfig(r=lc.rank, lora_alpha=lc.alpha, init_lora_weights=True if lc.init == "default" else "gaussian",
                                              target_modules=lc.targets or policy.lora_target_modules))
        reference = None  # the same network with the adapter disabled
    else:
        net = base
        reference = copy.deepcopy(base).requires_grad_(False) if cfg.train.kl_beta > 0 else None
    policy.module = net
    params = trainable_params(net)
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.train.lr, betas=cfg.train.betas,
                                  weight_decay=cfg.train.weight_decay)

    def reference_logp(tokens: torch.Tensor, rm: Remask, cond: dict) -> torch.Tensor:
        if reference is None:  # LoRA: the base is the network with its adapter off
            with net.disable_adapter():
                return token_logp(cfg, policy, tokens, rm, cond)
        saved, policy.module = policy.module, reference
        try:
            return token_logp(cfg, policy, tokens, rm, cond)
        finally:
            policy.module = saved

    # resume: weights, optimizer, RNG, counters; metrics.jsonl cut back to the checkpoint
    start, run_state = 0, {"eval_before": None, "last_eval": None}
    ckpt = load_latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise FileNotFoundError(f"resume={cfg.resume}: no checkpoint found in {run_dir / 'checkpoints'}")
    if ckpt is not None:
        restore_checkpoint(ckpt, net, optimizer, None)
        start = ckpt.iteration
        run_state.update({k: ckpt.state[k] for k in run_state if k in ckpt.state})
        print(f"difrl: resumed from {ckpt.path} after iteration {start}")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    _truncate_metrics(run_dir / "metrics.jsonl", start)
    (run_dir / "metrics.jsonl").touch()

    if run_state["eval_before"] is None:
        run_state["eval_before"] = run_state["last_eval"] = world.evaluate(policy)
        print("eval before: " + _fmt_eval(run_state["eval_before"], world.headline))
        if world.save_samples is not None:
            world.save_samples(policy, run_dir / "samples" / "iter-0000.png")

    def checkpoint(iteration: int) -> None:
        save_checkpoint(run_dir, iteration, net, optimizer, None, run_state)

    bar = tqdm(range(start, cfg.train.iterations), initial=start, total=cfg.train.iterations, desc="train",
               dynamic_ncols=True)
    it = start - 1
    for it in bar:
        t_iter = time.perf_counter()
        # ==================================================================== rollout
        batch = world.prompts(P, mix_seed(cfg.seed, it, 1)).repeat(G)  # sample k belongs to group k // G
        k = torch.arange(N)
        group_ids = it * P + k // G
        seeds = torch.tensor([mix_seed(cfg.seed, it, 0, int(i)) for i in k], dtype=torch.int64)
        is_ext = (k % G) >= G - K  # the last K of every group come from the external source
        on_rows, ext_rows = (~is_ext).nonzero().flatten(), is_ext.nonzero().flatten()
        net.eval()
        on = batch.select(on_rows)
        parts = [(on_rows, sampler(policy, on.tokens, on.cond, seeds=seeds[on_rows], **sampler_kw))]
        if K:
            ex = batch.select(ext_rows)
            parts.append((ext_rows, external_sample(ex.tokens, ex.cond, seeds=seeds[ext_rows])))
        out = merge_rollouts(N, parts)
        tokens, answer, prompt = out.tokens, out.gen_mask, batch.prompt
        # the inner updates' masks (a function of seeds and n) and, before any update, the old-policy and
        # reference log-probs under exactly those masks
        coupled_t = [cfg.estimator.t_low + (cfg.estimator.t_high - cfg.estimator.t_low)
                     * torch.rand((), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 9, n))).item()
                     for n in range(1, mu + 1)]
        masks = [remask(cfg, tokens, answer, prompt, seeds, n, coupled_t[n - 1], mask_id) for n in range(1, mu + 1)]
        with torch.no_grad():
            logp_old = torch.stack([token_logp(cfg, policy, tokens, rm, batch.cond) for rm in masks])  # [mu, N, L]
            logp_ref = (torch.stack([reference_logp(tokens, rm, batch.cond) for rm in masks])
                        if cfg.train.kl_beta > 0 else None)
        # importance weights of the external tokens: pi_old / mu_ext in the context each was committed in
        is_weight, is_keep, correction = torch.ones(tokens.shape), torch.ones(tokens.shape, dtype=torch.bool), None
        if K:
            ex_out = parts[1][1]
            lp_pi = trace_logp(policy, tokens[ext_rows], answer[ext_rows], ex_out.step, batch.select(ext_rows).cond)
            correction = corrector(lp_pi, ex_out.logp, answer[ext_rows], **ext.correct.options)
            is_weight[ext_rows], is_keep[ext_rows] = correction.weights, correction.keep
        t_reward = time.perf_counter()

        # ==================================================================== reward
        rewards = world.reward(tokens, batch)
        reward = rewards["reward"]
        if not bool(torch.isfinite(reward).all()):
            bad = (~torch.isfinite(reward)).nonzero().flatten()[:8].tolist()
            raise ValueError(f"iteration {it + 1}: the {cfg.model.kind} reward returned non-finite values for samples "
                             f"{bad}; nothing was trained on them (last checkpoint: {run_dir / 'checkpoints'})")
        t_adv = time.perf_counter()

        # ==================================================================== advantage
        baseline = ~is_ext if (K and ext.normalize == "source") else None
        advantages, zero_spread = masked_advantages(reward, group_ids, cfg.advantage.scale, cfg.advantage.eps,
                                                    cfg.advantage.clip, baseline)
        keep = ~zero_spread if cfg.advantage.drop_zero_spread else torch.ones(N, dtype=torch.bool)

        # ==================================================================== policy update
        net.train()
        m = _Means()
        first = True
        for n in range(1, mu + 1):
            rm_all = masks[n - 1]
            m.add("mask_frac", rm_all.masked.any(0).float(), answer.bool())
            m.add("prompt_masked_frac", rm_all.masked.any(0).float(), prompt)
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 4, n)))
            for u in range(updates_per_inner):
                rows = perm[u * mbs * ga:(u + 1) * mbs * ga]
                loss_tokens = rm_all.loss_mask[rows] & keep[rows, None] & is_keep[rows]
                denom = max(int(loss_tokens.sum()), 1)  # fixed per optimizer update: 1 x 8 == 8 x 1
                for a in range(ga):
                    idx = rows[a * mbs:(a + 1) * mbs]
                    sub = batch.select(idx)
                    rm = remask(cfg, tokens[idx], answer[idx], prompt[idx], seeds[idx], n, coupled_t[n - 1], mask_id)
                    lm = rm.loss_mask & keep[idx, None] & is_keep[idx]
                    logp = token_logp(cfg, policy, tokens[idx], rm, sub.cond)
                    if first and cfg.train.ratio_check:  # on-policy: same weights, same mask -> ratio 1
                        m.add("first_step_max_abs_log_ratio",
                              torch.tensor(check_ratio(logp[rm.loss_mask], logp_old[n - 1, idx][rm.loss_mask], cfg.train.ratio_tol)))
                    first = False
                    pg, pm = ppo_clip_loss(logp, logp_old[n - 1, idx], advantages[idx], cfg.train.clip_low,
                                           cfg.train.clip_high)
                    loss = (pg * is_weight[idx] * lm).sum() / denom
                    if logp_ref is not None:
                        kl = k3_kl(logp, logp_ref[n - 1, idx])
                        loss = loss + cfg.train.kl_beta * (kl * lm).sum() / denom
                        m.add("kl", kl, lm)
                    loss.backward()
                    m.add("policy_loss", pg, lm)
                    for name in ("ratio", "approx_kl", "clip_high", "clip_low"):
                        m.add(name, pm[name], lm)
                if cfg.train.max_grad_norm is not None:
                    m.add("grad_norm", torch.nn.utils.clip_grad_norm_(params.values(), cfg.train.max_grad_norm))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        net.eval()
        t_log = time.perf_counter()

        # ==================================================================== log
        upd = m.result()
        on_mask = ~is_ext
        row = {
            "iteration": it + 1,
            "reward_mean": float(reward[on_mask].mean()), "reward_std": float(reward[on_mask].std(unbiased=False)),
            **{k: float(v[on_mask].float().mean()) for k, v in rewards.items() if k != "reward"},
            "adv_mean": float(advantages.mean()), "adv_abs_max": float(advantages.abs().max()),
            "zero_spread_groups": int(group_ids[zero_spread].unique().numel()),
            "trained_samples": int(keep.sum()),
            "nfe_rollout": out.nfe,
            **upd,
            "ratio_mean": upd.get("ratio", 1.0),
            "lr": optimizer.param_groups[0]["lr"],
            "seconds_rollout": t_reward - t_iter, "seconds_reward": t_adv - t_reward, "seconds_update": t_log - t_adv,
        }
        row.pop("ratio", None)
        if K:  # on-policy reward above, the external source's here
            row.update({"external/reward_mean": float(reward[is_ext].mean()),
                        "external/adv_mean": float(advantages[is_ext].mean()),
                        **{f"external/{k}": float(v) for k, v in correction.diagnostics.items()}})
        if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.train.iterations:
            t_eval = time.perf_counter()
            run_state["last_eval"] = ev = world.evaluate(policy)
            row.update({f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            row["seconds_eval"] = time.perf_counter() - t_eval
        row["seconds"] = time.perf_counter() - t_iter
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        last = run_state["last_eval"]
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", **{k: f"{last[k]:.3f}" for k in world.headline})

        # ==================================================================== checkpoint
        if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
            checkpoint(it + 1)
    bar.close()

    # ======================================================================== finish
    done = it + 1 if cfg.train.iterations > start else start
    checkpoint(done)
    eval_after = world.evaluate(policy)
    print("eval after:  " + _fmt_eval(eval_after, world.headline))
    if world.save_samples is not None:
        world.save_samples(policy, run_dir / "samples" / f"iter-{done:04d}.png")
    summary = {"eval_before": run_state["eval_before"], "eval_after": eval_after, "iterations": done,
               "stopped_early": None, "run_dir": str(run_dir), "headline": list(world.headline)}
    atomic_write_json(run_dir / "summary.json", summary)
    _save_policy(policy, cfg, run_dir)
    _plot(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", summary, world.headline)
    return summary


# ---------------------------------------------------------------------------------- pieces of the loop
def _fmt_eval(ev: dict, headline: tuple[str, ...]) -> str:
    extra = (f" ({ev['num_puzzles']} test puzzles, {ev['num_blanks']} blanks)" if "num_puzzles" in ev
             else f" ({ev['samples']} samples)" if "samples" in ev else "")
    return ", ".join(f"{k} {ev[k]:.3f}" for k in headline) + extra


def _save_policy(policy, cfg: MaskedConfig, run_dir: Path) -> None:
    """policy.safetensors: a plain masked-transformer checkpoint (LoRA merged), usable as model.path."""
    net = policy.module
    if cfg.train.lora.enabled:
        net = copy.deepcopy(net).merge_and_unload()
    saved, policy.module = policy.module, net
    try:
        tensors, meta = policy.state_dict_and_meta()
    finally:
        policy.module = saved
    save_safetensors(tensors, run_dir / "policy.safetensors", meta)


def _plot(metrics_path: Path, out: Path, summary: dict, headline: tuple[str, ...]) -> None:
    """Train reward and the world's headline eval metrics; those outside [0, 1] (FD) on a right-hand axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    ev = ([(0, summary["eval_before"])] + [(r["iteration"], {k: r[f"eval/{k}"] for k in headline}) for r in rows
                                            if all(f"eval/{k}" in r for k in headline)]
          + [(summary["iterations"], summary["eval_after"])])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["iteration"] for r in rows], [r["reward_mean"] for r in rows], label="train reward (mean)")
    right = None
    for key in headline:
        xs, ys = [e[0] for e in ev], [e[1][key] for e in ev]
        if max(ys) <= 1.0:
            ax.plot(xs, ys, "o-", label=f"eval {key}")
        else:
            right = right or ax.twinx()
            right.plot(xs, ys, "s--", color="tab:red", label=f"eval {key}")
            right.set_ylabel(key)
    ax.set_xlabel("iteration"); ax.set_ylim(0, 1.02); ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    if right is not None:
        handles = [a + b for a, b in zip(handles, right.get_legend_handles_labels())]
    ax.legend(*handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
