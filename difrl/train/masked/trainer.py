"""The GRPO recipe for masked (discrete) diffusion policies: MaskGRPO, d1 / diffu-GRPO, UniGRPO, coupled-GRPO.

    difrl train configs/sudoku.yaml [key=value ...] [--out DIR]      # resume: difrl train resume=DIR
    difrl train configs/digit_tokens.yaml
    difrl train configs/sudoku.yaml external.source=solver          # ERILS: a solver's rollouts in every group
    accelerate launch --num_processes 2 -m difrl train configs/sudoku.yaml                  # data-parallel (DDP)
    accelerate launch --config_file configs/accelerate/fsdp.yaml -m difrl train configs/text_arithmetic.yaml  # FSDP2

Reads top to bottom: setup -> (rollout -> reward -> advantage -> mu inner updates -> log ->
checkpoint) per iteration. Everything random is derived from (seed, iteration, index), so a
resumed run continues exactly as if it had never stopped. Run directory, resume, LoRA and the
reference, rewards, metrics and plots are the scaffold's (difrl.train.scaffold), the same as the
flow recipe's, and so is the iteration's skeleton (scoring, gathering the rewards, the samples kept, the metric row,
evaluation and checkpoint: difrl.train.iteration); rewards go through the one registry (difrl.rewards) on the
world's decoded samples.

Log-probs of a masked policy are estimated by re-masking the finished rollout and reading the
denoiser's log-softmax at the re-masked positions (difrl.discrete.estimators;
docs/reference/specs/discrete-diffusion-rl.md §3). Inner update n = 1..mu has its own mask, a pure function of (sample
seed, n, position), so the old-policy log-probs (computed once per rollout, before any update),
the reference log-probs and the current ones of update n all see the *same* mask; the prompt (the
puzzle's givens) is never masked (d1's optional prompt masking aside). The first micro-step of
update 1 is on-policy: its ratio must be exactly 1 (``check_ratio``).

External rollouts (``external``, our reading of ERILS; docs/reference/specs/discrete-diffusion-rl.md §7
found no source): the last K of every group's G rollouts come from another policy (the world's
solver, or a stronger checkpoint), started from the same prompt so that they fill exactly the
group's answer positions. Their rewards are normalised by source (``external.normalize=source``:
the baseline is the group's on-policy mean and std), and each of their tokens is importance-weighted
by pi_old(o_k | context) / mu_ext(o_k | context) through ``difrl.correct`` (TIS by default), with the
context the one the external policy committed o_k in (``trace_logp``) and mu_ext the probability it
recorded. The world (prompts, decode, eval) comes from ``difrl.worlds.masked``.

Several processes (DDP or FSDP2) split the samples as the flow trainer does (difrl/train/masked/plan.py): each
rolls out, scores and trains on a contiguous slice of the iteration's global sample list (groups may span
processes), rewards are gathered before the group advantages, and an optimizer update equals one process's
update of the same samples. Rollouts, log-probs without gradient and evaluation run the plain network; only the
trained forwards go through DDP's wrapper (its gradient all-reduce).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difrl.algos import k3_kl, ppo_clip_loss
from difrl.correct import METHODS as CORRECTORS
from difrl.discrete.estimators import remask, token_logp
from difrl.discrete.losses import trace_logp
from difrl.discrete.samplers import SAMPLERS, merge_rollouts
from difrl.rewards import score_all
from difrl.train.dist.sharded_step import clip_sharded_grad_norm_, grad_sync
from difrl.train.final_save import save_final
from difrl.train.flow.plan import thread_note
from difrl.train.iteration import close_iteration, gather_rewards, iteration_row, kept_samples, score_iteration
from difrl.train.masked.config import MaskedConfig
from difrl.train.masked.plan import (external_correction, gather_busiest, gather_max, local_device,
                                     plan_masked_iteration, processes, rollout_forwards, update_tokens)
from difrl.train.metrics import Metrics
from difrl.train.precision import refuse_fp16, trained_network
from difrl.train.reward_stage import (build_rewards, finite_mean_std, probe_batch, reward_stats,
                                     valid_group_advantages)
from difrl.train.run.progress import progress_bar
from difrl.train.run.rundir import finished
from difrl.train.run.state import trainable_params
from difrl.train.scaffold import (TIMING_KEYS, RatioCheckError, Run, check_ratio, claim_run_dir,  # noqa: F401
                                  clip_and_step, default_threads, make_optimizer, record_eval,
                                  reference_policy)
from difrl.utils.modules import use_module
from difrl.utils.rng import mix_seed
from difrl.worlds import build_masked_world


def train(cfg: MaskedConfig, out_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    # ======================================================================== setup
    refuse_fp16(cfg.model.dtype)  # fp16 training is refused (difrl/train/precision.py)
    # resume=: the run's config.yaml allows the changes; else the directory holds no run, or overwrite (rundir.py)
    run_dir = claim_run_dir(cfg, out_dir, overwrite, f"runs/{cfg.model.kind}")
    if (summary := finished(cfg, run_dir)) is not None:  # resume= of a finished run: nothing to do (rundir.py)
        return summary
    local_device()  # several processes on GPUs: this process's GPU is "cuda" while the world loads
    world = build_masked_world(cfg)
    policy = world.policy
    # one process, DDP or FSDP2 (accelerate launch); the split of the samples and the updates (masked/plan.py)
    accelerator, fsdp = processes(policy)
    world_size, rank, main, say = (accelerator.num_processes, accelerator.process_index, accelerator.is_main_process,
                                   accelerator.print)
    torch.set_num_threads(cfg.threads or default_threads(world_size))
    split = plan_masked_iteration(cfg, world_size, rank)  # a batch that does not split stops here (ConfigError)
    P, G, mu, ga = cfg.rollout.prompts_per_iter, cfg.rollout.group_size, cfg.train.inner_updates, cfg.train.grad_accum
    N, S, mbs, updates_per_inner = split.n_total, split.per_proc, split.micro, split.updates
    sampler = SAMPLERS[cfg.sampler.kind]
    ext = cfg.external
    K = ext.per_group if ext.source != "none" else 0
    say(f"difrl: masked GRPO ({cfg.estimator.kind}) on {cfg.model.kind}; {world_size} process(es) x "
        f"{torch.get_num_threads()} thread(s); {N} rollouts/iteration ({P} prompts x {G}"
        f"{f', {K} of each group from {ext.source}' if K else ''}), {S} per process, {cfg.sampler.kind} sampler at "
        f"T={cfg.sampler.temperature}; {mu} inner update(s) x {updates_per_inner} optimizer step(s) of {mbs} "
        f"sequence(s) x {ga} per process{' (micro_batch auto)' if cfg.train.micro_batch == 'auto' else ''}; "
        f"run dir {run_dir}")
    if note := thread_note(cfg.threads is not None):
        say(note)
    rewards, weights = build_rewards(cfg.reward, world.default_reward, probe_batch(world))  # a misfit stops here

    # external rollouts (ERILS): the world's solver or a frozen stronger checkpoint
    if ext.source == "solver":
        external_sample = world.external["solver"]
    elif ext.source == "checkpoint":
        ext_policy = world.load_policy(ext.path)
        ext_policy.module.requires_grad_(False).eval()
        ext_kw = cfg.sampler.sampler_kwargs(ext.temperature)
        external_sample = lambda tokens, cond, *, seeds: sampler(ext_policy, tokens, cond, seeds=seeds, **ext_kw)  # noqa: E731
    corrector = CORRECTORS[ext.correct.method]

    # LoRA or the reference, fp32 masters of a bf16 full fine-tune, FSDP2, the optimizer (setup_training)
    trainee = setup_training(cfg, policy, accelerator, fsdp)
    net, masters, fsdp, optimizer = trainee.net, trainee.masters, trainee.fsdp, trainee.optimizer
    run = Run.open(cfg, run_dir, net, optimizer, accelerator=accelerator, overwrite=overwrite)
    if run.state["eval_before"] is None:
        run.state["eval_before"] = run.state["last_eval"] = evaluate(world, policy, None, cfg, run, "before", 0)
        say("eval before: " + world.eval_line(run.state["eval_before"]))
        save_samples(world, policy, run_dir / "samples" / "iter-0000.png", main)

    bar = progress_bar(run.start, cfg.train.iterations, main)  # a tqdm bar, plain lines off a terminal
    done = run.start  # iterations completed
    for it in bar:
        t_iter = time.perf_counter()
        # ==================================================================== rollout
        # the iteration's global sample list (sample k belongs to group k // G); this process's slice of it
        k = split.rows
        batch = world.prompts(P, mix_seed(cfg.seed, it, 1)).repeat(G).select(k)
        all_k = torch.arange(N)
        all_groups, all_ext = it * P + all_k // G, (all_k % G) >= G - K  # the last K of every group are external
        group_ids, is_ext = all_groups[k], all_ext[k]
        seeds = torch.tensor([mix_seed(cfg.seed, it, 0, int(i)) for i in k], dtype=torch.int64)
        on_rows, ext_rows = (~is_ext).nonzero().flatten(), is_ext.nonzero().flatten()
        net.eval()
        parts = []
        with rollout_forwards(net, fsdp):  # FSDP: each process's own number of forwards (masked/plan.py)
            if len(on_rows):
                on = batch.select(on_rows)
                parts.append((on_rows, sampler(policy, on.tokens, on.cond, seeds=seeds[on_rows],
                                               **cfg.sampler.sampler_kwargs())))
            if K and len(ext_rows):
                ex = batch.select(ext_rows)
                parts.append((ext_rows, external_sample(ex.tokens, ex.cond, seeds=seeds[ext_rows])))
            out = merge_rollouts(S, parts)
            tokens, answer = out.tokens, out.gen_mask
            # pi_old of the external tokens in the context each was committed in
            lp_pi = (trace_logp(policy, tokens[ext_rows], answer[ext_rows], out.step[ext_rows], batch.select(ext_rows).cond)
                     if K and len(ext_rows) else torch.zeros(0, tokens.shape[1]))
        # the inner updates' masks (a function of seeds and n) and, before any update, the old-policy and
        # reference log-probs under exactly those masks
        r = old_log_probs(cfg, policy, trainee, it, batch, tokens, answer, seeds)
        # importance weights of the external tokens: pi_old / mu_ext, over every process's external rows
        is_weight, is_keep, correction = torch.ones(tokens.shape), torch.ones(tokens.shape, dtype=torch.bool), None
        if K:
            is_weight, is_keep, correction = external_correction(accelerator, corrector, ext.correct.options, lp_pi,
                                                                 out.logp[ext_rows], answer, is_ext, k)
        t_reward = time.perf_counter()

        # ==================================================================== reward
        # a failure names the prompts' own ids (the world's prompt table), not the iteration's group ids
        prompt_ids = batch.ids if batch.ids is not None else torch.full((S,), -1)
        # a failure or signal on any process stops all (difrl/train/iteration.py)
        scores, bad = score_iteration(lambda: score_all(rewards, world.decode(tokens), batch.texts, batch.metadata,
                                                        seeds, prompt_ids), S, cfg, run, it, say, accelerator)
        if run.agree_interrupted():  # SIGINT / SIGTERM on any process: this iteration is abandoned before its update
            break
        t_adv = time.perf_counter()

        # ==================================================================== advantage
        # over the whole iteration: every process's scores gathered (on the accelerator's device, collectives.py)
        rw = gather_rewards(cfg, run, it, accelerator, scores, bad, all_groups)  # [N] scores, failures
        all_scores = rw.scores
        baseline = ~all_ext if (K and ext.normalize == "source") else None
        adv, failed = valid_group_advantages(all_scores, weights, all_groups, rw.bad, cfg.advantage,
                                             cfg.reward.aggregate, baseline)
        keep_all = kept_samples(adv, failed, cfg.advantage.drop_zero_spread)
        advantages, keep = adv.advantages[k], keep_all[k]

        # ==================================================================== policy update
        net.train()
        m = Metrics()
        policy_update(cfg, policy, trainee, accelerator, split, r, advantages, keep, is_weight, is_keep, it, m)
        net.eval()
        t_log = time.perf_counter()

        # ==================================================================== log
        upd = m.result(accelerator)  # means over every process's micro-steps
        on_mask = ~all_ext
        stats = {**reward_stats(adv.reward[on_mask], {k: v[on_mask] for k, v in all_scores.items()}, weights,
                                all_groups[on_mask], cfg.advantage),
                 "adv_mean": float(adv.advantages.mean()), "adv_abs_max": float(adv.advantages.abs().max())}
        row = iteration_row(it, rw, adv, keep_all, failed, stats, {"nfe_rollout": gather_busiest(accelerator, out.nfe)},
                            upd, optimizer.param_groups[0]["lr"], (t_iter, t_reward, t_adv, t_log))
        if K:  # on-policy reward above, the external source's here
            row.update({"external/reward_mean": finite_mean_std(adv.reward[all_ext])[0],
                        "external/adv_mean": float(adv.advantages[all_ext].mean()),
                        **{f"external/{k}": float(v) for k, v in correction.diagnostics.items()}})
        # ==================================================================== checkpoint (and evaluation)
        done, _, stop = close_iteration(cfg, run, row, it, t_iter, bar, world, policy, None, evaluate, None, say)
        if stop:  # a signal during the update: stop after this iteration
            break
    bar.close()

    # ======================================================================== finish
    run.end_loop(done)  # the final checkpoint; after a signal: a checkpoint, then Interrupted
    eval_after = evaluate(world, policy, None, cfg, run, "after", done)
    say("eval after:  " + world.eval_line(eval_after))
    save_samples(world, policy, run_dir / "samples" / f"iter-{done:04d}.png", main)
    summary = {"eval_before": run.state["eval_before"], "eval_after": eval_after, "iterations": done,
               "stopped_early": None, "run_dir": str(run_dir), "headline": list(world.headline),
               "before_after": world.before_after_keys()}
    # the world's files (policy.safetensors, and under LoRA peft's lora/), gathered under FSDP (every process takes
    # part), in the dtypes they were loaded in: final_save.save_final, as `difrl export`
    save_final(world, policy, net, cfg.train.lora.enabled, run_dir, masters, main=main)
    run.finish(summary, world.headline)
    run.barrier()
    accelerator.end_training()
    return summary


# ---------------------------------------------------------------------------------- pieces of the loop


@dataclass
class MaskedTrainee:
    """What setup_training makes of a masked policy: the trained network (`net`: what rollouts, log-probs without
    gradient, evaluation and checkpoints run; `trained`: what the trained forwards run, DDP's wrapper or `net`), the
    frozen reference of full fine-tuning with a KL term, master weights, the FSDP settings (None: DDP or one
    process), the optimizer over `params`. difrl plan (difrl/train/planner/flow.py, plan_masked) runs the same function."""
    net: nn.Module
    trained: nn.Module
    reference: nn.Module | None
    masters: object
    fsdp: object
    params: dict
    optimizer: torch.optim.Optimizer


def setup_training(cfg: MaskedConfig, policy, accelerator, fsdp) -> MaskedTrainee:
    """LoRA or the frozen reference, fp32 master weights of a bf16 full fine-tune (bf16 compute), FSDP2 when `fsdp`
    (masked_plan.processes) asks for it, the optimizer; DDP's wrapper otherwise. Installs the plain network in
    `policy` (policy.module): only the trained forwards go through the wrapper (policy_update)."""
    net, reference, masters, fsdp = trained_network(policy, cfg.train.lora, cfg.seed, cfg.train.kl_beta > 0, fsdp,
                                                    accelerator.device)
    params = trainable_params(net)
    optimizer = make_optimizer(params, cfg.train)
    trained = net  # what the trained forwards run: DDP's wrapper (its gradient all-reduce), or the (sharded) network
    if fsdp is None:
        trained, optimizer = accelerator.prepare(net, optimizer)
    policy.module = net  # rollouts, log-probs without gradient, evaluation: the plain network, no DDP collective
    return MaskedTrainee(net, trained, reference, masters, fsdp, params, optimizer)


@dataclass
class UpdateBatch:
    """This process's S rollouts as the inner updates read them."""
    batch: object  # MaskedPrompts of the S rows (cond, prompt mask)
    tokens: torch.Tensor  # [S, L] long: the finished sequences
    answer: torch.Tensor  # [S, L] bool: the generated positions
    seeds: torch.Tensor  # [S] int64
    coupled_t: list[float]  # [mu] coupled-GRPO's t of each inner update
    masks: list  # [mu] Remask: inner update n's re-masked views (a function of seeds and n)
    logp_old: torch.Tensor  # [mu, S, L] fp32: the old policy's log-probs under those masks
    logp_ref: torch.Tensor | None  # [mu, S, L] fp32: the reference's (kl_beta > 0)


def old_log_probs(cfg: MaskedConfig, policy, tr: MaskedTrainee, it: int, batch, tokens: torch.Tensor,
                  answer: torch.Tensor, seeds: torch.Tensor) -> UpdateBatch:
    """The inner updates' masks and, before any update, the old-policy and reference log-probs under exactly those
    masks (one forward over the S rows per inner update, no gradient)."""
    mu, prompt = cfg.train.inner_updates, batch.prompt
    coupled_t = [cfg.estimator.t_low + (cfg.estimator.t_high - cfg.estimator.t_low)
                 * torch.rand((), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 9, n))).item()
                 for n in range(1, mu + 1)]
    masks = [remask(cfg, tokens, answer, prompt, seeds, n, coupled_t[n - 1], policy.mask_id) for n in range(1, mu + 1)]
    with torch.no_grad():
        logp_old = torch.stack([token_logp(cfg, policy, tokens, rm, batch.cond) for rm in masks])  # [mu, S, L]
        logp_ref = None
        if cfg.train.kl_beta > 0:
            with reference_policy(policy, tr.net, tr.reference):
                logp_ref = torch.stack([token_logp(cfg, policy, tokens, rm, batch.cond) for rm in masks])
    return UpdateBatch(batch, tokens, answer, seeds, coupled_t, masks, logp_old, logp_ref)


def policy_update(cfg: MaskedConfig, policy, tr: MaskedTrainee, accelerator, split, r: UpdateBatch,
                  advantages: torch.Tensor, keep: torch.Tensor, is_weight: torch.Tensor, is_keep: torch.Tensor,
                  it: int, m: Metrics, max_micro_steps: int | None = None) -> None:
    """The mu inner updates over this process's rollouts `r` (advantages, keep [S]; the external rows' importance
    weights is_weight, is_keep [S, L]): each pass shuffles the S rows into split.updates optimizer updates of
    train.grad_accum micro-batches of split.micro sequences; every token of an update weighs 1 / (the update's loss
    tokens over all processes). `max_micro_steps`: difrl plan's simulation runs that many micro-steps (the first
    ones, then the last, which steps the optimizer)."""
    mu, mbs, ga, world_size = cfg.train.inner_updates, split.micro, cfg.train.grad_accum, accelerator.num_processes
    batch, tokens, answer, prompt, seeds = r.batch, r.tokens, r.answer, r.batch.prompt, r.seeds
    steps = [(n, u, a) for n in range(1, mu + 1) for u in range(split.updates) for a in range(ga)]
    if max_micro_steps is not None and len(steps) > max_micro_steps:
        steps = steps[:max_micro_steps - 1] + steps[-1:]
    first, pass_n, update, perm, rows, denom = True, None, None, None, None, None
    with use_module(policy, tr.trained):  # the trained forwards through DDP's wrapper (no-op otherwise)
        for n, u, a in steps:
            rm_all = r.masks[n - 1]
            if pass_n != n:  # a new inner update: its mask statistics and its shuffle
                pass_n = n
                m.add("mask_frac", rm_all.masked.any(0).float(), answer.bool())
                m.add("prompt_masked_frac", rm_all.masked.any(0).float(), prompt)
                perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 4, n)))
            if update != (n, u):  # a new optimizer update
                update = (n, u)
                rows = perm[u * mbs * ga:(u + 1) * mbs * ga]
                loss_tokens = rm_all.loss_mask[rows] & keep[rows, None] & is_keep[rows]
                # fixed per optimizer update, over every process's part of it: 1 x 8 == 8 x 1 == 2 processes x 4
                denom = update_tokens(accelerator, int(loss_tokens.sum()), world_size)
            idx = rows[a * mbs:(a + 1) * mbs]
            sub = batch.select(idx)
            rm = remask(cfg, tokens[idx], answer[idx], prompt[idx], seeds[idx], n, r.coupled_t[n - 1], policy.mask_id)
            lm = rm.loss_mask & keep[idx, None] & is_keep[idx]
            with grad_sync(accelerator, tr.trained, tr.fsdp is not None, a == ga - 1):
                logp = token_logp(cfg, policy, tokens[idx], rm, sub.cond)
                if first and cfg.train.ratio_check:  # on-policy: same weights, same mask -> ratio 1
                    on = rm.loss_mask  # [b, L]; 0 - 0 outside it (a micro-batch may have no loss token)
                    m.add("first_step_max_abs_log_ratio", torch.tensor(check_ratio(  # all stop together
                        torch.where(on, logp, 0.0), torch.where(on, r.logp_old[n - 1, idx], 0.0),
                        cfg.train.ratio_tol, lambda x: gather_max(accelerator, x))))
                first = False
                pg, pm = ppo_clip_loss(logp, r.logp_old[n - 1, idx], advantages[idx], cfg.train.clip_low,
                                       cfg.train.clip_high)
                loss = (pg * is_weight[idx] * lm).sum() / denom
                if r.logp_ref is not None:
                    kl = k3_kl(logp, r.logp_ref[n - 1, idx])
                    loss = loss + cfg.train.kl_beta * (kl * lm).sum() / denom
                    m.add("kl", kl, lm)
                accelerator.backward(loss)
            m.add("policy_loss", pg, lm)
            for name in ("ratio", "approx_kl", "clip_high", "clip_low"):
                m.add(name, pm[name], lm)
            if a == ga - 1:
                norm = clip_and_step(tr.optimizer, tr.params, cfg.train.max_grad_norm,
                                     clip_sharded_grad_norm_ if tr.fsdp is not None else None)
                if norm is not None:
                    m.add("grad_norm", norm)


def evaluate(world, policy, ema, cfg: MaskedConfig, run: Run, tag: str, iteration: int) -> dict:
    """The world's fixed evaluation of the policy, recorded in run_dir/eval.json by the main process (the flow
    trainer's evaluate's signature, which close_iteration calls: the masked trainer keeps no EMA, `ema` is None)."""
    metrics = world.evaluate(policy)
    if run.is_main:
        record_eval(run.dir, tag, iteration, metrics)
    return metrics


def save_samples(world, policy, path: Path, main: bool) -> None:
    """The world's sample picture at `path`. Every process samples (under FSDP each forward is collective); the
    others write theirs to a temporary directory."""
    if world.save_samples is None:
        return
    if main:
        world.save_samples(policy, path)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        world.save_samples(policy, Path(tmp) / path.name)
