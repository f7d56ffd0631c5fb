"""Reward backpropagation for the flow recipe: DRaFT-K and ReFL (train.objective=draft / refl;
docs/guides/methods.md "Reward backpropagation"). The loop phase that replaces rollout -> reward -> advantage -> update for them.

    difrl train configs/digits_draft.yaml       # DRaFT-1: gradient through the last sampler step
    difrl train configs/digits_refl.yaml        # ReFL: one-step x0 prediction from a late step

Each optimizer update samples fresh trajectories (nothing is stored or reused: the loss needs the graph from the
parameters to the reward), train.grad_accum micro-batches of them, train.updates_per_epoch updates per iteration.
A micro-batch's loss is minus the sum of its samples' weighted differentiable rewards, divided by the samples of
its update, so accumulation 1x8 equals 8x1 (every sample's seed and prompt come from its global index, as in the
GRPO rollout; ReFL's stopping step is drawn once per update). Every process samples, scores and backpropagates
its own slice; DDP / FSDP average the gradients.
"""

from __future__ import annotations

import time

import torch

from difrl.rewards.grad import score_with_grad
from difrl.rollout_grad import refl_predict, rollout_last_k
from difrl.train.dist.sharded_step import grad_sync
from difrl.train.iteration import close_iteration, optimizer_step
from difrl.train.metrics import Metrics
from difrl.utils.rng import mix_seed

BACKPROP_OBJECTIVES = ("draft", "refl")


def backprop_sample(cfg, policy, prompts: list[str], seeds: torch.Tensor, sigmas: torch.Tensor,
                    refl_step: int | None) -> torch.Tensor:
    """The micro-batch's final latents [b, *latent] with their graph: DRaFT-K's last k steps, or ReFL's one-step x0
    prediction from step `refl_step`."""
    section = cfg.draft if cfg.train.objective == "draft" else cfg.refl
    kernel = "ode" if section.kernel == "ode" else cfg.sampler.kind
    kw = {} if kernel == "ode" else cfg.sampler.kernel_kwargs()
    if cfg.train.objective == "draft":
        return rollout_last_k(policy, prompts, seeds, sigmas, cfg.draft.k, kernel, kw, guidance=cfg.sampler.guidance)
    return refl_predict(policy, prompts, seeds, sigmas, refl_step, kernel, kw, guidance=cfg.sampler.guidance)


def backprop_micro_loss(cfg, policy, rewards: dict, weights: dict[str, float], prompts, metadata, seeds, sigmas,
                        refl_step, denom: int, m: Metrics) -> torch.Tensor:
    """-(sum over the micro-batch of sum_k w_k r_k(decode(x))) / denom, the rewards scored with their graph."""
    x = backprop_sample(cfg, policy, prompts, seeds, sigmas, refl_step)
    samples = policy.decode(x)
    total = 0.0
    for fn in rewards.values():
        w = weights[fn.key]
        if w == 0:
            continue
        r = score_with_grad(fn, samples, prompts, metadata)  # [b] on the samples' device
        m.add(f"reward/{fn.key}", r)
        total = total + w * r
    if not torch.isfinite(total.detach()).all():
        bad = (~torch.isfinite(total.detach())).nonzero().flatten().tolist()
        raise FloatingPointError(f"reward backpropagation: non-finite reward for samples with seeds "
                                 f"{seeds[bad].tolist()[:8]} (prompts {[prompts[i] for i in bad][:4]})")
    m.add("reward", total)
    m.add("policy_loss", -total)
    return -total.sum() / denom


def reward_backprop_loop(cfg, world, policy, tr, accelerator, run, bar, rewards: dict, weights: dict[str, float],
                         sigmas: torch.Tensor, per_proc: int, evaluate, should_stop) -> tuple[int, str | None]:
    """The iterations run.start .. train.iterations of a draft / refl run (eval, log, checkpoint as the GRPO loop
    does; `evaluate` is the recipe's, `should_stop` the world's stop rule or None). Returns (iterations done, the
    early-stop reason or None)."""
    for name, fn in rewards.items():  # reward.weights=null: the world's own reward, unchecked by the config
        if weights[fn.key] != 0 and not fn.differentiable:
            from difrl.config import ConfigError

            raise ConfigError(f"config key 'reward.weights' (null: this world's own reward {name!r}) names a reward that "
                              f"is not differentiable; train.objective={cfg.train.objective} backpropagates the reward: "
                              "name a differentiable one in reward.weights", "reward.weights")
    rank, G = accelerator.process_index, cfg.rollout.group_size
    U, ga = cfg.train.updates_per_epoch or 1, cfg.train.grad_accum
    s = per_proc // (U * ga)  # samples per micro-batch (the config checks that it divides)
    what = (f"gradient through the last {cfg.draft.k} step(s)" if cfg.train.objective == "draft" else
            "one-step x0 prediction from a step in [{}, {}]".format(*cfg.refl.steps(cfg.sampler.num_steps)))
    accelerator.print(f"difrl: train.objective={cfg.train.objective}: {what} of {cfg.sampler.num_steps}; {U} update(s) "
                      f"per iteration of {ga} micro-batch(es) of {s} fresh sample(s) per process (the banner's trained "
                      "steps and transitions above do not apply)")
    stopped, done = None, run.start
    for it in bar:
        t_iter = time.perf_counter()
        gen = torch.Generator().manual_seed(mix_seed(cfg.seed, it, 1))  # the prompts, as the GRPO rollout picks them
        P = len(world.prompts)
        order = torch.cat([torch.randperm(P, generator=gen) for _ in range(-(-cfg.rollout.prompts_per_iter // P))])
        group_prompt = order[:cfg.rollout.prompts_per_iter]
        tr.unwrapped.train()
        m = Metrics()
        for u in range(U):
            first, last = cfg.refl.steps(cfg.sampler.num_steps)
            refl_step = int(torch.randint(first, last + 1, (1,),
                                          generator=torch.Generator().manual_seed(mix_seed(cfg.seed, it, 5, u))))
            for mb in range(ga):
                lo = rank * per_proc + (u * ga + mb) * s
                k = torch.arange(lo, lo + s)  # global sample indices
                prompt_ids = group_prompt[k // G].tolist()
                prompts, metadata = [world.prompts[i] for i in prompt_ids], [world.metadata(i) for i in prompt_ids]
                seeds = torch.tensor([mix_seed(cfg.seed, it, 0, int(i)) for i in k])
                sync = mb == ga - 1
                with grad_sync(accelerator, tr.net, tr.fsdp is not None, sync):
                    loss = backprop_micro_loss(cfg, policy, rewards, weights, prompts, metadata, seeds, sigmas,
                                               refl_step, s * ga, m)
                    accelerator.backward(loss)
            optimizer_step(cfg, tr, accelerator, m)  # clip, step, EMA
        tr.unwrapped.eval()
        upd = m.result(accelerator)
        row = {"iteration": it + 1, "reward_mean": upd.pop("reward"), **upd, "loss": upd["policy_loss"],
               "trained_samples": per_proc * accelerator.num_processes, "lr": tr.optimizer.param_groups[0]["lr"]}
        row["seconds_update"] = time.perf_counter() - t_iter
        done, stopped, stop = close_iteration(cfg, run, row, it, t_iter, bar, world, policy, tr.ema, evaluate,
                                              should_stop, accelerator.print)
        if stop:
            break
    return done, stopped

