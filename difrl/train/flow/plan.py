"""What one flow iteration does, checked before the first one: sizes per process, trained steps, micro-batching.

    n_total, per_proc, T, schedule, micro = plan_flow_iteration(cfg, world, world_size, run_dir, print)  # prints the banner
    sde_mask, train_mask, window_start = step_masks(cfg, iteration, num_samples)
    forward_counts(cfg, world_size, schedule, sde_mask)    # per process: its policy forwards in an iteration

Three numbers cut a process's rollout into optimizer updates: train.micro_batch (the work per forward/backward,
in transitions, i.e. sample-steps, whatever the rollout kind: switching rollout.kind between flat, tree and solrl
keeps it), train.grad_accum (micro-batches per update) and train.updates_per_epoch (updates per pass over the
rollout). For one process with S samples of T trained steps each

    micro_batch x grad_accum x updates_per_epoch = S x T      (a tree: its trained edges instead of S x T)

(a tree's trained edges are those its depth and width pruning keep: the edges it trains, not the ones it samples).

so two of them fix the third. ``train.micro_batch=auto`` (micro_batching) fixes the two that carry the learning
meaning, updates_per_epoch (default 1: one on-policy update per rollout) and grad_accum, and derives the micro-batch
in whole samples, S / (updates_per_epoch x grad_accum) samples of T steps. A window, DiffusionNFT's sigmas or a
DanceGRPO subset changes T and the micro-batch follows, so the updates per rollout and the samples per update stay
what the config says; on P processes S is 1/P of the samples, the micro-batch shrinks with it and an update still
covers all of them (no grad_accum to halve). Memory per forward/backward is what moves: the banner prints the
chosen size. An explicit micro_batch fixes the work per backward instead (on GPUs, memory); the updates then
follow from it, a value that does not divide is refused with the nearest ones that do (micro_batch and
grad_accum; the solver both trainers share: difrl/train/micro_batches.py), and a config that also names updates_per_epoch must agree with it (the FLUX / SD3 / Wan configs are
sized for a number of GPUs: on another, the error gives the grad_accum that keeps their updates per rollout).

Every process runs the same number of policy forwards (docs/architecture.md, Many processes): under FSDP2 each forward
all-gathers every block, and a process that runs one forward more than another waits for it forever
(docs/reference/specs/scale.md §2 "Uneven forward counts"; under DDP the backward's all-reduce does the same). The split
makes it so: every process gets the same number of samples (flat, Sol-RL's stage 2), of candidates (Sol-RL's stage 1)
and of whole trees (BranchGRPO), and a tree's pruning (depth: by the edge's depth and the iteration; width: a number of
tail edges fixed by the tree's shape and tree.width_ratio, whichever edges the advantages pick) keeps the same number of
edges in every tree of an iteration. `forward_counts` counts each process's forwards from those sizes (rollout
chunks, candidates and their batches, tree steps' live nodes, trained edges after pruning for every pruned-depth set
the run reaches) and `plan_flow_iteration` refuses a config whose counts differ (ConfigError) before anything runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from difrl.algos.tree import depth_prune, depth_pruning_set, width_prune
from difrl.branching import build_tree, effective_sde_mask, num_trained_edges
from difrl.config import ConfigError
from difrl.samplers import step_masks as sampler_step_masks
from difrl.train.config import FlowConfig
from difrl.train.flow.matching_objectives import MATCHING_OBJECTIVES, trained_sigmas
from difrl.train.micro_batches import auto_options, divisors, explicit_options, nearest, own_updates, updates_options


class MicroBatching(NamedTuple):
    """How train.micro_batch (transitions per forward/backward, whatever the rollout kind) becomes records."""
    transitions: int  # train.micro_batch resolved (auto: whole samples x T, or tree edges)
    records: int  # records per micro-batch
    split_samples: bool  # flat / Sol-RL samples split into records of one transition (micro_batch % T != 0)
    updates: int  # optimizer updates per pass over the rollout (a tree's after pruning can be fewer)
    summary: str  # for the banner


def micro_batching(cfg: FlowConfig, T: int, tree_mode: bool, n_records: int) -> MicroBatching:
    """One unit in every rollout mode: train.micro_batch counts transitions (sample-steps), so switching
    rollout.kind between flat, tree and solrl keeps the work per backward (docs/reference/specs/gpu-regime.md: with the
    unit "records" a tree's 1-step edges ran 3.3x slower than flat's whole samples). A tree's record is one edge; a
    flat sample holds its T trained transitions and is kept whole when micro_batch is a multiple of T, else
    split into transitions (per-step losses only: a sequence-level loss needs every step of a sample together).
    `n_records`: this process's records per pass (samples; a tree's SDE edges kept by its pruning, the most over
    the pruned-depth sets the run reaches). auto: the module docstring."""
    mb, ga, want = cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.updates_per_epoch
    if mb == "auto":
        U = want or 1
        if tree_mode:  # edges per micro-batch; a last, smaller update takes the remainder
            per = -(-n_records // (U * ga))
            return MicroBatching(per, per, False, -(-n_records // (per * ga)),
                                 f"auto = {per} transitions (tree edges: {n_records} per process trained in "
                                 f"{U} update(s) x {ga} micro-batch(es))")
        if n_records % (U * ga):
            raise ValueError(_auto_problem(n_records, U, ga, want))
        s = n_records // (U * ga)
        return MicroBatching(s * T, s, False, U, f"auto = {s} sample(s) x {T} steps = {s * T} transitions")
    if not tree_mode and ((n_records * T) % (mb * ga) or (mb % T and not _splits(cfg))):
        raise ValueError(_explicit_problem(cfg, T, n_records))
    if want is not None and (problem := _updates_problem(cfg, T, tree_mode, n_records, want)):
        raise ValueError(problem)
    if tree_mode:
        return MicroBatching(mb, mb, False, -(-n_records // (mb * ga)), f"{mb} transitions (tree edges)")
    updates = n_records * T // (mb * ga)
    if mb % T == 0:
        return MicroBatching(mb, mb // T, False, updates, f"{mb} transitions ({mb // T} sample(s) x {T} steps)")
    return MicroBatching(mb, mb, True, updates, f"{mb} transitions (samples of {T} steps split into single-step records)")


def _splits(cfg: FlowConfig) -> bool:
    """May a flat sample's T transitions go into different micro-batches? (PPO-clip's loss is per step.)"""
    return cfg.train.objective in ("grpo", "dppo") and cfg.train.policy_loss == "ppo_clip"


def _auto_choice(n_samples: int, T: int, U: int, ga: int) -> str:
    """'train.micro_batch=auto (...)' when auto divides this rollout, else ''."""
    if n_samples % (U * ga):
        return ""
    s = n_samples // (U * ga)
    return f"train.micro_batch=auto ({s} sample(s) x {T} steps, {U} update(s) of {ga} micro-batch(es) per pass)"


def _explicit_problem(cfg: FlowConfig, T: int, n_samples: int) -> str:
    """An explicit micro_batch that does not cut this rollout: what is wrong, and the nearest values that work."""
    mb, ga, want, X = cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.updates_per_epoch, n_samples * T
    whole = not _splits(cfg)
    options = explicit_options(X, mb, ga, want, _auto_choice(n_samples, T, want or 1, ga), T if whole else 1)
    if mb % T and whole:
        what = ("DiffusionNFT's loss" if cfg.train.objective == "nft" else f"train.policy_loss={cfg.train.policy_loss}"
                if cfg.train.objective in ("grpo", "dppo") else f"train.objective={cfg.train.objective}'s loss")
        head = (f"train.micro_batch={mb} transitions is not a multiple of the {T} trained step(s) per sample, and "
                f"{what} needs each sample's steps in one micro-batch")
    else:
        head = (f"each process has {n_samples} samples x {T} trained steps = {X} transitions per iteration, not a "
                f"multiple of train.micro_batch x train.grad_accum = {mb} x {ga} = {mb * ga} (train.micro_batch "
                f"counts transitions)")
    return head + ": use " + ", or ".join(options)


def _auto_problem(n_samples: int, U: int, ga: int, want: int | None) -> str:
    options = auto_options(n_samples, U, ga)
    updates = f"train.updates_per_epoch x train.grad_accum = {U} x {ga}" if want else f"train.grad_accum = {ga}"
    return (f"train.micro_batch=auto takes whole samples, but each process's {n_samples} samples do not split into "
            f"{updates} micro-batches: use " + (", or ".join(options) or "an explicit train.micro_batch"))


def _updates_problem(cfg: FlowConfig, T: int, tree_mode: bool, n_records: int, want: int) -> str:
    """An explicit micro_batch that gives another number of updates per pass than train.updates_per_epoch says."""
    mb, ga = cfg.train.micro_batch, cfg.train.grad_accum
    X = n_records * T  # transitions per pass (a tree: edges)
    got = -(-X // (mb * ga)) if tree_mode else X // (mb * ga)  # (flat: divides, checked before)
    if got == want:
        return ""
    options = [] if tree_mode else updates_options(X, mb, ga, want, 1 if _splits(cfg) else T)
    if auto := ("train.micro_batch=auto" if tree_mode else _auto_choice(n_records, T, want, ga)):
        options.append(auto)
    return (f"train.micro_batch x train.grad_accum = {mb} x {ga} = {mb * ga} transitions per update make {got} "
            f"optimizer update(s) per pass over each process's {X} "
            f"{'edges trained after pruning' if tree_mode else 'transitions'}, but "
            f"train.updates_per_epoch={want}: use " + ", or ".join(options + [own_updates(got)]))


def thread_note(threads_set: bool) -> str:
    """A warning when torch was given several threads per process on cores that other processes already keep busy
    (the 1-minute load average before this run starts is at least 1, and with this run's threads more than the
    cores this process may use): every parallel torch op then waits for its slowest thread. Only a note: choosing
    the thread count from the load would make a run's numbers depend on what else ran (float sums differ). docs/guides/scale.md 'Threads' has the measurement."""
    n = torch.get_num_threads()
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ""
    if threads_set or n == 1 or load < 1 or load + n <= cores:
        return ""
    return (f"difrl: the load average is {load:.1f} on the {cores} core(s) this process may use: other processes are "
            f"running, and {n} threads per process can be many times slower than threads=1 (docs/guides/scale.md, 'Threads')")


def plan_flow_iteration(cfg: FlowConfig, world, world_size: int, run_dir: Path,
                        say) -> tuple[int, int, int, object, MicroBatching]:
    """Check that an iteration splits over the processes and into optimizer updates, and say what one does.
    Returns (samples per iteration, per process, trained steps per sample T (1 for trees: an edge per record),
    the tree's BranchSchedule or None, the micro-batching)."""
    n_total = cfg.rollout.prompts_per_iter * cfg.rollout.group_size
    per_proc = n_total // world_size
    tree_mode = cfg.rollout.kind == "tree"
    sde_mask0, train_mask0, _ = step_masks(cfg, 0, 1)
    refuse_uneven_forwards(cfg, world_size, cfg.tree.schedule(cfg.sampler.num_steps) if tree_mode else None, sde_mask0)
    if tree_mode:
        refuse_split_forests(cfg, world_size)
    T = int(train_mask0.sum())  # trained transitions per sample (GRPO, DPPO) ...
    noised = (trained_sigmas(cfg, world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift))  # the world only if needed:
              if cfg.train.objective in ("nft", *MATCHING_OBJECTIVES) else None)      # refusals come before it
    if noised is not None:  # ... or sigmas of the re-noised clean sample (NFT, AWM, DPO, DGPO)
        T = len(noised)
    schedule, what, n_records = None, f"step(s) of {cfg.sampler.num_steps} per sample ({cfg.steps.mode}); ", per_proc
    if noised is not None:
        what = f"sigma(s) of {cfg.sampler.num_steps} per sample (train.objective={cfg.train.objective}); "
    if tree_mode:  # ... or one per tree edge (a record of its own)
        schedule, T = cfg.tree.schedule(cfg.sampler.num_steps), 1
        edges = num_trained_edges(schedule, cfg.sampler.num_steps, sde_mask0)
        kept = _tree_edges_kept(cfg, schedule, sde_mask0)  # per tree, for each pruned-depth set the run reaches
        n_records = max(kept) * cfg.tree.roots * cfg.rollout.prompts_per_iter // world_size  # the trained ones
        what = (f"step per record, SDE steps {cfg.steps.mode} + splits; trees: {cfg.tree.roots} per prompt, splits at "
                f"{list(schedule.split_steps)} x{schedule.factor}, {edges} SDE edges per tree"
                + (f", {'/'.join(map(str, sorted(set(kept))))} trained after pruning" if kept != [edges] else "")
                + " (records of 1 step); ")
    micro = micro_batching(cfg, T, tree_mode, n_records)
    updates = cfg.train.inner_epochs * micro.updates
    if cfg.rollout.kind == "solrl":
        what += (f"Sol-RL: {cfg.solrl.candidates} candidates per prompt in {cfg.solrl.preview_steps} steps, "
                 f"{cfg.solrl.select}; ")
    say(f"difrl: {world_size} process(es) x {torch.get_num_threads()} thread(s); {n_total} samples/iteration "
        f"({cfg.rollout.prompts_per_iter} groups of {cfg.rollout.group_size}), {per_proc} per process; {T} trained "
        f"{what}{updates} optimizer update(s) per rollout ({cfg.train.inner_epochs} epoch(s) x "
        f"{micro.updates} of {cfg.train.grad_accum} accumulated micro-batch(es)); micro-batch: "
        f"{micro.summary} per forward/backward; run dir {run_dir}")
    if note := thread_note(cfg.threads is not None):
        say(note)
    return n_total, per_proc, T, schedule, micro


def _split(n: int, world_size: int) -> list[int]:
    """How n items would fall on the processes in contiguous slices (torch.tensor_split: the first take one more)."""
    return [n // world_size + (r < n % world_size) for r in range(world_size)]


def _tree_edges_kept(cfg: FlowConfig, schedule, sde_mask: torch.Tensor) -> list[int]:
    """Trained edges of one tree after pruning, for every pruned-depth set the run reaches (one per iteration
    while tree.depth_slide_every moves it). Width pruning keeps a number fixed by the tree's shape; the
    advantages (here all 0) only choose which (difrl.algos.tree.width_prune)."""
    tc, N = cfg.tree, cfg.sampler.num_steps
    tree = build_tree(schedule, N, 1, sde_mask)
    edges = effective_sde_mask(N, schedule, sde_mask)[tree.edge_step].nonzero().flatten()  # the rollout's SDE edges
    out = []
    stop = max(schedule.split_steps, default=0) if tc.depth_stop is None else tc.depth_stop
    sets = {frozenset(depth_pruning_set(tc.depth_prune, it, tc.depth_slide_every, stop))
            for it in range(cfg.train.iterations)} if tc.depth_prune else {frozenset()}
    for depths in sorted(sets, key=sorted):
        sel = depth_prune(tree, edges, set(depths)) if depths else torch.ones(len(edges), dtype=torch.bool)
        if tc.width_prune != "none":
            sel = width_prune(tree, edges, torch.zeros(len(edges)), tc.width_prune, tc.width_ratio, mask=sel)
        out.append(int(sel.sum()))
    return out


def forward_counts(cfg: FlowConfig, world_size: int, schedule=None, sde_mask: torch.Tensor | None = None) -> list[dict]:
    """Per process (if the iteration were cut into contiguous slices, as the trainer cuts it): the policy forwards
    of one iteration's rollout stages and of one pass of training (per micro-batch one forward, times the
    iteration's constant factors: steps of a record, KL's reference, inner epochs). `schedule`: the tree's
    BranchSchedule (rollout.kind=tree), else None; `sde_mask` [num_steps] of iteration 0."""
    r, N = cfg.rollout, cfg.sampler.num_steps
    rb = cfg.sampler.rollout_batch
    chunks = lambda n, b: -(-n // b) if b else int(n > 0)  # noqa: E731  forward batches over n rows
    out = []
    for rank in range(world_size):
        counts = {}
        if schedule is not None:
            trees = _split(r.prompts_per_iter * cfg.tree.roots, world_size)[rank]  # tree.roots trees per prompt
            counts["trees"] = trees  # whole trees per process (the trainer cuts the leaves in tree-sized slices)
            offsets = build_tree(schedule, N, 1, sde_mask).depth_offsets  # live nodes of one tree per step
            counts["tree rollout"] = sum(chunks(trees * int(offsets[i + 1] - offsets[i]), rb) for i in range(N))
            mb, kept = cfg.train.micro_batch, _tree_edges_kept(cfg, schedule, sde_mask)
            if not isinstance(mb, int):  # auto: micro_batching's edges per micro-batch (sized on the kept edges)
                U = (cfg.train.updates_per_epoch or 1) * cfg.train.grad_accum
                mb = max(1, -(-trees * max(kept) // U))
            counts["trained-edge micro-batches"] = [chunks(trees * k, mb) for k in kept]
        else:
            samples = _split(r.prompts_per_iter * r.group_size, world_size)[rank]
            counts["rollout"] = N * sum(chunks(len(range(*sl.indices(samples))), rb) for sl in _chunk_slices(samples, r.chunks))
            counts["samples trained"] = samples
        if r.kind == "solrl":
            cand = _split(r.prompts_per_iter * cfg.solrl.candidates, world_size)[rank]
            counts["Sol-RL candidates"] = cand  # their rewards are gathered: equal shapes too
            counts["Sol-RL candidate forwards"] = cfg.solrl.preview_steps * chunks(cand, cfg.solrl.batch)
        out.append(counts)
    return out


def _chunk_slices(n: int, chunks: int) -> list[slice]:
    from difrl.rollout import chunk_slices

    return chunk_slices(n, chunks) if n else []


def refuse_uneven_forwards(cfg: FlowConfig, world_size: int, schedule, sde_mask: torch.Tensor) -> None:
    """ConfigError, before anything runs, when the processes would run different numbers of policy forwards in an
    iteration (module docstring): the counts per process and the keys to change."""
    if world_size == 1:
        return
    counts = forward_counts(cfg, world_size, schedule, sde_mask)
    uneven = [k for k in counts[0] if any(c[k] != counts[0][k] for c in counts)]
    if not uneven:
        return
    r = cfg.rollout
    trees = (f"{r.prompts_per_iter * cfg.tree.roots} trees (rollout.prompts_per_iter x tree.roots)" if cfg.tree.roots > 1
             else f"{r.prompts_per_iter} trees (rollout.prompts_per_iter)")
    what = {"trees": trees, "tree rollout": trees, "trained-edge micro-batches": trees,
            "rollout": f"{r.prompts_per_iter * r.group_size} samples (rollout.prompts_per_iter x rollout.group_size)",
            "samples trained": f"{r.prompts_per_iter * r.group_size} samples (rollout.prompts_per_iter x rollout.group_size)",
            "Sol-RL candidates": f"{r.prompts_per_iter * cfg.solrl.candidates} Sol-RL candidates "
                                 "(rollout.prompts_per_iter x solrl.candidates)"}
    what["Sol-RL candidate forwards"] = what["Sol-RL candidates"]
    what = what[uneven[0]]
    per = "; ".join(f"process {i}: " + ", ".join(f"{k} {c[k]}" for k in uneven) for i, c in enumerate(counts))
    key = "solrl.candidates" if uneven[0].startswith("Sol-RL") else "rollout.prompts_per_iter"
    raise ConfigError(f"{what} per iteration do not split evenly over {world_size} processes, so they would run "
                      f"different numbers of policy forwards ({per}). Every process must run the same forwards: under "
                      "FSDP each forward all-gathers the sharded blocks and a process with one forward more waits for "
                      "the others forever (under DDP the backward's all-reduce does). Use a multiple of "
                      f"{world_size} for {what.split('(')[1].rstrip(')')}", key)


def refuse_split_forests(cfg: FlowConfig, world_size: int) -> None:
    """ConfigError, before anything loads, when a prompt's tree.roots trees (one group: difrl.algos.tree.
    depthwise_advantages normalises over them, per depth, on the process that holds them) would fall on different
    processes. The trees split in equal contiguous slices of P x roots / world_size, so every slice holds whole
    groups exactly when world_size divides P = rollout.prompts_per_iter, whatever tree.roots is."""
    P, R = cfg.rollout.prompts_per_iter, cfg.tree.roots
    if R == 1 or P % world_size == 0:  # one tree per group: an uneven split is refuse_uneven_forwards'
        return
    per = P * R / world_size
    prompts = nearest([p for p in range(world_size, P + world_size + 1, world_size)], P)
    procs = divisors(P)
    procs_text = " or ".join(map(str, procs)) if len(procs) < 3 else ", ".join(map(str, procs[:-1])) + f" or {procs[-1]}"
    raise ConfigError(f"a forest of tree.roots={R} trees per prompt is one group (its advantages are normalised over "
                      f"its trees, per depth, on one process), but rollout.prompts_per_iter={P} prompts x {R} trees "
                      f"over {world_size} processes give {per:g} tree(s) per process, so a prompt's trees would be "
                      f"split over processes. Each process needs whole forests: use rollout.prompts_per_iter="
                      f"{' or '.join(map(str, prompts))} (a multiple of the {world_size} processes), or {procs_text} "
                      f"processes (dividing rollout.prompts_per_iter={P}); tree.roots does not change this",
                      "rollout.prompts_per_iter")


def step_masks(cfg: FlowConfig, iteration: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(sde_mask [N], train_mask [B, N], window start or None) for one iteration (difrl.samplers.step_masks)."""
    n = cfg.sampler.num_steps
    if cfg.train.objective in ("nft", "awm", "dpo", "dgpo"):  # likelihood-free: nothing stored but the clean sample
        none = torch.zeros(n, dtype=torch.bool)
        if cfg.train.objective != "nft" and cfg.matching.rollout == "sde":  # SDE exploration, no trained transition
            return sampler_step_masks(cfg.steps, n, cfg.seed, iteration, 1)[0], none.expand(num_samples, n), None
        return none, none.expand(num_samples, n), None
    return sampler_step_masks(cfg.steps, n, cfg.seed, iteration, num_samples)
