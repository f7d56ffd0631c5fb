"""The flow-matching GRPO trainer: one loop for every flow policy.

    difrl train configs/digits.yaml [key=value ...] [--out DIR]
    accelerate launch --multi_gpu --num_processes 2 -m difrl train configs/digits.yaml
    torchrun --nproc_per_node 2 -m difrl train configs/digits.yaml

Reads top to bottom: setup -> (rollout -> reward -> advantage -> K policy updates -> EMA ->
log -> checkpoint) per iteration. Everything random is derived from (seed, iteration, index),
so a resumed run continues exactly as if it had never stopped.

Groups may span processes: the sample list of an iteration is global (sample k belongs to group
k // group_size), each process rolls out a contiguous slice, rewards are gathered before the
advantages are computed, and each process trains on its own samples.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from difrl.algos import gaussian_step_kl, group_advantages, ppo_clip_loss, ratio_norm_log_ratio, step_weights
from difrl.algos.nft import nft_loss, nft_noised, velocity_kl
from difrl.algos.tree import depth_prune, depthwise_advantages, edge_advantages, fuse_rewards, width_prune
from difrl.config import save_config
from difrl.correct import METHODS as CORRECTORS
from difrl.correct.core import Correction
from difrl.models.base import cond_repeat
from difrl.rewards import RewardError, build_reward, score_all
from difrl.quant import QUANT_PRESETS, RolloutCopy
from difrl.rollout import Rollout, rollout
from difrl.samplers import all_but_last, fixed_window, random_subset, random_window, sliding_window_start
from difrl.train.config import FlowConfig
from difrl.train.state import EMA, load_latest_checkpoint, restore_checkpoint, save_checkpoint, trainable_params
from difrl.utils.io import atomic_write_json, save_safetensors
from difrl.solrl import rank_agreement, select_indices
from difrl.tree import TreeRollout, num_trained_edges, recompute_edges, tree_rollout
from difrl.utils.rng import counter_normal, mix_seed, mix_seed_tensor
from difrl.worlds import build_world


class RatioCheckError(RuntimeError):
    pass


TIMING_KEYS = ("seconds", "seconds_rollout", "seconds_reward", "seconds_update", "seconds_eval", "seconds_sampling",
               "seconds_candidates", "seconds_regenerate")

# ---------------------------------------------------------------------------------- helpers


def step_masks(cfg: FlowConfig, iteration: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(sde_mask [N], train_mask [B, N], window start or None) for one iteration, from (seed, iteration)."""
    n, s = cfg.sampler.num_steps, cfg.steps
    if cfg.train.objective == "nft":  # DiffusionNFT: deterministic rollouts, nothing stored but the clean sample
        none = torch.zeros(n, dtype=torch.bool)
        return none, none.expand(num_samples, n), None
    gen = torch.Generator().manual_seed(mix_seed(cfg.seed, iteration, 2))
    if s.mode == "all_but_last":
        m = all_but_last(n)
        return m, m.expand(num_samples, n), None
    if s.mode == "random_subset":  # DanceGRPO: every step SDE, a random subset per sample trained
        return torch.ones(n, dtype=torch.bool), random_subset(num_samples, n, s.fraction, gen), None
    if s.mode == "fixed_window":
        start = s.window_start
    elif s.mode == "random_window":
        lo, hi = s.window_range or (0, max(s.window_size, n // 2))
        m = random_window(n, s.window_size, lo, hi, gen)
        start = int(m.nonzero()[0])
    else:  # sliding_window (MixGRPO progressive)
        start = sliding_window_start(iteration, s.window_size, n, s.advance_every, s.stride, s.window_start, s.roll_back)
    m = fixed_window(n, start, s.window_size)
    return m, m.expand(num_samples, n), start


def kernel_kwargs(cfg: FlowConfig) -> dict:
    kw = {"noise_level": cfg.sampler.noise_level, "reduce": cfg.sampler.log_prob_reduce}
    if cfg.sampler.kind == "cps":
        kw["log_prob_form"] = cfg.sampler.cps_log_prob
    return kw


def transition_log_prob(policy, batch: Rollout, cfg: FlowConfig):
    """Recompute the stored transitions of `batch` (samples or tree edges) under the current policy: one
    forward over all B*T (sample, step) pairs; a tree's split edges are scored with their stored std scale.
    Returns (log_prob [B, T], mean [B*T, ...], std [B*T])."""
    out = recompute_edges(policy, batch, cfg.sampler.kind, kernel_kwargs(cfg), cfg.sampler.guidance)
    return out.log_prob, out.mean, out.std


def nfe_per_step(cfg: FlowConfig) -> int:
    """Network evaluations per sample and step: classifier-free guidance batches [uncond; cond]."""
    return 2 if cfg.sampler.guidance != 1.0 else 1


def nft_sigmas(cfg: FlowConfig, sigmas: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's trained sigmas: the first timestep_fraction of the rollout schedule (Sol-RL: 6 of 10)."""
    return sigmas[:max(1, int(cfg.sampler.num_steps * cfg.nft.timestep_fraction))]


def check_ratio(log_prob: torch.Tensor, log_prob_old: torch.Tensor, tol: float) -> float:
    err = float((log_prob.detach() - log_prob_old).abs().max())
    if not math.isfinite(err) or math.expm1(err) > tol:
        raise RatioCheckError(
            f"on-policy ratio check failed: the first micro-step's |ratio - 1| is {math.expm1(err):.3g} > {tol:g}. "
            "The log-prob recomputed for training differs from the rollout's. Likely causes: dropout or another "
            "train/eval-mode difference in the model, a batch-size-dependent kernel (compare rollout and training "
            "batch sizes), bf16/fp16 step math, torch.compile, or non-deterministic attention. Set "
            "train.ratio_check=false only if you know why.")
    return err


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _Metrics:
    """Means over one iteration's micro-steps (all processes together), plus per-step ratio mean/std."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.per_step: dict[str, torch.Tensor] = {}  # name -> [sum, sum of squares, count] x steps

    def add(self, name: str, value: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        v = value.detach().double()
        if mask is not None:
            v = v[mask]
        self.sums[name] = self.sums.get(name, 0.0) + float(v.sum())
        self.counts[name] = self.counts.get(name, 0) + v.numel()

    def add_ratio(self, ratio: torch.Tensor, steps: torch.Tensor, mask: torch.Tensor, name: str = "ratio_per_step") -> None:
        acc = self.per_step.setdefault(name, torch.zeros(3, self.num_steps, dtype=torch.float64))
        r, j = ratio.detach().double()[mask], steps[mask]
        acc[0].index_add_(0, j, r)
        acc[1].index_add_(0, j, r**2)
        acc[2].index_add_(0, j, torch.ones_like(r))

    def result(self, accelerator) -> dict:
        names = sorted(self.sums)  # every process logs the same names
        packed = torch.tensor([[self.sums[k] for k in names], [float(self.counts[k]) for k in names]], dtype=torch.float64)
        if accelerator.num_processes > 1:
            packed = accelerator.reduce(packed.to(accelerator.device), "sum").cpu()
            self.per_step = {k: accelerator.reduce(v.to(accelerator.device), "sum").cpu() for k, v in sorted(self.per_step.items())}
        out = {k: float(packed[0, i] / max(packed[1, i], 1.0)) for i, k in enumerate(names)}
        for name, acc in self.per_step.items():
            per_step = {}
            for j in (acc[2] > 0).nonzero().flatten().tolist():
                s, sq, n = acc[:, j].tolist()
                mean = s / n
                per_step[str(j)] = [mean, math.sqrt(max(sq / n - mean**2, 0.0))]
            out[name] = per_step
        out.setdefault("ratio_per_step", {})
        return out


# ---------------------------------------------------------------------------------- the loop


def train(cfg: FlowConfig, out_dir: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    # ======================================================================== setup
    world = build_world(cfg.model.kind, cfg.model.path, cfg)
    # a world that runs on the CPU (the digits MLP: kernel launches would dominate on a GPU) asks for it;
    # without cpu=True accelerate ignores torchrun's WORLD_SIZE on a machine with no GPU
    accelerator = Accelerator(cpu=world.device == "cpu" or not torch.cuda.is_available())
    world_size, rank = accelerator.num_processes, accelerator.process_index
    torch.set_num_threads(cfg.threads or max(1, cores_available() // accelerator.num_processes))
    run_dir = Path(cfg.resume or out_dir or cfg.out or "runs/flow")
    n_total = cfg.rollout.prompts_per_iter * cfg.rollout.group_size
    per_proc = n_total // world_size
    per_update = cfg.train.micro_batch * cfg.train.grad_accum
    if n_total % world_size:
        raise ValueError(f"{n_total} samples per iteration (rollout.prompts_per_iter x rollout.group_size) do not "
                         f"split over {world_size} processes")
    tree_mode = cfg.rollout.kind == "tree"
    if tree_mode and cfg.rollout.prompts_per_iter % world_size:
        raise ValueError(f"{cfg.rollout.prompts_per_iter} trees per iteration (rollout.prompts_per_iter) do not split "
                         f"over {world_size} processes")
    if per_proc % per_update and not tree_mode:  # tree edges: a last, smaller update takes the remainder
        raise ValueError(f"each process has {per_proc} samples per iteration, not a multiple of train.micro_batch x "
                         f"train.grad_accum = {cfg.train.micro_batch} x {cfg.train.grad_accum} = {per_update}")
    if cfg.rollout.kind == "solrl" and (cfg.rollout.prompts_per_iter * cfg.solrl.candidates) % world_size:
        raise ValueError(f"{cfg.rollout.prompts_per_iter * cfg.solrl.candidates} Sol-RL candidates per iteration do not "
                         f"split over {world_size} processes")
    updates_per_rollout = cfg.train.inner_epochs * per_proc // per_update
    sde_mask0, train_mask0, _ = step_masks(cfg, 0, 1)
    T = int(train_mask0.sum())  # trained transitions per sample (GRPO) ...
    if cfg.train.objective == "nft":
        T = len(nft_sigmas(cfg, world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)))  # ... or sigmas (NFT)
    schedule = cfg.tree.schedule(cfg.sampler.num_steps) if tree_mode else None
    if tree_mode:  # ... or one per tree edge (a record of its own)
        T = 1
        edges_per_tree = num_trained_edges(schedule, cfg.sampler.num_steps, sde_mask0)
        updates_per_rollout = cfg.train.inner_epochs * -(-edges_per_tree * cfg.rollout.prompts_per_iter // world_size // per_update)
    accelerator.print(
        f"difrl: {world_size} process(es) x {torch.get_num_threads()} thread(s); {n_total} samples/iteration "
        f"({cfg.rollout.prompts_per_iter} groups of {cfg.rollout.group_size}), {per_proc} per process; {T} trained "
        + (f"sigma(s) of {cfg.sampler.num_steps} per sample (DiffusionNFT); " if cfg.train.objective == "nft" else
           f"step per record, SDE steps {cfg.steps.mode} + splits; " if tree_mode else
           f"step(s) of {cfg.sampler.num_steps} per sample ({cfg.steps.mode}); ")
        + (f"Sol-RL: {cfg.solrl.candidates} candidates per prompt in {cfg.solrl.preview_steps} steps, {cfg.solrl.select}; "
           if cfg.rollout.kind == "solrl" else "")
        + (f"trees: splits at {list(schedule.split_steps)} x{schedule.factor}, {edges_per_tree} SDE edges per tree "
           f"before pruning (records of 1 step); " if tree_mode else "")
        + f"{updates_per_rollout} optimizer update(s) "
        f"per rollout ({cfg.train.inner_epochs} epoch(s) x {updates_per_rollout // cfg.train.inner_epochs} of {cfg.train.micro_batch} x "
        f"{cfg.train.grad_accum} accumulated); run dir {run_dir}")

    policy = world.policy
    rewards = {name: build_reward(name, **cfg.reward.options.get(name, {})) for name in cfg.reward.weights}
    sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)  # difrl's schedule, or a pipeline's own (FLUX: dynamic shift)

    base = policy.module
    torch.manual_seed(mix_seed(cfg.seed, 5))  # LoRA init draws from the global RNG: same seed, same start
    if cfg.train.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lcfg = cfg.train.lora
        net = get_peft_model(base, LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, init_lora_weights=True if lcfg.init == "default" else "gaussian",
                                              target_modules=lcfg.targets or policy.lora_target_modules))
        reference = None  # the same network with the adapter disabled
    else:
        net = base
        reference = copy.deepcopy(base).requires_grad_(False)  # frozen copy for the KL
    params = trainable_params(net)
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.train.lr, betas=cfg.train.betas, eps=cfg.train.adam_eps,
                                  weight_decay=cfg.train.weight_decay)
    net, optimizer = accelerator.prepare(net, optimizer)
    policy.module = net
    unwrapped = accelerator.unwrap_model(net)
    ema = EMA(trainable_params(unwrapped), cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None

    # DiffusionNFT's old policy (the sampler and v_old): an EMA of the trained weights with its own schedule
    old = EMA(trainable_params(unwrapped), 0.0) if cfg.train.objective == "nft" else None
    sampling_ctx = old.swapped if old is not None else nullcontext
    # the rollout copy: LoRA merged, linear layers in rollout.precision, re-synced before every rollout
    rollout_copy = None
    if cfg.rollout.precision != "fp32" or cfg.rollout.sync_every > 1:
        preset = QUANT_PRESETS.get(cfg.model.kind, {"skip": (), "min_dim": 0})
        rollout_copy = RolloutCopy(unwrapped, cfg.rollout.precision,
                                   preset["skip"] if cfg.rollout.quant_skip is None else cfg.rollout.quant_skip,
                                   preset["min_dim"] if cfg.rollout.quant_min_dim is None else cfg.rollout.quant_min_dim,
                                   cfg.rollout.quant_backend)
        accelerator.print(f"difrl: rollout copy ({'stage-1 candidates' if cfg.rollout.kind == 'solrl' else 'rollouts'}, "
                          f"synced every {cfg.rollout.sync_every} iteration(s)): " + rollout_copy.report.summary())
    # a stale copy (sync_every > 1) is a function of the weights at its last sync: kept, and checkpointed, here
    copy_source = EMA(trainable_params(unwrapped), 0.0) if cfg.rollout.sync_every > 1 else None
    extras = {k: v for k, v in (("old", old), ("rollout_source", copy_source)) if v is not None}

    def reference_velocity_ctx():
        if reference is None:
            return unwrapped.disable_adapter()
        return _swap_module(policy, reference)

    def evaluate(tag: str, iteration: int) -> dict:
        if ema is not None:
            ema.swap()
        try:
            metrics, images = world.evaluate(policy, cfg.eval.per_digit, cfg.eval.num_steps, cfg.eval.seed, cfg.sampler.shift)
        finally:
            if ema is not None:
                ema.swap()
        if accelerator.is_main_process:
            world.save_grid(images, run_dir / "samples" / f"{tag}-iter-{iteration:06d}.png")
        return metrics

    # resume: weights, optimizer, EMA, RNG, counters, stopping state; metrics.jsonl cut back to the checkpoint
    start, run_state = 0, {"eval_before": None, "best_fd": None, "bad_evals": 0, "last_eval": None}
    ckpt = load_latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise FileNotFoundError(f"resume={cfg.resume}: no checkpoint found in {run_dir / 'checkpoints'}")
    if ckpt is not None:
        restore_checkpoint(ckpt, unwrapped, optimizer, ema, extras)
        start = ckpt.iteration
        run_state.update({k: ckpt.state[k] for k in run_state if k in ckpt.state})
        accelerator.print(f"difrl: resumed from {ckpt.path} after iteration {start}")
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        _truncate_metrics(run_dir / "metrics.jsonl", start)
        (run_dir / "metrics.jsonl").touch()
    accelerator.wait_for_everyone()

    if run_state["eval_before"] is None:
        run_state["eval_before"] = evaluate("before", 0)
        run_state["last_eval"] = run_state["eval_before"]
        accelerator.print("eval before: " + _fmt_eval(run_state["eval_before"]))

    def checkpoint(iteration: int) -> None:
        if accelerator.is_main_process:
            save_checkpoint(run_dir, iteration, unwrapped, optimizer, ema, run_state, extras=extras)
        accelerator.wait_for_everyone()

    # ---- one micro-batch's loss (summed over its elements / the fixed denominator), metrics into m
    def grpo_micro_loss(sub: Rollout, adv: torch.Tensor, keep: torch.Tensor, correction, m: "_Metrics",
                        check: bool, denom: int) -> torch.Tensor:
        log_prob, mean, std = transition_log_prob(policy, sub, cfg)
        if check:
            m.add("first_step_max_abs_log_ratio", torch.tensor(check_ratio(log_prob, sub.log_prob_old, cfg.train.ratio_tol)))
        elem_keep = keep[:, None].expand_as(log_prob)
        is_weight = 1.0
        if correction is not None:  # (weights, keep) [b, T]: detached IS weights and rejections from difrl.correct
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
        pg, pm = ppo_clip_loss(lp_new, lp_old, adv, cfg.train.clip_low, cfg.train.clip_high, weight=weight)
        loss = (pg * is_weight * elem_keep).sum() / denom
        if cfg.train.kl_beta > 0:
            with torch.no_grad(), reference_velocity_ctx():
                _, mean_ref, _ = transition_log_prob(policy, sub, cfg)
            h = (sub.sigma - sub.sigma_next).reshape(-1)
            kl = gaussian_step_kl(mean, mean_ref, std, h, cfg.train.kl_form).view_as(log_prob)
            loss = loss + cfg.train.kl_beta * (kl * elem_keep).sum() / denom
            m.add("kl", kl, mask)
        m.add("policy_loss", pg, mask)
        for name in ("approx_kl", "clip_high", "clip_low", "ratio"):
            m.add(name, pm[name], mask)
        m.add_ratio(pm["ratio"], sub.step, mask)
        return loss

    nft_train_sigmas = nft_sigmas(cfg, sigmas)  # [T]

    def nft_micro_loss(sub: Rollout, adv: torch.Tensor, keep: torch.Tensor, correction, m: "_Metrics",
                       check: bool, denom: int) -> torch.Tensor:
        # DiffusionNFT (difrl.algos.nft): each clean sample noised afresh at the T trained sigmas, noise from its seed
        B, Tn = len(sub), len(nft_train_sigmas)
        x0 = sub.x_final.repeat_interleave(Tn, dim=0)  # [B*T, *latent], sample-major like cond_repeat
        sigma = nft_train_sigmas.repeat(B)
        eps = counter_normal(mix_seed_tensor(sub.seeds, 7), list(range(Tn)), tuple(policy.latent_shape))  # [T, B, ...]
        x_sigma = nft_noised(x0, sigma, eps.transpose(0, 1).reshape(x0.shape))
        cond = cond_repeat(sub.cond, Tn)
        with torch.no_grad():  # before the graph is built: swapping weights in place would invalidate it
            with old.swapped():
                v_old = policy.velocity(x_sigma, sigma, cond, cfg.sampler.guidance)
            v_ref = None
            if cfg.nft.ref_beta > 0:
                with reference_velocity_ctx():
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

    bar = tqdm(range(start, cfg.train.iterations), initial=start, total=cfg.train.iterations, desc="train",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    stopped = None
    it = start - 1
    for it in bar:
        t_iter = time.perf_counter()
        # ==================================================================== rollout
        gen = torch.Generator().manual_seed(mix_seed(cfg.seed, it, 1))
        P, G = len(world.prompts), cfg.rollout.group_size
        order = torch.cat([torch.randperm(P, generator=gen) for _ in range(-(-cfg.rollout.prompts_per_iter // P))])
        group_prompt = order[:cfg.rollout.prompts_per_iter]  # [groups] prompt id of each group
        k = torch.arange(rank * per_proc, (rank + 1) * per_proc)  # this process's global sample indices
        prompt_ids, group_ids = group_prompt[k // G], it * cfg.rollout.prompts_per_iter + k // G
        seeds = torch.tensor([mix_seed(cfg.seed, it, 0, int(i)) for i in k])
        init_seeds = (torch.tensor([mix_seed(cfg.seed, it, 3, int(g)) for g in k // G]) if cfg.rollout.same_init_noise else seeds)
        sde_mask, train_mask, window_start = step_masks(cfg, it, n_total)
        prompts = [world.prompts[i] for i in prompt_ids.tolist()]
        unwrapped.eval()
        stage = {"nfe_lowprec": 0, "nfe_full": 0}  # network evaluations per iteration (all processes) and stage times
        nfe = nfe_per_step(cfg)
        with sampling_ctx():  # NFT samples from its old policy; GRPO from the trained one
            if rollout_copy is not None and it % cfg.rollout.sync_every == 0:
                if copy_source is not None:
                    copy_source.update(0.0)  # remember what the copy was synced from
                rollout_copy.sync(unwrapped, check=it > start)  # after an update: changing nothing is a WeightSyncError
            elif rollout_copy is not None and it == start:  # resumed between two syncs of a stale copy
                with copy_source.swapped():
                    rollout_copy.sync(unwrapped, check=False)
            if cfg.rollout.kind == "solrl":
                # -------- stage 1: a large candidate pool from the rollout copy, few deterministic steps, rewarded
                t_c = time.perf_counter()
                chosen_seeds, chosen_candidate_reward, n_cand = _solrl_candidates(
                    cfg, policy, rollout_copy, world, rewards, group_prompt, it, accelerator, run_dir, checkpoint)
                seeds = init_seeds = chosen_seeds[k]
                stage["nfe_lowprec"] += n_cand * cfg.solrl.preview_steps * nfe
                stage["seconds_candidates"] = time.perf_counter() - t_c
            # -------- the trained rollouts: Sol-RL stage 2 (full precision, the chosen seeds), flat, or trees
            t_r = time.perf_counter()
            on_copy = rollout_copy is not None and cfg.rollout.kind != "solrl"
            with rollout_copy.active(policy) if on_copy else nullcontext():
                if tree_mode:  # one tree per group, root seed = its first leaf's flat seed; leaves = the group
                    trees = torch.arange(rank * per_proc // G, (rank + 1) * per_proc // G)
                    tr = tree_rollout(policy, prompts[::G], seeds[::G], sigmas, schedule, cfg.sampler.kind,
                                      kernel_kwargs(cfg), cfg.tree.noise_scale, cfg.tree.kappa_logprob, sde_mask,
                                      group_prompt[trees], it * cfg.rollout.prompts_per_iter + trees,
                                      guidance=cfg.sampler.guidance, batch_size=cfg.sampler.rollout_batch)
                    batch, samples = tr.edges, tr.x_leaf  # trained records: the SDE edges; rewarded: the leaves
                    seeds = tr.node_seed[tr.leaf_node]
                else:
                    batch = rollout(policy, prompts, seeds, sigmas, cfg.sampler.kind, kernel_kwargs(cfg), sde_mask,
                                    train_mask[rank * per_proc:(rank + 1) * per_proc], prompt_ids, group_ids, init_seeds,
                                    cfg.sampler.guidance, batch_size=cfg.sampler.rollout_batch)
                    samples = batch.x_final
            low = on_copy and cfg.rollout.precision != "fp32"
            evaluations = tr.evaluations * world_size if tree_mode else n_total * cfg.sampler.num_steps
            stage["nfe_lowprec" if low else "nfe_full"] += evaluations * nfe
            stage["seconds_regenerate" if cfg.rollout.kind == "solrl" else "seconds_sampling"] = time.perf_counter() - t_r
        correction = None
        if on_copy and cfg.train.objective == "grpo":
            # the rollout policy mu differs from the trainer's: recompute the proximal policy's log-probs and means
            # (PPO's ratio and the first-step check are against it) and weigh each transition by pi_old / mu
            with torch.no_grad():  # in micro-batches: a real model cannot take all B*T transitions in one forward
                parts = [transition_log_prob(policy, batch.select(torch.arange(lo, min(lo + cfg.train.micro_batch, len(batch)))), cfg)
                         for lo in range(0, len(batch), cfg.train.micro_batch)]
                lp_prox, mean_prox = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            log_prob_rollout = batch.log_prob_old
            batch.log_prob_old, batch.mean_old = lp_prox, mean_prox.view_as(batch.mean_old)
            correction = CORRECTORS[cfg.correct.method](lp_prox, log_prob_rollout, None, **cfg.correct.options)
            stage["nfe_full"] += len(batch) * world_size * T * nfe  # the proximal recompute is a full-precision forward
        t_reward = time.perf_counter()

        # ==================================================================== reward
        images = policy.decode(samples)
        metadata = [world.metadata(int(p)) for p in prompt_ids]
        bad = torch.zeros(per_proc, dtype=torch.bool)
        try:
            scores = score_all(rewards, images, prompts, metadata, seeds, prompt_ids)
        except RewardError as e:
            if cfg.reward.on_error == "stop":
                checkpoint(it)  # nothing is lost: the run resumes at this iteration once the reward is fixed
                raise RewardError(f"iteration {it}: {e}. The run stopped (reward.on_error=stop) after saving a "
                                  f"checkpoint; resume with resume={run_dir}, or set reward.on_error=drop_group.", e.bad) from e
            bad = e.bad  # a reward that raised marks the whole batch; NaN/inf marks only its samples
            names = [name.rsplit(":", 1)[-1] for name in rewards]
            scores = {k: torch.zeros(per_proc) if e.scores is None else torch.where(bad, 0.0, e.scores[k]) for k in names}
            accelerator.print(f"iteration {it}: {e}; dropping their groups (reward.on_error=drop_group)")
        t_adv = time.perf_counter()

        # ==================================================================== advantage
        weights = {name.rsplit(":", 1)[-1]: w for name, w in cfg.reward.weights.items()}
        all_scores = {name: accelerator.gather(scores[name]) for name in weights}
        all_groups, all_bad = accelerator.gather(group_ids), accelerator.gather(bad.long()).bool()
        bad_groups = all_groups[all_bad].unique()
        adv = group_advantages(all_scores, weights, all_groups, cfg.reward.aggregate, cfg.advantage.std_scope,
                               cfg.advantage.eps, cfg.advantage.clip)
        keep_all = ~torch.isin(all_groups, bad_groups)
        if cfg.advantage.drop_zero_spread:
            keep_all &= ~adv.zero_spread
        own = slice(rank * per_proc, (rank + 1) * per_proc)
        advantages, keep = adv.advantages[own], keep_all[own]
        if cfg.rollout.kind == "solrl":  # does the low-precision ranking predict the full-precision rewards?
            regenerated = sum(w * all_scores[n] for n, w in weights.items())
            stage.update({f"solrl/{k}": v for k, v in rank_agreement(chosen_candidate_reward.view(-1, G), regenerated.view(-1, G)).items()})
            stage["solrl/candidate_reward_mean"] = float(chosen_candidate_reward.mean())

        if tree_mode:  # BranchGRPO: fused node rewards, advantages per tree and depth, edges pruned (§1.3-§1.6)
            batch, advantages, keep, kept = _tree_edges(cfg, tr, scores, weights, keep, it)
            if correction is not None:
                correction = Correction(correction.weights[kept], correction.keep[kept], correction.diagnostics)
            adv_sum = torch.tensor([float(advantages.abs().sum()), float(len(batch))], dtype=torch.float64)
            if world_size > 1:
                adv_sum = accelerator.reduce(adv_sum.to(accelerator.device), "sum").cpu()
            stage["tree/edges_trained"] = int(adv_sum[1])
            stage["tree/edges_sampled"] = len(tr.edges) * world_size
            stage["tree/edge_adv_abs_mean"] = float(adv_sum[0] / max(float(adv_sum[1]), 1.0))

        # ==================================================================== policy update
        unwrapped.train()
        m = _Metrics(cfg.sampler.num_steps)
        if correction is not None:
            for name, value in correction.diagnostics.items():
                m.add(f"correct/{name}", value)
        n_rec, mbs, ga = len(batch), cfg.train.micro_batch, cfg.train.grad_accum  # records: samples, or tree edges
        micro_per_epoch = -(-n_rec // mbs)
        first = True
        for epoch in range(cfg.train.inner_epochs):
            perm = torch.randperm(n_rec, generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 4, epoch)))
            for mb in range(micro_per_epoch):
                idx = perm[mb * mbs:(mb + 1) * mbs]
                sub = batch.select(idx)
                first_of_update = (mb // ga) * mbs * ga
                denom = (min(n_rec, first_of_update + mbs * ga) - first_of_update) * T  # this update's records x steps,
                sync = (mb + 1) % ga == 0 or mb == micro_per_epoch - 1                 # so 1x8 accumulation == 8x1
                with (nullcontext() if sync else accelerator.no_sync(net)):
                    micro_loss = grpo_micro_loss if cfg.train.objective == "grpo" else nft_micro_loss
                    loss = micro_loss(sub, advantages[idx], keep[idx].float(), None if correction is None else (correction.weights[idx], correction.keep[idx]),
                                      m, first and cfg.train.ratio_check, denom)
                    first = False
                    accelerator.backward(loss)
                if sync:
                    if cfg.train.max_grad_norm is not None:
                        m.add("grad_norm", torch.as_tensor(accelerator.clip_grad_norm_(params.values(), cfg.train.max_grad_norm)))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if ema is not None:
                        ema.update()
        if old is not None:  # Sol-RL/DiffusionNFT: old <- d old + (1 - d) new, d = min(rate * iteration, max)
            old.update(min(cfg.nft.old_decay_rate * it, cfg.nft.old_decay_max))
        unwrapped.eval()
        t_log = time.perf_counter()

        # ==================================================================== log
        upd = m.result(accelerator)
        row = {
            "iteration": it + 1,
            "reward_mean": float(adv.reward.mean()), "reward_std": float(adv.reward.std(unbiased=False)),
            **{f"reward/{k}": float(v.mean()) for k, v in all_scores.items()},
            **adv.stats(),
            "zero_spread_groups": int(all_groups[adv.zero_spread].unique().numel()),
            "dropped_groups": int(all_groups[~keep_all].unique().numel()),
            "failed_reward_groups": int(bad_groups.numel()),
            "trained_samples": int(keep_all.sum()),
            "nfe_train": int(accelerator.gather(torch.tensor([len(batch)])).sum()) * T * cfg.train.inner_epochs * nfe,
            "loss": upd.get("policy_loss", 0.0) + (cfg.train.kl_beta if cfg.train.objective == "grpo" else cfg.nft.ref_beta) * upd.get("kl", 0.0),
            **stage,
            **{k: v for k, v in upd.items()},
            "ratio_mean": upd.get("ratio", 1.0),
            "window_start": window_start,
            "lr": optimizer.param_groups[0]["lr"],
            "seconds_rollout": t_reward - t_iter, "seconds_reward": t_adv - t_reward, "seconds_update": t_log - t_adv,
        }
        row["ratio_std"] = _pooled_std(upd["ratio_per_step"])
        row.pop("ratio", None)
        if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.train.iterations:
            t_eval = time.perf_counter()
            ev = evaluate("eval", it + 1)
            run_state["last_eval"] = ev
            row.update({f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
            row["seconds_eval"] = time.perf_counter() - t_eval
            stopped = _should_stop(cfg, ev, run_state)
        row["seconds"] = time.perf_counter() - t_iter
        if accelerator.is_main_process:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        last = run_state["last_eval"] or {}
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{last.get('accuracy', float('nan')):.3f}",
                        fd=f"{last.get('fd', float('nan')):.1f}")

        # ==================================================================== checkpoint
        if stopped or (cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0):
            checkpoint(it + 1)
        if stopped:
            accelerator.print(f"difrl: stopping after iteration {it + 1}: {stopped}")
            break
    bar.close()

    # ======================================================================== finish
    done = it + 1 if cfg.train.iterations > start else start
    if not stopped:
        checkpoint(done)
    eval_after = evaluate("after", done)
    accelerator.print("eval after:  " + _fmt_eval(eval_after))
    summary = {"eval_before": run_state["eval_before"], "eval_after": eval_after, "iterations": done,
               "stopped_early": stopped, "fd_extractor": eval_after.get("fd_extractor"), "run_dir": str(run_dir)}
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "summary.json", summary)
        _save_policy(unwrapped, ema, run_dir, cfg, world)
        plot_reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


# ---------------------------------------------------------------------------------- pieces of the loop


def _solrl_candidates(cfg: FlowConfig, policy, rollout_copy, world, rewards, group_prompt: torch.Tensor, it: int,
                      accelerator, run_dir: Path, checkpoint) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sol-RL stage 1 (specs/lowprec-and-correctors.md §1.2). Candidate c of prompt group p (global index
    p * N + c, split over processes in contiguous slices) gets seed mix_seed(seed, it, 6, index) and is sampled
    by the rollout copy (or the policy at rollout.precision=fp32) with the deterministic solver in
    solrl.preview_steps steps. Rewards are gathered, `solrl.select` picks rollout.group_size per prompt.
    Returns (seeds of the chosen samples [P * G] in group order, their candidate rewards [P * G], candidates)."""
    P, N, G = cfg.rollout.prompts_per_iter, cfg.solrl.candidates, cfg.rollout.group_size
    per = P * N // accelerator.num_processes
    c = torch.arange(accelerator.process_index * per, (accelerator.process_index + 1) * per)
    prompt_ids = group_prompt[c // N]
    seeds = torch.tensor([mix_seed(cfg.seed, it, 6, int(i)) for i in c])
    prompts = [world.prompts[i] for i in prompt_ids.tolist()]
    preview = world.sigmas(cfg.solrl.preview_steps, cfg.sampler.shift)
    ode = torch.zeros(cfg.solrl.preview_steps, dtype=torch.bool)
    with rollout_copy.active(policy) if rollout_copy is not None else nullcontext():
        cand = rollout(policy, prompts, seeds, preview, "ode", sde_mask=ode, prompt_ids=prompt_ids,
                       guidance=cfg.sampler.guidance, batch_size=cfg.solrl.batch)
    images = policy.decode(cand.x_final)
    weights = {name.rsplit(":", 1)[-1]: w for name, w in cfg.reward.weights.items()}
    try:
        scores = score_all(rewards, images, prompts, [world.metadata(int(p)) for p in prompt_ids], seeds, prompt_ids)
    except RewardError as e:
        if cfg.reward.on_error == "stop":
            checkpoint(it)
            raise RewardError(f"iteration {it}, Sol-RL candidates: {e}. The run stopped (reward.on_error=stop) after "
                              f"saving a checkpoint; resume with resume={run_dir}.", e.bad) from e
        # drop_group: a failed candidate ranks last; stage 2 re-scores and drops what still fails
        accelerator.print(f"iteration {it}, Sol-RL candidates: {e}; ranking them last (reward.on_error=drop_group)")
        scores = {k: torch.full((per,), -float("inf")) if e.scores is None else
                  torch.where(e.bad, -float("inf"), e.scores[k]) for k in weights}
    total = sum(w * scores[n] for n, w in weights.items())
    total = accelerator.gather(total).view(P, N)  # [P, N] in global candidate order
    idx = select_indices(total, G, cfg.solrl.select, torch.Generator().manual_seed(mix_seed(cfg.seed, it, 8)))
    chosen = (torch.arange(P)[:, None] * N + idx).flatten()  # [P * G] global candidate indices, group order
    chosen_seeds = torch.tensor([mix_seed(cfg.seed, it, 6, int(i)) for i in chosen])
    return chosen_seeds, total.flatten()[chosen], P * N


def _tree_edges(cfg: FlowConfig, tr: TreeRollout, scores: dict, weights: dict, leaf_keep: torch.Tensor,
                iteration: int) -> tuple[Rollout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BranchGRPO's trained edges for this process's trees (specs/branch-cps-guard.md §1.3-§1.6).
    Leaf rewards (tree.leaf_node order = this process's samples) are fused into every node (tree.fusion),
    normalised per tree and depth, and each SDE edge takes its child's advantage. Depth and width pruning
    drop edges from the backward pass (per tree, so prompts never mix, §1.10). A tree whose group was
    dropped (failed reward, zero spread) keeps its edges with keep = 0, like the flat trainer's samples.
    Returns (kept edges, their advantages [E'], keep [E'] bool, the kept rows' indices into tr.edges [E'])."""
    t, tc = tr.tree, cfg.tree

    def node_advantages(leaf_rewards: torch.Tensor) -> torch.Tensor:  # [L] -> [Nn]
        values = fuse_rewards(t, leaf_rewards, tc.fusion, tc.fusion_lambda, tc.fusion_lambda)
        return depthwise_advantages(t, values, cfg.advantage.eps)

    if cfg.reward.aggregate == "reward_sum":
        node_adv = node_advantages(sum(w * scores[n].double() for n, w in weights.items()).float())
    else:  # advantage_sum: each reward normalised on its own, then weighted (MixGRPO's multi-reward form)
        node_adv = sum(w * node_advantages(scores[n]) for n, w in weights.items())
    adv = edge_advantages(tr, node_adv.clamp(-cfg.advantage.clip, cfg.advantage.clip))  # [E]
    edge_tree = t.tree[t.edge_child[tr.trained_edge]]  # [E] local tree of each edge (tree-major order)
    keep = leaf_keep.view(t.num_trees, -1).all(1)[edge_tree]
    sel = torch.ones(len(adv), dtype=torch.bool)
    if tc.depth_prune:
        sel &= depth_prune(t, tr.trained_edge, tc.depth_prune, iteration, tc.depth_slide_every, tc.depth_stop)
    if tc.width_prune != "none":
        for k in range(t.num_trees):
            rows = edge_tree == k
            sel[rows] = width_prune(t, tr.trained_edge[rows], adv[rows], tc.width_prune, tc.width_ratio, mask=sel[rows])
    kept = sel.nonzero().flatten()
    return tr.edges.select(kept), adv[kept], keep[kept], kept


class _swap_module:
    """Context: run the policy with another module (the frozen reference of full fine-tuning)."""

    def __init__(self, policy, module):
        self.policy, self.module = policy, module

    def __enter__(self):
        self.saved = self.policy.module
        self.policy.module = self.module

    def __exit__(self, *exc):
        self.policy.module = self.saved


def _should_stop(cfg: FlowConfig, ev: dict, run_state: dict) -> str | None:
    """FD early stopping: quality is watched on the reward's own features, never the held-out judge."""
    if "fd" not in ev:  # a world without FD features (diffusers models; the config refuses stop.fd_rise there)
        return None
    fd = ev["fd"]
    best = run_state["best_fd"]
    run_state["best_fd"] = fd if best is None else min(best, fd)
    if cfg.stop.fd_rise is None or best is None:
        return None
    if fd > cfg.stop.fd_rise * best and ev["accuracy"] >= cfg.stop.min_accuracy:
        run_state["bad_evals"] += 1
    else:
        run_state["bad_evals"] = 0
    if run_state["bad_evals"] >= cfg.stop.patience:
        return (f"Fréchet distance {fd:.2f} above {cfg.stop.fd_rise:g} x its best {best:.2f} for "
                f"{run_state['bad_evals']} evaluation(s) (stop.fd_rise)")
    return None


def _pooled_std(per_step: dict) -> float:
    if not per_step:
        return 0.0
    means = [v[0] for v in per_step.values()]
    sq = [v[1] ** 2 + v[0] ** 2 for v in per_step.values()]
    mu = sum(means) / len(means)
    return math.sqrt(max(sum(sq) / len(sq) - mu**2, 0.0))


def _truncate_metrics(path: Path, keep_iterations: int) -> None:
    """On resume, drop metric rows written after the checkpoint (a crash between the two)."""
    if not path.exists():
        return
    rows = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in rows if json.loads(ln)["iteration"] <= keep_iterations]
    if len(kept) != len(rows):
        path.write_text("".join(ln + "\n" for ln in kept))


def _fmt_eval(ev: dict) -> str:
    keys = ("accuracy", "judge_accuracy", "fd", "diversity", "real_diversity", "reward")
    text = ", ".join(f"{k} {ev[k]:.3f}" for k in keys if k in ev)
    return text + (f" (FD features: {ev['fd_extractor']})" if "fd_extractor" in ev else "")


def _save_policy(unwrapped, ema: EMA | None, run_dir: Path, cfg: FlowConfig, world) -> None:
    """The trained generator (EMA weights if on). Digits: LoRA merged, a plain checkpoint usable as model.path
    (policy.safetensors). Diffusers models: the model's own format, run_dir/lora for pipe.load_lora_weights, or the
    fully fine-tuned transformer's save_pretrained directory run_dir/transformer."""
    if ema is not None:
        ema.swap()
    try:
        if world.save_lora is not None:
            if cfg.train.lora.enabled:
                world.save_lora(world.policy, run_dir / "lora")
            else:
                unwrapped.save_pretrained(run_dir / "transformer")
            return
        path = run_dir / "policy.safetensors"
        module = unwrapped
        if cfg.train.lora.enabled:
            module = copy.deepcopy(unwrapped).merge_and_unload()
        meta = {k: str(v) for k, v in vars(module.cfg).items()} if hasattr(module, "cfg") else {}
        save_safetensors(module.state_dict(), path, meta)
    finally:
        if ema is not None:
            ema.swap()


def plot_reward_curve(metrics_path: Path, out: Path, summary: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    it = [r["iteration"] for r in rows]
    ax[0].plot(it, [r["reward_mean"] for r in rows], label="train reward (mean)")
    digits = not summary or "accuracy" in summary["eval_before"]  # other worlds: eval reward, no FD
    key = "accuracy" if digits else "reward"
    ev = [(r["iteration"], r[f"eval/{key}"], r.get("eval/fd")) for r in rows if f"eval/{key}" in r]
    if summary:
        ev = [(0, summary["eval_before"][key], summary["eval_before"].get("fd"))] + ev
        ev.append((summary["iterations"], summary["eval_after"][key], summary["eval_after"].get("fd")))
    if ev:
        ax[0].plot([e[0] for e in ev], [e[1] for e in ev], "o-", label=f"eval {key}")
        if digits:
            ax[1].plot([e[0] for e in ev], [e[2] for e in ev], "o-", color="C2")
    ax[0].set_xlabel("iteration"); ax[0].legend(); ax[0].grid(alpha=0.3)
    if digits:
        ax[0].set_ylim(0, 1.02)
    ax[1].set_xlabel("iteration"); ax[1].set_ylabel("Fréchet distance"); ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
