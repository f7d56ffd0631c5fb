"""The GRPO trainer for masked (discrete) diffusion policies: MaskGRPO, d1 / diffu-GRPO, coupled-GRPO.

    difrl train configs/sudoku.yaml [key=value ...] [--out DIR]      # resume: add resume=DIR

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
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from difrl.algos import group_advantages, ppo_clip_loss
from difrl.algos.advantages import group_normalize
from difrl.config import save_config
from difrl.discrete.losses import ar_fade_mask, coupled_masks, d1_mask, mask_uniforms, maskgrpo_ratios, uniform_mask
from difrl.discrete.samplers import SAMPLERS
from difrl.train.flow import RatioCheckError, _truncate_metrics, check_ratio, cores_available
from difrl.train.masked_config import MaskedConfig
from difrl.train.state import load_latest_checkpoint, restore_checkpoint, save_checkpoint, trainable_params
from difrl.utils.io import atomic_write_json, save_safetensors
from difrl.utils.rng import mix_seed
from difrl.worlds import sudoku

__all__ = ["RatioCheckError", "Remask", "centred_advantages", "remask", "token_logp", "train"]

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


def token_logp(cfg: MaskedConfig, policy, tokens: torch.Tensor, rm: Remask) -> torch.Tensor:
    """[B, L] fp32 per-token log-prob estimate under `policy` from ONE forward over the stacked views.
    maskgrpo / d1: log p(o_k | view) at masked positions. coupled: 1/2 [l_full + w_k l_view(k)] with
    view(k) the one of A / B where k is masked (w_k l_view(k) alone without the full view)."""
    V, B, L = rm.inputs.shape
    logits = policy.logits(rm.inputs.reshape(V * B, L), None).view(V, B, L, -1)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[None, :, :, None].expand(V, B, L, 1))[..., 0]
    lp = lp * rm.masked.float()  # only masked positions carry an estimate
    if cfg.estimator.kind != "coupled":
        return lp[0]
    partial = rm.weight * lp[-2:].sum(0)  # A and B are disjoint: each answer token in exactly one
    return 0.5 * (lp[0] + partial) if cfg.estimator.full_view else partial


def centred_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, loo: bool) -> torch.Tensor:
    """r - mean_group (d1), or the leave-one-out baseline r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean)."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    r = rewards.double()
    count = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, r) / count
    adv = r - mean[inv]
    if loo:
        adv = adv * (count / (count - 1).clamp_min(1.0))[inv]
    return adv.float()


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
    run_dir = Path(cfg.resume or out_dir or cfg.out or "runs/masked")
    P, G, mu = cfg.rollout.prompts_per_iter, cfg.rollout.group_size, cfg.train.inner_updates
    N, mbs, ga = P * G, cfg.train.micro_batch, cfg.train.grad_accum
    updates_per_inner = N // (mbs * ga)
    policy = sudoku.load_base(cfg.model.path)
    mask_id = policy.mask_id
    sampler = SAMPLERS[cfg.sampler.kind]
    sampler_kw = (dict(steps=cfg.sampler.steps, block_length=cfg.sampler.block_length) if cfg.sampler.kind == "llada"
                  else dict(gamma=cfg.sampler.gamma, block_length=cfg.sampler.block_length))
    sampler_kw["temperature"] = cfg.sampler.temperature
    print(f"difrl: masked GRPO ({cfg.estimator.kind}) on {cfg.model.kind}; {torch.get_num_threads()} thread(s); {N} "
          f"rollouts/iteration ({P} puzzles x {G}), {cfg.sampler.kind} sampler at T={cfg.sampler.temperature}; {mu} inner "
          f"update(s) x {updates_per_inner} optimizer step(s) of {mbs} x {ga}; run dir {run_dir}")

    base = policy.module
    torch.manual_seed(mix_seed(cfg.seed, 5))  # LoRA init draws from the global RNG: same seed, same start
    if cfg.train.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lc = cfg.train.lora
        net = get_peft_model(base, LoraConfig(r=lc.rank, lora_alpha=lc.alpha, init_lora_weights="gaussian",
                                              target_modules=lc.targets or policy.lora_target_modules))
        reference = None  # the same network with the adapter disabled
    else:
        net = base
        reference = copy.deepcopy(base).requires_grad_(False) if cfg.train.kl_beta > 0 else None
    policy.module = net
    params = trainable_params(net)
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.train.lr, betas=cfg.train.betas,
                                  weight_decay=cfg.train.weight_decay)

    def reference_logp(tokens: torch.Tensor, rm: Remask) -> torch.Tensor:
        if reference is None:  # LoRA: the base is the network with its adapter off
            with net.disable_adapter():
                return token_logp(cfg, policy, tokens, rm)
        saved, policy.module = policy.module, reference
        try:
            return token_logp(cfg, policy, tokens, rm)
        finally:
            policy.module = saved

    def evaluate() -> dict:
        metrics, _ = sudoku.evaluate_sudoku(policy, cfg.eval.num_blanks, cfg.eval.count, seed=cfg.eval.seed)
        return metrics

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
        run_state["eval_before"] = run_state["last_eval"] = evaluate()
        print("eval before: " + _fmt_eval(run_state["eval_before"]))

    def checkpoint(iteration: int) -> None:
        save_checkpoint(run_dir, iteration, net, optimizer, None, run_state)

    bar = tqdm(range(start, cfg.train.iterations), initial=start, total=cfg.train.iterations, desc="train",
               dynamic_ncols=True)
    it = start - 1
    for it in bar:
        t_iter = time.perf_counter()
        # ==================================================================== rollout
        puzzles, _ = sudoku.sample_training_puzzles(P, tuple(cfg.rollout.num_blanks), seed=mix_seed(cfg.seed, it, 1))
        puzzles = puzzles.repeat_interleave(G, dim=0)  # sample k belongs to group k // G
        k = torch.arange(N)
        group_ids = it * P + k // G
        seeds = torch.tensor([mix_seed(cfg.seed, it, 0, int(i)) for i in k], dtype=torch.int64)
        start_tokens, prompt = sudoku.encode(puzzles)
        net.eval()
        out = sampler(policy, start_tokens, {"prompt_mask": prompt}, seeds=seeds, **sampler_kw)
        tokens, answer = out.tokens, out.gen_mask
        # the inner updates' masks (a function of seeds and n) and, before any update, the old-policy and
        # reference log-probs under exactly those masks
        coupled_t = [cfg.estimator.t_low + (cfg.estimator.t_high - cfg.estimator.t_low)
                     * torch.rand((), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 9, n))).item()
                     for n in range(1, mu + 1)]
        masks = [remask(cfg, tokens, answer, prompt, seeds, n, coupled_t[n - 1], mask_id) for n in range(1, mu + 1)]
        with torch.no_grad():
            logp_old = torch.stack([token_logp(cfg, policy, tokens, rm) for rm in masks])  # [mu, N, L]
            logp_ref = torch.stack([reference_logp(tokens, rm) for rm in masks]) if cfg.train.kl_beta > 0 else None
        t_reward = time.perf_counter()

        # ==================================================================== reward
        reward = sudoku.sudoku_reward(sudoku.decode(tokens), puzzles)
        is_solved = sudoku.solved(sudoku.decode(tokens), puzzles)
        t_adv = time.perf_counter()

        # ==================================================================== advantage
        _, zero_spread = group_normalize(reward, group_ids)
        if cfg.advantage.scale == "std":  # MaskGRPO: (r - mean) / (std + eps)
            advantages = group_advantages({"cells": reward}, {"cells": 1.0}, group_ids, eps=cfg.advantage.eps,
                                          clip=cfg.advantage.clip).advantages
        else:  # d1: r - mean; coupled-GRPO: leave-one-out
            advantages = centred_advantages(reward, group_ids, cfg.advantage.scale == "loo").clamp(
                -cfg.advantage.clip, cfg.advantage.clip)
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
                loss_tokens = rm_all.loss_mask[rows] & keep[rows, None]
                denom = max(int(loss_tokens.sum()), 1)  # fixed per optimizer update: 1 x 8 == 8 x 1
                for a in range(ga):
                    idx = rows[a * mbs:(a + 1) * mbs]
                    rm = remask(cfg, tokens[idx], answer[idx], prompt[idx], seeds[idx], n, coupled_t[n - 1], mask_id)
                    lm = rm.loss_mask & keep[idx, None]
                    logp = token_logp(cfg, policy, tokens[idx], rm)
                    if first and cfg.train.ratio_check:  # on-policy: same weights, same mask -> ratio 1
                        m.add("first_step_max_abs_log_ratio",
                              torch.tensor(check_ratio(logp[rm.loss_mask], logp_old[n - 1, idx][rm.loss_mask], cfg.train.ratio_tol)))
                    first = False
                    pg, pm = ppo_clip_loss(logp, logp_old[n - 1, idx], advantages[idx], cfg.train.clip_low,
                                           cfg.train.clip_high)
                    loss = (pg * lm).sum() / denom
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
        row = {
            "iteration": it + 1,
            "reward_mean": float(reward.mean()), "reward_std": float(reward.std(unbiased=False)),
            "solve_rate_train": float(is_solved.float().mean()),
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
        if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.train.iterations:
            t_eval = time.perf_counter()
            run_state["last_eval"] = ev = evaluate()
            row.update({f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            row["seconds_eval"] = time.perf_counter() - t_eval
        row["seconds"] = time.perf_counter() - t_iter
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        last = run_state["last_eval"]
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", cells=f"{last['cell_accuracy']:.3f}",
                        solved=f"{last['solve_rate']:.3f}")

        # ==================================================================== checkpoint
        if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
            checkpoint(it + 1)
    bar.close()

    # ======================================================================== finish
    done = it + 1 if cfg.train.iterations > start else start
    checkpoint(done)
    eval_after = evaluate()
    print("eval after:  " + _fmt_eval(eval_after))
    summary = {"eval_before": run_state["eval_before"], "eval_after": eval_after, "iterations": done,
               "stopped_early": None, "run_dir": str(run_dir)}
    atomic_write_json(run_dir / "summary.json", summary)
    _save_policy(policy, cfg, run_dir)
    _plot(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", summary)
    return summary


# ---------------------------------------------------------------------------------- pieces of the loop
def _fmt_eval(ev: dict) -> str:
    return f"cell_accuracy {ev['cell_accuracy']:.3f}, solve_rate {ev['solve_rate']:.3f} ({ev['num_puzzles']} test puzzles, " \
           f"{ev['num_blanks']} blanks)"


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


def _plot(metrics_path: Path, out: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    ev = [(0, summary["eval_before"])] + [(r["iteration"], {"cell_accuracy": r["eval/cell_accuracy"], "solve_rate": r["eval/solve_rate"]})
                                           for r in rows if "eval/cell_accuracy" in r] + [(summary["iterations"], summary["eval_after"])]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["iteration"] for r in rows], [r["reward_mean"] for r in rows], label="train reward (mean)")
    for key in ("cell_accuracy", "solve_rate"):
        ax.plot([e[0] for e in ev], [e[1][key] for e in ev], "o-", label=f"test {key}")
    ax.set_xlabel("iteration"); ax.set_ylim(0, 1.02); ax.legend(); ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
