"""The flow trainer's rollout copy (difrl.quant.RolloutCopy), also of a policy sharded by FSDP2.

    copy, source = build_rollout_copy(cfg, policy, unwrapped, masters, print, device=accelerator.device,
                                      sharded=fsdp is not None)
    sync_rollout_copy(copy, source, unwrapped, it, run.start, cfg.rollout.sync_every)   # before each rollout

The copy (rollout.precision other than fp32, or rollout.sync_every > 1; Sol-RL's stage-1 candidates) is a second,
plain network: LoRA merged, linear layers quantized, refreshed from the trained weights before the rollouts and
then verified against them (difrl/quant/sync.py).

**Under FSDP2: a full low-precision copy on every process, built and synced one gathered unit at a time.** The
trained network holds only this process's shards, so the copy cannot be a deep copy of it. Of the two designs
(docs/reference/specs/scale.md §2; issue 40), a copy sharded like the policy and a whole copy per process, difrl keeps
the whole copy per process:
- its forwards need no collective: it is a plain module with no FSDP hooks, so a rollout on it may run any number
  of forwards on any process (fix (c) of docs/reference/specs/scale.md §2 "Uneven forward counts"; what torchtitan RL,
  verl and Sol-RL's DDP replicas do) and it is as fast as the DDP copy;
- it is built exactly as one process builds it: every weight is quantized whole (each unit's parameters gathered
  in full, one all-gather per unit and dtype: difrl/train/dist/unit_gather.py), so per-tensor scales (fp8's amax) need
  no extra all-reduce and the copy is bit-for-bit the one-process copy (row-wise formats could quantize a shard
  alone; a per-tensor amax could not);
- memory is bounded: `sharded_weights` gathers one FSDP unit (a transformer block, then the root's rest) in the
  dtypes the copy keeps (the loaded dtype: a bf16 model's fp32 masters are cast to bf16 before they travel), yields
  its LoRA-merged tensors and frees them before the next; the copy is built from a meta-tensor skeleton
  (`sharded_skeleton`) filled and quantized unit by unit. Never is the whole model gathered, nor held in high
  precision: the peak is the copy so far + one unit gathered (twice: the flat buffer, then its tensors) + its
  high-precision copy before quantization. The price is the copy's full size on every process (fp8: a byte per
  quantized weight; benchmarks/bench_fsdp_memory.py measures it against DDP's copy).
Both paths, sharded and not, fill the copy from the weights in the dtypes the model was loaded in (one process:
`loaded_weights`, MasterWeights.as_loaded), at build and at every sync alike.
The sync after each update (the no-op check and `verify`) reads the same unit-wise parts. Every process gathers
the same units in the same order (a collective) and computes the same checks from the same full tensors, so a
failed check stops every process together. Collectives: one all-gather of the packed shards per unit and dtype,
on the shards' device (the accelerator's; with fsdp_offload_params the CPU, through the group's CPU backend); the
gathered tensors are then moved to `device`, where the copy runs.
Tested on 2 CPU processes (gloo, tests/test_fsdp_methods.py): equal to one process. Not run on GPUs / NCCL.
"""

from __future__ import annotations

import torch
from torch import nn

from difrl.quant import RolloutCopy
from difrl.quant.sync import merged_state_dict
from difrl.train.dist.full_tensors import plain_copy, reshard, shards_replaced
from difrl.train.dist.unit_gather import gather_full
from difrl.train.ema import WeightSnapshot
from difrl.train.precision import MasterWeights
from difrl.utils.modules import peft_base, trainable_params


def build_rollout_copy(cfg, policy, unwrapped, masters: MasterWeights, say, device=None,
                       sharded: bool = False) -> tuple[RolloutCopy | None, WeightSnapshot | None]:
    """The rollout copy (LoRA merged, linear layers in rollout.precision, re-synced before rollouts) or None, and
    for a stale copy (sync_every > 1) the weights it was last synced from (checkpointed, so resume is exact). The
    copy holds its high-precision tensors in the dtypes the model was loaded in (`masters.as_loaded`), its source
    the fp32 master weights. `sharded`: `unwrapped` is sharded by FSDP2 (module docstring); the copy goes to
    `device`."""
    if cfg.rollout.precision == "fp32" and cfg.rollout.sync_every == 1:
        return None, None
    preset = policy.quant_preset
    quant = (cfg.rollout.precision, preset["skip"] if cfg.rollout.quant_skip is None else cfg.rollout.quant_skip,
             preset["min_dim"] if cfg.rollout.quant_min_dim is None else cfg.rollout.quant_min_dim,
             cfg.rollout.quant_backend)
    if sharded:
        copy = RolloutCopy(unwrapped, *quant, weights=sharded_weights(device, masters.loaded), device=device,
                           skeleton=sharded_skeleton(unwrapped, masters.loaded))
    else:
        with masters.as_loaded(unwrapped):
            copy = RolloutCopy(unwrapped, *quant, weights=loaded_weights(masters))
    say(f"difrl: rollout copy ({'stage-1 candidates' if cfg.rollout.kind == 'solrl' else 'rollouts'}, synced every "
        f"{cfg.rollout.sync_every} iteration(s){'; a full copy per process, built one FSDP unit at a time' if sharded else ''}): "
        + copy.report.summary())
    return copy, WeightSnapshot(trainable_params(unwrapped), unwrapped) if cfg.rollout.sync_every > 1 else None


def sync_rollout_copy(copy: RolloutCopy | None, source: WeightSnapshot | None, unwrapped, it: int, start: int,
                      every: int) -> None:
    """Refresh the copy every `every` iterations (after an update, a sync that changes nothing is a
    WeightSyncError); a run resumed between two syncs of a stale copy reloads it from the saved source."""
    if copy is None:
        return
    if it % every == 0:
        if source is not None:
            source.take()  # remember what the copy was synced from
        copy.sync(unwrapped, check=it > start)
    elif it == start:
        with source.swapped():
            copy.sync(unwrapped, check=False)


def fsdp_units(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the plain model, module) of every FSDP unit of `net` below its root: the transformer blocks."""
    from torch.distributed.fsdp import FSDPModule

    base = peft_base(net)
    return [(n, m) for n, m in base.named_modules() if isinstance(m, FSDPModule) and m is not base and m is not net]


def _full(modules, device, dtype_of: dict[int, torch.dtype]):
    """Inside the block the sharded parameters of `modules` (their own, not their children's) are replaced by their
    full values in the dtypes the copy keeps (`dtype_of`: by id, default the parameter's own) on `device`: one
    all-gather per dtype for all of them (unit_gather.gather_full; every process, same order); the shards are put
    back after (full_tensors.shards_replaced)."""
    def full(params):
        fulls = gather_full(params, [dtype_of.get(id(p), p.dtype) for p in params])
        return [nn.Parameter(f.to(device) if device is not None else f, requires_grad=False) for f in fulls]
    return shards_replaced(modules, full)


def sharded_weights(device=None, loaded: dict[str, torch.dtype] | None = None):
    """`weights` for RolloutCopy of an FSDP2-sharded network: its LoRA-merged state dict in parts, one FSDP unit
    (a block, then the root's own tensors) gathered at a time, in one collective per dtype, and freed before the
    next (module docstring). `loaded`: MasterWeights.loaded, the dtype each upcast parameter was loaded in: the
    copy's dtype, which the shards are cast to before they travel (half the bytes of the fp32 masters)."""
    loaded = loaded or {}

    def parts(source: nn.Module):
        reshard(source)  # the shards registered, not what a forward left gathered (reshard_after_forward=False)
        dtype_of = {id(p): loaded[n] for n, p in source.named_parameters() if n in loaded}
        units = fsdp_units(source)
        for name, unit in units:
            with _full(list(unit.modules()), device, dtype_of):
                part = {f"{name}.{k}": v for k, v in merged_state_dict(unit).items()}
            yield part
        inside = {id(m) for _, unit in units for m in unit.modules()}
        with _full([m for m in source.modules() if id(m) not in inside], device, dtype_of):
            part = merged_state_dict(source, exclude=tuple(n for n, _ in units))
        yield part
    return parts


def loaded_weights(masters: MasterWeights):
    """`weights` for RolloutCopy of an unsharded network: its LoRA-merged state dict with the upcast parameters in
    the dtypes they were loaded in (MasterWeights.as_loaded), as the copy was built from them and as the sharded
    path gathers them: the copy is always the loaded-dtype model quantized (a bf16 model's bf16 weights, what
    Transformer Engine's bf16 te.Linear holds too), not the fp32 masters quantized at one sync and bf16 at another."""
    def parts(source: nn.Module):
        with masters.as_loaded(source):
            yield merged_state_dict(source)
    return parts


def sharded_skeleton(net: nn.Module, loaded: dict[str, torch.dtype]) -> nn.Module:
    """A plain copy of sharded `net` (FSDP's classes and hooks left out, full_tensors.plain_copy) whose parameters are
    meta tensors of the full shapes, in the dtypes the copy keeps (`loaded`: MasterWeights.loaded, the dtype an
    upcast parameter was loaded in; else the parameter's own). Nothing is gathered and nothing allocated."""
    dtype_of = {id(p): loaded.get(n, p.dtype) for n, p in net.named_parameters()}

    def meta(params):  # full shapes, no data
        return [nn.Parameter(torch.empty(p.shape, dtype=dtype_of.get(id(p), p.dtype), device="meta"),
                             requires_grad=False) for p in params]
    with shards_replaced(net.modules(), meta):
        return plain_copy(net)
