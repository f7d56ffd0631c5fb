"""What one flow iteration does, checked before the first one: sizes per process, trained steps, micro-batching.

    n_total, per_proc, T, schedule, micro = plan(cfg, world, world_size, run_dir, print)   # prints the banner
    sde_mask, train_mask, window_start = step_masks(cfg, iteration, num_samples)

train.micro_batch counts transitions (sample-steps) whatever the rollout kind (micro_batching), so switching
rollout.kind between flat, tree and solrl keeps the work per forward/backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from difrl.branching import num_trained_edges
from difrl.samplers import step_masks as sampler_step_masks
from difrl.train.config import FlowConfig
from difrl.train.objectives import nft_sigmas


class MicroBatching(NamedTuple):
    """How train.micro_batch (transitions per forward/backward, whatever the rollout kind) becomes records."""
    records: int  # records per micro-batch
    split_samples: bool  # flat / Sol-RL samples split into records of one transition (micro_batch % T != 0)
    summary: str  # for the banner


def micro_batching(cfg: FlowConfig, T: int, tree_mode: bool) -> MicroBatching:
    """One unit in every rollout mode: train.micro_batch counts transitions (sample-steps), so switching
    rollout.kind between flat, tree and solrl keeps the work per backward (specs/gpu-regime.md: with the unit
    "records" a tree's 1-step edges ran 3.3x slower than flat's whole samples). A tree's record is one edge; a
    flat sample holds its T trained transitions and is kept whole when micro_batch is a multiple of T, else
    split into transitions (per-step losses only: a sequence-level loss needs every step of a sample together)."""
    mb = cfg.train.micro_batch
    if tree_mode:
        return MicroBatching(mb, False, f"{mb} transitions (tree edges)")
    if mb % T == 0:
        return MicroBatching(mb // T, False, f"{mb} transitions ({mb // T} sample(s) x {T} steps)")
    if cfg.train.objective == "grpo" and cfg.train.policy_loss == "ppo_clip":
        return MicroBatching(mb, True, f"{mb} transitions (samples of {T} steps split into single-step records)")
    what = "DiffusionNFT's loss" if cfg.train.objective == "nft" else f"train.policy_loss={cfg.train.policy_loss}"
    lower, upper = max(T, mb // T * T), -(-mb // T) * T
    raise ValueError(f"train.micro_batch={mb} transitions is not a multiple of the {T} trained step(s) per sample, and "
                     f"{what} needs each sample's steps in one micro-batch: use {lower}" + (f" or {upper}" if upper != lower else ""))


def plan(cfg: FlowConfig, world, world_size: int, run_dir: Path, say) -> tuple[int, int, int, object, MicroBatching]:
    """Check that an iteration splits over the processes and into optimizer updates, and say what one does.
    Returns (samples per iteration, per process, trained steps per sample T (1 for trees: an edge per record),
    the tree's BranchSchedule or None, the micro-batching)."""
    n_total = cfg.rollout.prompts_per_iter * cfg.rollout.group_size
    per_proc, per_update = n_total // world_size, cfg.train.micro_batch * cfg.train.grad_accum  # per_update: transitions
    tree_mode = cfg.rollout.kind == "tree"
    if n_total % world_size:
        raise ValueError(f"{n_total} samples per iteration (rollout.prompts_per_iter x rollout.group_size) do not "
                         f"split over {world_size} processes")
    if tree_mode and cfg.rollout.prompts_per_iter % world_size:
        raise ValueError(f"{cfg.rollout.prompts_per_iter} trees per iteration (rollout.prompts_per_iter) do not split "
                         f"over {world_size} processes")
    if cfg.rollout.kind == "solrl" and (cfg.rollout.prompts_per_iter * cfg.solrl.candidates) % world_size:
        raise ValueError(f"{cfg.rollout.prompts_per_iter * cfg.solrl.candidates} Sol-RL candidates per iteration do not "
                         f"split over {world_size} processes")
    sde_mask0, train_mask0, _ = step_masks(cfg, 0, 1)
    T = int(train_mask0.sum())  # trained transitions per sample (GRPO) ...
    if cfg.train.objective == "nft":  # ... or sigmas (NFT)
        T = len(nft_sigmas(cfg, world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)))
    schedule, what = None, f"step(s) of {cfg.sampler.num_steps} per sample ({cfg.steps.mode}); "
    if cfg.train.objective == "nft":
        what = f"sigma(s) of {cfg.sampler.num_steps} per sample (DiffusionNFT); "
    if tree_mode:  # ... or one per tree edge (a record of its own)
        schedule, T = cfg.tree.schedule(cfg.sampler.num_steps), 1
        edges = num_trained_edges(schedule, cfg.sampler.num_steps, sde_mask0)
        updates = cfg.train.inner_epochs * -(-edges * cfg.rollout.prompts_per_iter // world_size // per_update)
        what = (f"step per record, SDE steps {cfg.steps.mode} + splits; trees: splits at {list(schedule.split_steps)} "
                f"x{schedule.factor}, {edges} SDE edges per tree before pruning (records of 1 step); ")
    micro = micro_batching(cfg, T, tree_mode)
    if not tree_mode:  # (tree edges: a last, smaller update takes the remainder)
        if (per_proc * T) % per_update:
            raise ValueError(f"each process has {per_proc} samples x {T} trained steps = {per_proc * T} transitions per "
                             f"iteration, not a multiple of train.micro_batch x train.grad_accum = {cfg.train.micro_batch}"
                             f" x {cfg.train.grad_accum} = {per_update} (train.micro_batch counts transitions)")
        updates = cfg.train.inner_epochs * per_proc * T // per_update
    if cfg.rollout.kind == "solrl":
        what += (f"Sol-RL: {cfg.solrl.candidates} candidates per prompt in {cfg.solrl.preview_steps} steps, "
                 f"{cfg.solrl.select}; ")
    say(f"difrl: {world_size} process(es) x {torch.get_num_threads()} thread(s); {n_total} samples/iteration "
        f"({cfg.rollout.prompts_per_iter} groups of {cfg.rollout.group_size}), {per_proc} per process; {T} trained "
        f"{what}{updates} optimizer update(s) per rollout ({cfg.train.inner_epochs} epoch(s) x "
        f"{updates // cfg.train.inner_epochs} of {cfg.train.grad_accum} accumulated micro-batch(es)); micro-batch: "
        f"{micro.summary} per forward/backward; run dir {run_dir}")
    return n_total, per_proc, T, schedule, micro


def step_masks(cfg: FlowConfig, iteration: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(sde_mask [N], train_mask [B, N], window start or None) for one iteration (difrl.samplers.step_masks)."""
    n = cfg.sampler.num_steps
    if cfg.train.objective == "nft":  # DiffusionNFT: deterministic rollouts, nothing stored but the clean sample
        none = torch.zeros(n, dtype=torch.bool)
        return none, none.expand(num_samples, n), None
    return sampler_step_masks(cfg.steps, n, cfg.seed, iteration, num_samples)
