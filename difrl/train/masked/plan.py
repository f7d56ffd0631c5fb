"""How a masked iteration splits over processes and into optimizer updates, checked before the first one.

    accelerator, fsdp = processes(policy)             # 1 process, DDP, or FSDP2 (accelerate launch --config_file ...)
    p = plan_masked_iteration(cfg, accelerator.num_processes, accelerator.process_index)  # ConfigError: no split
    with rollout_forwards(net, fsdp): out = sampler(...)   # FSDP: any number of forwards per process
    nfe = gather_busiest(accelerator, out.nfe)         # the rollout's forward passes on the busiest process

Data parallelism as in the flow trainer (difrl/train/flow/trainer.py): the sample list of an iteration is global (sample k
belongs to group k // group_size, its seed is mix_seed(seed, iteration, 0, k)), each process rolls out, scores and
trains on the contiguous slice `p.rows` of it (groups may span processes), and the rewards are gathered before the
group advantages are computed. Every per-sample draw (rollout tokens, re-masks) is a function of the sample's seed
(difrl.discrete), so P processes sample exactly what one process samples.

Micro-batches follow the flow trainer's keys (docs/guides/scale.md "Micro-batches"; difrl/train/flow/plan.py) with one unit, the
sequence: for S = samples per process,

    train.micro_batch x train.grad_accum x train.updates_per_epoch = S       (per inner update, i.e. per pass)

``train.micro_batch=auto`` keeps updates_per_epoch (default 1) and grad_accum and takes S / (updates_per_epoch x
grad_accum) sequences per micro-batch, so a config makes the same optimizer updates per rollout on any number of
processes (the bundled masked configs use it). Each process shuffles its own samples into its micro-batches (as the
flow trainer does), so with more than one update per pass the samples that share an update differ from one process's
(the same number of updates of the same size); with one update per pass the update is one process's. An explicit micro_batch fixes the memory per backward; the updates
then follow from it, and a value that does not divide S is refused with the nearest ones that do (the solver both
trainers share: difrl/train/micro_batches.py). On P processes
each update's gradient is the mean of the processes' (DDP or FSDP2), each of them divided by 1/P of the update's
loss-token count summed over processes (`update_tokens`), so an update equals one process's update of the same
samples. One process runs the same code (without the split).

Under FSDP every process must run the same sequence of sharded forwards (each all-gathers). A rollout's count is
data-dependent: LLaDA skips steps where no sample commits, MDLM/emerge steps where none unmasks, EB runs until its
samples are done, the external correction's trace takes one forward per commit step; so the no-grad rollout
forwards run inside `rollout_forwards`, with every unit gathered once before and resharded after
(docs/reference/specs/scale.md §2, fix (b): no collective in between). Memory: the whole network in its compute
dtype on each process while it samples. Everything else (the old / reference log-probs, the trained micro-batches,
evaluation) runs the same forwards on every process.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from difrl.config import ConfigError
from difrl.train.dist.unit_gather import units_gathered as rollout_forwards  # noqa: F401 (the masked trainer's name)
from difrl.train.micro_batches import auto_options, explicit_options, nearest, own_updates, updates_options
from difrl.utils.collectives import gather, gather_max, reduce


class MaskedPlan(NamedTuple):
    n_total: int  # samples per iteration (all processes)
    per_proc: int  # samples per process
    rows: torch.Tensor  # [per_proc] long: this process's global sample indices
    micro: int  # sequences per forward/backward
    updates: int  # optimizer updates per inner update (pass over the rollout)


def local_device() -> None:
    """Under a launch of several processes on GPUs, make this process's GPU (LOCAL_RANK) the current CUDA device before
    the world loads: a world that puts its model on "cuda" (the text world) then loads it there, not every process on
    GPU 0. Nothing on CPU processes. (Not run on GPUs: no multi-GPU machine was available.)"""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def processes(policy):
    """(accelerator, FSDP settings or None): accelerate's Accelerator for one process, DDP (`accelerate launch
    --num_processes N`, configs/accelerate/ddp.yaml, torchrun) or FSDP2 (configs/accelerate/fsdp.yaml). The
    processes run on the CPU when the policy does (Sudoku and digit tokens keep their tiny models there; the
    text world's LM goes to a GPU when there is one)."""
    from accelerate import Accelerator

    from difrl.train.dist.sharded_step import take_fsdp_branches
    from difrl.train.dist.sharding import fsdp_settings, process_group_kwargs

    on_cpu = next(policy.module.parameters()).device.type == "cpu"
    cpu = on_cpu or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=cpu, kwargs_handlers=process_group_kwargs(cpu))  # FSDP offload: a CPU backend too
    take_fsdp_branches(accelerator)  # an FSDP launch runs accelerate's FSDP code on CPU processes too (tests)
    return accelerator, fsdp_settings(accelerator)


def plan_masked_iteration(cfg, world_size: int, rank: int) -> MaskedPlan:
    """Check that an iteration splits over `world_size` processes and into optimizer updates (ConfigError naming
    the keys and the nearest values that work), and return the split."""
    P, G = cfg.rollout.prompts_per_iter, cfg.rollout.group_size
    n_total = P * G
    if n_total % world_size:
        ps = [p for p in range(1, 2 * P + world_size + 1) if (p * G) % world_size == 0]
        gs = [g for g in range(2, 2 * G + world_size + 1) if (P * g) % world_size == 0]
        raise ConfigError(f"{n_total} samples per iteration (rollout.prompts_per_iter x rollout.group_size = {P} x {G}) "
                          f"do not split over {world_size} processes: use rollout.prompts_per_iter="
                          f"{' or '.join(map(str, nearest(ps, P)))} (with rollout.group_size={G}), or rollout.group_size="
                          f"{' or '.join(map(str, nearest(gs, G)))} (with rollout.prompts_per_iter={P})",
                          "rollout.prompts_per_iter")
    S = n_total // world_size
    micro, updates = micro_batching(cfg, S, world_size)
    return MaskedPlan(n_total, S, torch.arange(rank * S, (rank + 1) * S), micro, updates)


def micro_batching(cfg, S: int, world_size: int) -> tuple[int, int]:
    """(sequences per micro-batch, optimizer updates per pass) for S samples per process (module docstring)."""
    mb, ga, want = cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.updates_per_epoch
    where = f"each of the {world_size} processes has {S} samples" if world_size > 1 else f"the process has {S} samples"
    if mb == "auto":
        U = want or 1
        if S % (U * ga):
            options = auto_options(S, U, ga)
            raise ConfigError(f"train.micro_batch=auto takes whole sequences, but {where}, which do not split into "
                              f"train.updates_per_epoch x train.grad_accum = {U} x {ga} micro-batches: use "
                              + ", or ".join(options), "train.grad_accum")
        return S // (U * ga), U
    if S % (mb * ga):
        auto = f"train.micro_batch=auto ({S // ((want or 1) * ga)} sequences per micro-batch)"
        options = explicit_options(S, mb, ga, want, auto if S % ((want or 1) * ga) == 0 else "")
        raise ConfigError(f"{where} per iteration (rollout.prompts_per_iter x rollout.group_size / processes), not a "
                          f"multiple of train.micro_batch x train.grad_accum = {mb} x {ga} = {mb * ga}: use "
                          + ", or ".join(options), "train.micro_batch")
    got = S // (mb * ga)
    if want is not None and got != want:
        options = updates_options(S, mb, ga, want) + (["train.micro_batch=auto"] if S % (want * ga) == 0 else []) \
            + [own_updates(got)]
        raise ConfigError(f"train.micro_batch x train.grad_accum = {mb} x {ga} make {got} optimizer update(s) per pass "
                          f"when {where}, but train.updates_per_epoch={want}: use " + ", or ".join(options),
                          "train.updates_per_epoch")
    return mb, got


def update_tokens(accelerator, count: int, world_size: int) -> float:
    """The divisor of one process's summed per-token loss in an optimizer update: the update's loss tokens over
    all processes / P (at least 1/P). Gradients are averaged over the processes, so every token of the update is
    weighted 1 / (its tokens), as on one process: micro-batch and process splits leave the update unchanged."""
    total = reduce(accelerator, torch.tensor([float(count)], dtype=torch.float64))
    return max(float(total[0]), 1.0) / world_size


def gather_rows(accelerator, t: torch.Tensor) -> torch.Tensor:
    """Every process's rows of `t` ([per_proc, ...]) in global sample order ([n_total, ...]). Collective (also on one
    process, where accelerate hands `t` back: a test accelerator checks every collective's input there)."""
    return gather(accelerator, t)


def gather_busiest(accelerator, nfe: int) -> int:
    """The largest of the processes' counts, on every process (a collective: every process calls it), e.g. a
    rollout's forward passes: what the slowest process waits for; on one process the batch's own. LLaDA and EB give
    one process's count exactly (a sample's forwards do not depend on its batch); MDLM/emerge skips a step only when
    no sample of the batch unmasks, so a split batch may skip more."""
    return int(gather_max(accelerator, nfe))


def external_correction(accelerator, corrector, options: dict, lp_pi: torch.Tensor, mu: torch.Tensor,
                        gen: torch.Tensor, ext: torch.Tensor, rows: torch.Tensor):
    """The importance correction of the external rollouts (ERILS), over all processes' external rows at once:
    batch-normalised methods (*_bn) and the diagnostics see the whole iteration, as on one process. lp_pi, mu
    [this process's external rows, L] (pi_old and the external policy's log-probs), gen [S, L] this process's
    generated positions, ext [S] its external rows; `rows` its global sample indices. Returns (weights [S, L] fp32,
    keep [S, L] bool, the Correction of all external rows)."""
    S, L = gen.shape
    local = torch.zeros(2, S, L, dtype=torch.float32)
    local[0, ext], local[1, ext] = lp_pi.float(), mu.float()
    both = gather_rows(accelerator, local.transpose(0, 1)).transpose(0, 1)  # [2, N, L]
    all_gen = gather_rows(accelerator, gen.long()).bool()
    all_ext = gather_rows(accelerator, ext.long()).bool()
    correction = corrector(both[0, all_ext], both[1, all_ext], all_gen[all_ext], **options)
    weight, keep = torch.ones(len(all_ext), L), torch.ones(len(all_ext), L, dtype=torch.bool)
    weight[all_ext], keep[all_ext] = correction.weights.float(), correction.keep
    return weight[rows], keep[rows], correction
