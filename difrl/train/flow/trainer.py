"""The flow-matching GRPO recipe: one loop for every flow policy (digits, FLUX, SD3, Wan).

    difrl train configs/digits.yaml [key=value ...] [--out DIR]     # resume: difrl train resume=DIR
    accelerate launch --multi_gpu --num_processes 2 -m difrl train configs/digits.yaml
    torchrun --nproc_per_node 2 -m difrl train configs/digits.yaml

Reads top to bottom: setup -> (rollout -> reward -> advantage -> K policy updates -> EMA ->
log -> checkpoint) per iteration. Everything random is derived from (seed, iteration, index),
so a resumed run continues exactly as if it had never stopped (Ctrl-C / SIGTERM stop it at an iteration
boundary with a checkpoint: difrl/train/run/interrupt.py). The methods are calls into their
modules: Sol-RL's candidate pool (difrl.solrl), BranchGRPO's tree rollout and trained edges
(difrl.tree_rollout, difrl.algos.tree), the GRPO, Flow-DPPO and DiffusionNFT losses and the proximal
recompute of copy rollouts (difrl.train.flow.objectives), AWM, DPO and DGPO (difrl.train.flow.matching_objectives),
Pref-GRPO's win rates and GARDO's gated KL and diversity (difrl.train.flow.method_stage), DRaFT-K / ReFL's own loop
phase (difrl.train.flow.reward_backprop; the objectives are docs/guides/methods.md); run directory, resume, LoRA and
reference, metrics and plots are the scaffold's (difrl.train.scaffold), the iteration's skeleton (scoring,
gathering the rewards, the samples kept, the metric row, evaluation and checkpoint) difrl.train.iteration's, shared
with the masked recipe.

Groups may span processes: the sample list of an iteration is global (sample k belongs to group
k // group_size), each process rolls out a contiguous slice, rewards are gathered before the
advantages are computed, and each process trains on its own samples.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from difrl.algos.tree import edge_leaf_weights, tree_train_edges
from difrl.correct.core import Correction
from difrl.eval.metrics import change_over_noise
from difrl.models.base import forwards_per_step
from difrl.rewards import Scoring
from difrl.rollout import cat_rollouts, chunk_slices, per_transition, rollout
from difrl.solrl import candidate_pool, rank_agreement
from difrl.train.config import FlowConfig
from difrl.train.dist.sharded_step import grad_sync, take_fsdp_branches
from difrl.train.dist.sharding import fsdp_settings, process_group_kwargs
from difrl.train.dist.unit_gather import device_free_bytes, rollout_gather, units_gathered
from difrl.train.final_save import save_final
from difrl.train.flow.matching_objectives import (MATCHING_OBJECTIVES, matching_micro_loss, needs_old, needs_reference,
                                             old_decay, prepare_update, trained_sigmas)
from difrl.train.flow.method_stage import Gardo, advantage_function, candidate_reward, tree_stats
from difrl.train.flow.objectives import dppo_micro_loss, grpo_micro_loss, nft_micro_loss, proximal_correction
from difrl.train.flow.plan import plan_flow_iteration, step_masks
from difrl.train.flow.reward_backprop import BACKPROP_OBJECTIVES, reward_backprop_loop
from difrl.train.flow.rollout_copy import RolloutCopy, build_rollout_copy, sync_rollout_copy  # noqa: F401
from difrl.train.iteration import (close_iteration, gather_rewards, iteration_row, kept_samples, optimizer_step,
                                   score_iteration)
from difrl.train.metrics import Metrics, pooled_std
from difrl.train.precision import refuse_fp16, trained_network
from difrl.train.reward_stage import build_rewards, probe_batch, reward_stats
from difrl.train.run.progress import progress_bar
from difrl.train.run.rundir import finished, held_stop
from difrl.train.run.state import EMA, trainable_params
from difrl.train.scaffold import (TIMING_KEYS, RatioCheckError, Run, claim_run_dir,  # noqa: F401
                                  default_threads, make_optimizer, record_eval, reference_policy)
from difrl.tree_rollout import tree_rollout
from difrl.utils.collectives import gather, gather_max, split_rows
from difrl.utils.rng import mix_seed
from difrl.worlds import build_world


def train(cfg: FlowConfig, out_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    from accelerate import Accelerator

    # ======================================================================== setup
    refuse_fp16(cfg.model.dtype)  # before a large model loads: fp16 training is refused (difrl/train/precision.py)
    # resume=: the run's config.yaml allows the changes; else the directory holds no run, or overwrite (rundir.py)
    run_dir = claim_run_dir(cfg, out_dir, overwrite, "runs/flow")
    if (summary := finished(cfg, run_dir)) is not None:  # resume= of a finished run: nothing to do (rundir.py)
        return summary
    world = build_world(cfg.model.kind, cfg.model.path, cfg)
    # a world whose network is small asks for the CPU (World.on_cpu: kernel launches would dominate on a GPU);
    # without cpu=True accelerate ignores torchrun's WORLD_SIZE on a machine with no GPU
    cpu = world.on_cpu or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=cpu, kwargs_handlers=process_group_kwargs(cpu))  # FSDP offload: a CPU backend too
    take_fsdp_branches(accelerator)  # an FSDP launch runs accelerate's FSDP code on CPU processes too (tests)
    world_size, rank = accelerator.num_processes, accelerator.process_index
    torch.set_num_threads(cfg.threads or default_threads(world_size))
    tree_mode, solrl, nft = cfg.rollout.kind == "tree", cfg.rollout.kind == "solrl", cfg.train.objective == "nft"
    n_total, per_proc, T, schedule, micro = plan_flow_iteration(cfg, world, world_size, run_dir, accelerator.print)

    policy = world.policy
    rewards, weights = build_rewards(cfg.reward, world.default_reward, probe_batch(world))  # a misfit stops here
    sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)  # difrl's schedule, or a pipeline's own
    trainee = setup_training(cfg, policy, accelerator)  # LoRA / masters / reference / FSDP / optimizer / EMA / copy
    unwrapped, optimizer, ema, old = trainee.unwrapped, trainee.optimizer, trainee.ema, trainee.old
    masters, rollout_copy, copy_source = trainee.masters, trainee.rollout_copy, trainee.copy_source
    gardo = Gardo(cfg, policy, unwrapped, {}) if cfg.gardo.enabled else None  # its reference and controller
    if gardo is not None:
        trainee.reference_ctx = gardo.reference_ctx  # the KL against GARDO's adaptive reference
    extras = {k: v for k, v in (("old", old), ("rollout_source", copy_source)) if v is not None} | (gardo.extras() if gardo else {})
    train_sigmas = trained_sigmas(cfg, sigmas)  # NFT's / AWM's / DPO's / DGPO's re-noising sigmas [T], else None

    run = Run.open(cfg, run_dir, unwrapped, optimizer, ema, extras, accelerator, overwrite=overwrite,
                   state={**(world.stop.initial_state() if world.stop else {}), "stopped_early": None,  # stop counters
                          **({"gardo": gardo.state} if gardo else {})})
    if gardo is not None:
        gardo.state = run.state["gardo"]  # resumed: the checkpoint's controller and last refresh
    if run.state["eval_before"] is None:
        run.state["eval_before"] = run.state["last_eval"] = evaluate(world, policy, ema, cfg, run, "before", 0)
        accelerator.print("eval before: " + world.eval_line(run.state["eval_before"]))

    bar = progress_bar(run.start, cfg.train.iterations, accelerator.is_main_process)  # plain lines off a terminal
    stopped, done = None, run.start  # iterations completed
    iterations = bar
    if (held := held_stop(cfg, run.state, world.stop)) is not None:  # resumed after an early stop that holds: finish, no training
        stopped, iterations = held["reason"], ()
        accelerator.print(f"difrl: the run stopped early after iteration {held['iteration']} ({stopped}): finishing "
                          "it without training (another stop rule on the command line continues it)")
    elif cfg.train.objective in BACKPROP_OBJECTIVES:  # DRaFT / ReFL: their own loop phase (train/flow/reward_backprop.py)
        done, stopped = reward_backprop_loop(cfg, world, policy, trainee, accelerator, run, bar, rewards, weights, sigmas,
                                             per_proc, evaluate, world.stop)
        iterations = ()
    for it in iterations:
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
        metadata = [world.metadata(i) for i in prompt_ids.tolist()]
        scoring = Scoring(rewards, overlap=cfg.reward.overlap)  # the trained samples' rewards, submitted as sampled
        unwrapped.eval()
        stage = {"nfe_lowprec": 0, "nfe_full": 0}  # network evaluations per iteration (all processes) and stage times
        nfe = forwards_per_step(policy, cfg.sampler.guidance)  # per sample and step: 2 with CFG's [uncond; cond]
        with old.swapped() if nft else nullcontext():  # NFT samples from its old policy; GRPO from the trained one
            sync_rollout_copy(rollout_copy, copy_source, unwrapped, it, run.start, cfg.rollout.sync_every)
            if solrl:  # stage 1: a large candidate pool from the rollout copy, few deterministic steps, rewarded
                t_c = time.perf_counter()
                pool = candidate_pool(
                    policy, rollout_copy, world.prompts, group_prompt, cfg.seed, it, cfg.solrl.candidates, G,
                    world.sigmas(cfg.solrl.preview_steps, cfg.sampler.shift),
                    lambda *a: candidate_reward(cfg, world, rewards, weights, run, it, accelerator.print, *a),
                    cfg.solrl.select, cfg.sampler.guidance, cfg.solrl.batch, rank, world_size,
                    lambda t: gather(accelerator, t))
                seeds = init_seeds = pool.seeds[k]
                stage["nfe_lowprec"] += pool.size * cfg.solrl.preview_steps * nfe
                stage["seconds_candidates"] = time.perf_counter() - t_c
            # the trained rollouts: Sol-RL stage 2 (full precision, the chosen seeds), flat, or trees
            t_r = time.perf_counter()
            on_copy = rollout_copy is not None and not solrl
            # FSDP: the trained network's blocks gathered once for the whole rollout, or before each forward
            gather_once = rollout_gather(cfg.rollout.fsdp_gather, unwrapped, trainee.fsdp,
                                         device_free_bytes(accelerator.device, optimizer)) == "once"
            if it == run.start and trainee.fsdp is not None:
                when = "once per rollout" if gather_once else "before each forward"
                accelerator.print(f"difrl: FSDP rollouts gather every block {when} (rollout.fsdp_gather={cfg.rollout.fsdp_gather})")
            with rollout_copy.active(policy) if on_copy else units_gathered(unwrapped, trainee.fsdp, gather_once):
                if tree_mode:  # tree.roots trees per group, root seed = its first leaf's flat seed; leaves = the group
                    R, L = cfg.tree.roots, G // cfg.tree.roots  # trees per group, leaves per tree
                    trees = torch.arange(rank * per_proc // L, (rank + 1) * per_proc // L)
                    tr = tree_rollout(policy, prompts[::L], seeds[::L], sigmas, schedule, cfg.sampler.kind,
                                      cfg.sampler.kernel_kwargs(), cfg.tree.noise_scale, cfg.tree.kappa_logprob,
                                      sde_mask, group_prompt[trees // R], it * cfg.rollout.prompts_per_iter + trees // R,
                                      guidance=cfg.sampler.guidance, batch_size=cfg.sampler.rollout_batch)
                    batch = tr.edges  # trained records: the SDE edges; rewarded: the leaves
                    seeds = tr.node_seed[tr.leaf_node]
                    scoring.submit(tr.x_leaf, prompts, metadata, decode=policy.decode)
                else:  # in chunks: each chunk's decode + reward starts (in a thread with reward.overlap) as it is done
                    parts = []
                    for sl in chunk_slices(per_proc, cfg.rollout.chunks):
                        own_mask = train_mask[rank * per_proc:(rank + 1) * per_proc][sl]
                        parts.append(rollout(policy, prompts[sl], seeds[sl], sigmas, cfg.sampler.kind,
                                             cfg.sampler.kernel_kwargs(), sde_mask, own_mask, prompt_ids[sl], group_ids[sl],
                                             init_seeds[sl], cfg.sampler.guidance, batch_size=cfg.sampler.rollout_batch))
                        scoring.submit(parts[-1].x_final, prompts[sl], metadata[sl], decode=policy.decode)
                    batch = cat_rollouts(parts)
            low = on_copy and cfg.rollout.precision != "fp32"
            evaluations = tr.evaluations * world_size if tree_mode else n_total * cfg.sampler.num_steps
            stage["nfe_lowprec" if low else "nfe_full"] += evaluations * nfe
            stage["seconds_regenerate" if solrl else "seconds_sampling"] = time.perf_counter() - t_r
        correction = None
        if on_copy and not nft:  # mu != pi_old: PPO's ratio against the recomputed proximal policy, IS weights
            with units_gathered(unwrapped, trainee.fsdp, gather_once):  # no-grad forwards too
                batch, correction = proximal_correction(policy, batch, cfg, micro.transitions,  # all processes
                                                        lambda t: gather(accelerator, t), rank)
            stage["nfe_full"] += len(batch) * world_size * T * nfe
        t_reward = time.perf_counter()

        # ==================================================================== reward
        # a failure or signal on any process stops all (difrl/train/iteration.py)
        scores, bad = score_iteration(lambda: scoring.result(prompt_ids, seeds), len(prompts), cfg, run, it,
                                      accelerator.print, accelerator)
        if run.agree_interrupted():  # SIGINT / SIGTERM on any process: this iteration is abandoned before its update
            break
        t_adv = time.perf_counter()

        # ==================================================================== advantage
        # every collective through difrl.utils.collectives: on the accelerator's device (NCCL), back on the host here
        all_groups = gather(accelerator, group_ids)
        rw = gather_rewards(cfg, run, it, accelerator, scores, bad, all_groups)  # [N] scores, failures
        all_scores = rw.scores
        adv, failed = advantage_function(cfg)(all_scores, weights, all_groups, rw.bad, cfg.advantage, cfg.reward.aggregate)
        if gardo is not None:  # GARDO: diversity-shaped advantages, the samples whose KL applies (train/flow/method_stage.py)
            adv, kl_flags = gardo.shape(adv, all_scores, weights, all_groups, failed, gather(accelerator, batch.x_final.flatten(1)))
            batch.extras["kl_keep"] = kl_flags[rank * per_proc:(rank + 1) * per_proc].to(batch.x_final.device)
        keep_all = kept_samples(adv, failed, cfg.advantage.drop_zero_spread)
        own = slice(rank * per_proc, (rank + 1) * per_proc)
        advantages, keep = adv.advantages[own], keep_all[own]
        if solrl:  # does the low-precision ranking predict the full-precision rewards?
            # a failed group's NaN rewards give a NaN agreement, which rank_agreement leaves out
            stage.update({f"solrl/{k}": v for k, v in rank_agreement(pool.reward.view(-1, G), adv.reward.view(-1, G)).items()})
            stage["solrl/candidate_reward_mean"] = float(pool.reward.mean())
        if tree_mode:  # BranchGRPO: fused node rewards, advantages per tree and depth, edges pruned (§1.3-§1.6)
            kept, advantages, keep = tree_train_edges(tr, scores, weights, keep, it, cfg.tree, cfg.reward.aggregate,
                                                      cfg.advantage.eps, cfg.advantage.clip, cfg.tree.roots)
            advantages = torch.where(keep, advantages, 0.0)  # a failed leaf's NaN stays in its own (dropped) tree
            batch = tr.edges.select(kept)
            if correction is not None:
                correction = Correction(correction.weights[kept], correction.keep[kept], correction.diagnostics)
            stage.update(tree_stats(tr, advantages, accelerator))
            if cfg.tree.edge_weight == "leaves":  # keep becomes each edge's loss weight (0: a dropped tree's edge)
                keep = keep.float() * edge_leaf_weights(tr, kept)

        # ==================================================================== policy update
        unwrapped.train()
        m = Metrics(cfg.sampler.num_steps)
        for name, value in (correction.diagnostics.items() if correction is not None else ()):
            m.add(f"correct/{name}", value)
        # records: the samples, or each transition one (train.micro_batch not a multiple of T); T_rec transitions each
        batch, advantages, keep, correction, T_rec = training_records(batch, advantages, keep, correction, micro, T)
        policy_update(cfg, policy, trainee, accelerator, batch, advantages, keep, correction, T_rec, micro, it, m,
                      train_sigmas)
        if old is not None:  # DiffusionNFT / AWM's EMA: old <- d old + (1 - d) new, d = min(rate * iteration, max)
            old.update(old_decay(cfg, it))
        unwrapped.eval()
        t_log = time.perf_counter()

        # ==================================================================== log
        upd = m.result(accelerator)
        stage.update(gardo.after_update(it, upd.get("kl")) if gardo is not None else {})
        nfe_train = int(gather(accelerator, torch.tensor([len(batch)])).sum()) * T_rec * cfg.train.inner_epochs * nfe
        loss = upd.get("policy_loss", 0.0) + (cfg.nft.ref_beta if nft else cfg.train.kl_beta) * upd.get("kl", 0.0)
        method = {"dropped_groups": int(all_groups[~keep_all].unique().numel()), "nfe_train": nfe_train, "loss": loss,
                  **stage, "window_start": window_start}
        row = iteration_row(it, rw, adv, keep_all, failed,
                            {**reward_stats(adv.reward, all_scores, weights, all_groups, cfg.advantage), **adv.stats()},
                            method, upd, optimizer.param_groups[0]["lr"], (t_iter, t_reward, t_adv, t_log))
        row["ratio_std"] = pooled_std(upd["ratio_per_step"])
        # ==================================================================== checkpoint (and evaluation, stop)
        done, stopped, stop = close_iteration(cfg, run, row, it, t_iter, bar, world, policy, ema, evaluate, world.stop,
                                              accelerator.print)
        if stop:
            break
    bar.close()

    # ======================================================================== finish
    run.end_loop(done, stopped_early=bool(stopped))  # the final checkpoint; after a signal: a checkpoint, Interrupted
    eval_after = evaluate(world, policy, ema, cfg, run, "after", done)
    accelerator.print("eval after:  " + world.eval_line(eval_after))
    summary = {"eval_before": run.state["eval_before"], "eval_after": eval_after, "iterations": done,
               "stopped_early": stopped, "fd_extractor": eval_after.get("fd_extractor"), "run_dir": str(run_dir),
               "headline": list(world.headline), "before_after": world.before_after_keys()}
    if (change := change_over_noise(summary["eval_before"], eval_after)) is not None:  # diffusers worlds
        summary["reward_change"] = change
    # the world's files (policy.safetensors, lora/ or transformer/) of the EMA weights if on, gathered under FSDP
    # (every process takes part), in the dtypes the model was loaded in: final_save.save_final, as `difrl export`
    save_final(world, policy, unwrapped, cfg.train.lora.enabled, run_dir, masters, ema, accelerator.is_main_process)
    run.finish(summary, world.headline)
    run.barrier()
    accelerator.end_training()
    return summary


# ---------------------------------------------------------------------------------- pieces of the loop


def training_records(batch, advantages: torch.Tensor, keep: torch.Tensor, correction, micro, T: int):
    """The update's records: the samples (T transitions each; tree edges: 1), or, with micro.split_samples
    (train.micro_batch not a multiple of T), every transition a record of its own (per_transition) with its sample's
    advantage and keep and its own IS weight. Returns (batch, advantages, keep, correction, T_rec: transitions per
    record). difrl plan calls it as the trainer does."""
    if not micro.split_samples:
        return batch, advantages, keep, correction, T
    if correction is not None:
        correction = Correction(correction.weights.reshape(-1, 1), correction.keep.reshape(-1, 1), correction.diagnostics)
    return per_transition(batch), advantages.repeat_interleave(T), keep.repeat_interleave(T), correction, 1


@dataclass
class Trainee:
    """What setup_training makes of a policy: the trained network (`net`: as the optimizer and collectives see it,
    `unwrapped`: the module the policy calls), the frozen reference of full fine-tuning, master weights, the FSDP
    settings (None: DDP or one process), the optimizer over `params`, the EMA, DiffusionNFT's old policy and the
    rollout copy with its source. difrl plan (difrl/train/planner/flow.py) runs the same function at real size."""
    net: torch.nn.Module
    unwrapped: torch.nn.Module
    reference: torch.nn.Module | None
    masters: object
    fsdp: object
    params: dict
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    old: EMA | None
    rollout_copy: object
    copy_source: object
    reference_ctx: object


def setup_training(cfg: FlowConfig, policy, accelerator) -> Trainee:
    """The trained network of `policy` and everything that follows its parameters, in the order that keeps
    precision and sharding right: LoRA or the frozen reference (wrap_policy), fp32 master weights of a bf16 full
    fine-tune (upcast_masters), FSDP2 (shard_policy, when the launch asks for it), the optimizer, EMA / NFT old policy,
    the rollout copy. Installs the network in `policy` (policy.module)."""
    # LoRA or the frozen reference; full fine-tuning of a bf16 model: fp32 master weights (so fp32 gradients, AdamW
    # state, EMA / NFT / copy-source shadows and checkpoints), bf16 compute under autocast; FSDP2 (accelerate launch
    # --config_file configs/accelerate/fsdp.yaml) or None, gathering in the compute dtype, the masters and reference
    # made one block at a time as they are sharded
    net, reference, masters, fsdp = trained_network(policy, cfg.train.lora, cfg.seed, needs_reference(cfg),
                                                    fsdp_settings(accelerator), accelerator.device)
    params = trainable_params(net)
    optimizer = make_optimizer(params, cfg.train)
    if fsdp is None:  # DDP (or one process); a sharded net is already distributed
        net, optimizer = accelerator.prepare(net, optimizer)
    policy.module = net
    unwrapped = accelerator.unwrap_model(net)
    ema = EMA(trainable_params(unwrapped), cfg.train.ema_decay, unwrapped) if cfg.train.ema_decay > 0 else None
    # DiffusionNFT's old policy (the sampler and v_old), AWM's EMA anchor: an EMA of the trained weights, own schedule
    old = EMA(trainable_params(unwrapped), 0.0, unwrapped) if needs_old(cfg) else None
    # under FSDP a full low-precision copy per process, built one gathered block at a time (train/flow/rollout_copy.py)
    rollout_copy, copy_source = build_rollout_copy(cfg, policy, unwrapped, masters, accelerator.print,
                                                   accelerator.device, sharded=fsdp is not None)
    reference_ctx = lambda: reference_policy(policy, unwrapped, reference)  # noqa: E731
    return Trainee(net, unwrapped, reference, masters, fsdp, params, optimizer, ema, old, rollout_copy, copy_source,
                   reference_ctx)


def policy_update(cfg: FlowConfig, policy, tr: Trainee, accelerator, batch, advantages: torch.Tensor,
                  keep: torch.Tensor, correction, T_rec: int, micro, it: int, m: Metrics, train_sigmas,
                  max_micro_steps: int | None = None) -> None:
    """train.inner_epochs passes over this process's records `batch` (advantages, keep: [records]) in micro-batches of
    micro.records, train.grad_accum of them per optimizer step (gradient clipping, EMA update). Each micro-step's
    loss is divided by its update's transitions, so 1x8 accumulation == 8x1 (DPO / DGPO first compute their records'
    coefficients over whole groups: matching_objectives.prepare_update). `max_micro_steps`: difrl plan's
    simulation stops after that many (the first ones and the last, which steps)."""
    objective = cfg.train.objective
    device = batch.x_final.device  # the rollout's (the policy's) device: the losses' operands go there once
    advantages, keep = advantages.to(device), keep.to(device)
    n_rec, mbs, ga = len(batch), micro.records, cfg.train.grad_accum  # records per forward/backward
    micro_per_epoch = -(-n_rec // mbs)
    steps = [(e, mb) for e in range(cfg.train.inner_epochs) for mb in range(micro_per_epoch)]
    if max_micro_steps is not None and len(steps) > max_micro_steps:  # the first ones, then the last (it steps)
        steps = steps[:max_micro_steps - 1] + steps[-1:]
    first, perm, perm_epoch = True, None, None
    prepare_update(policy, batch, advantages, keep, cfg, train_sigmas, tr.reference_ctx,  # DPO / DGPO's group pre-pass
                   lambda t: gather(accelerator, t), accelerator.process_index, mbs, m)
    for epoch, mb in steps:
        if perm_epoch != epoch:
            perm_epoch = epoch
            perm = torch.randperm(n_rec, generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 4, epoch)))
        idx = perm[mb * mbs:(mb + 1) * mbs]  # on the host (the batch's ids and prompts are there)
        sub = batch.select(idx)
        idx = idx.to(device, non_blocking=True)  # once, for the per-record tensors on the policy's device
        first_of_update = (mb // ga) * mbs * ga
        denom = (min(n_rec, first_of_update + mbs * ga) - first_of_update) * T_rec  # the update's transitions,
        sync = (mb + 1) % ga == 0 or mb == micro_per_epoch - 1                 # so 1x8 accumulation == 8x1
        with grad_sync(accelerator, tr.net, tr.fsdp is not None, sync):  # FSDP2: sharded accumulation
            if objective == "nft":
                loss = nft_micro_loss(policy, sub, advantages[idx], keep[idx].float(), m, denom, cfg,
                                      train_sigmas, tr.old, tr.reference_ctx)
            elif objective in MATCHING_OBJECTIVES:  # AWM / DPO / DGPO
                loss = matching_micro_loss(policy, sub, advantages[idx], keep[idx].float(), m, denom, cfg,
                                           train_sigmas, tr.old, tr.reference_ctx)
            else:  # GRPO / Flow-DPPO on the stored transitions
                loss = {"grpo": grpo_micro_loss, "dppo": dppo_micro_loss}[objective](
                    policy, sub, advantages[idx], keep[idx].float(),
                    None if correction is None else (correction.weights[idx], correction.keep[idx]),
                    m, first and cfg.train.ratio_check, denom, cfg, tr.reference_ctx,
                    lambda x: gather_max(accelerator, x))  # all processes stop together
            first = False
            accelerator.backward(loss)
        if sync:
            optimizer_step(cfg, tr, accelerator, m)  # clip, step, EMA



def evaluate(world, policy, ema: EMA | None, cfg: FlowConfig, run: Run, tag: str, iteration: int) -> dict:
    """The world's evaluation of the policy (EMA weights if on), its samples split over the processes and gathered
    (every process gets the metrics of one process's evaluation); its sample grid goes to samples/."""
    with ema.swapped() if ema is not None else nullcontext():
        metrics, images = world.evaluate(policy, cfg.eval.per_digit, cfg.eval.num_steps, cfg.eval.seed, cfg.sampler.shift,
                                         split=lambda n: split_rows(run.accelerator, n))
    if run.is_main:
        world.save_grid(images, run.dir / "samples" / f"{tag}-iter-{iteration:06d}.png")
        record_eval(run.dir, tag, iteration, metrics)
    return metrics

