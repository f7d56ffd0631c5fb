"""Gathering an FSDP2-sharded network's units at the granularity a phase needs: once per rollout, one collective per unit.

    with units_gathered(net, fsdp):                          # a rollout: every unit all-gathered once, resharded after
        batch = rollout(policy, ...)
    mode = rollout_gather(cfg.rollout.fsdp_gather, net, fsdp, device_free_bytes(device, optimizer))  # once / per_forward
    fulls = gather_full(params, dtypes)                      # sharded params -> full tensors, one all-gather per dtype

**Once per rollout (issue 46, 9a).** FSDP2 all-gathers a unit's shards before each of its forwards and frees them
after (reshard_after_forward), so a flow rollout of T sampler steps x B forward batches all-gathers every block T x B
times: FLUX.1-dev on 8 GPUs, 16,704 all-gathers and 6.4 TiB per process per iteration (difrl plan, BENCHMARKS.md).
No-grad rollout forwards need no gradient reduction, so gathering every unit once before the rollout and
resharding after gives the same numbers (the gathered tensors are the same) at one all-gather per unit, for the
memory of the whole network in its compute dtype on each process while it samples (FLUX.1-dev in bf16: 22 GiB).
What the masked trainer does for its data-dependent forward counts; here a choice: `rollout.fsdp_gather`
  per_forward - FSDP's own schedule (least memory);
  once        - every unit gathered once per rollout (least communication);
  auto        - once when the gathered network fits in half of the device's free memory at that point
                (device_free_bytes: the GPU's memory less what tensors and the optimizer's first step take; the rest
                is the rollout's activations and the allocator's slack), else
                per_forward; on CPU processes (tests; host memory) once. `difrl plan` makes the same choice with
                the simulated GPU's free memory and reports it (`rollout_gather`).

**One collective per unit (9b).** The rollout copy of a sharded policy (difrl/train/flow/rollout_copy.py) reads the
weights one unit at a time. `DTensor.full_tensor` per parameter is one all-gather each (FLUX.1-dev: ~1,000 per sync),
of the fp32 master weights (twice bf16's bytes). `gather_full` packs a unit's local shards, cast first to the dtype the
copy keeps (the dtype the model was loaded in: a cast commutes with a gather, so the values are those of the full
tensor cast after gathering), into one flat buffer per dtype and all-gathers that: one collective per unit and
dtype. FSDP2 shards dim 0 as torch.chunk does (rank r holds rows [r c, (r + 1) c) of c = ceil(rows / world)); each
rank pads its rows to c, so the gathered buffer is [world, sum of c x row size] and every full tensor is its
column block, rows concatenated and the padding cut.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

AUTO_FRACTION = 0.5  # auto gathers once when the gathered network takes at most this fraction of the free memory


def sharded_units(net: nn.Module) -> list[nn.Module]:
    """Every FSDP unit of `net` (its blocks and the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in net.modules() if isinstance(m, FSDPModule)]


def gathered_bytes(net: nn.Module, fsdp) -> int:
    """Bytes that gathering every unit of `net` adds on this process: each sharded parameter in full, in the dtype
    FSDP gathers it in (`fsdp.mixed_precision`'s compute dtype for floating parameters, else its own)."""
    from difrl.train.dist.full_tensors import is_sharded
    from difrl.train.dist.sharding import MIXED

    compute = MIXED.get(getattr(fsdp, "mixed_precision", "no"))
    total = 0
    for p in net.parameters():
        if is_sharded(p):
            dtype = compute if compute is not None and p.is_floating_point() else p.dtype
            total += p.numel() * torch.empty((), dtype=dtype).element_size()
    return total


def rollout_gather(mode: str, net: nn.Module, fsdp, free_bytes: int | None) -> str:
    """"once" or "per_forward" for `rollout.fsdp_gather` = `mode` (module docstring); `free_bytes`: what the device
    has free for the rollout now (device_free_bytes; None: host memory, auto gathers once). Without FSDP there is
    nothing to gather: "per_forward" (no collective either way)."""
    if fsdp is None or mode == "per_forward":
        return "per_forward"
    if mode == "once" or free_bytes is None:
        return "once"
    return "once" if gathered_bytes(net, fsdp) <= AUTO_FRACTION * free_bytes else "per_forward"


def device_free_bytes(device, optimizer=None) -> int | None:
    """What a rollout may take on a CUDA `device`: its memory less what tensors hold now (torch.cuda.memory_allocated:
    the caching allocator's reserve is reusable) less the optimizer state its first step will add (a moment per
    state tensor AdamW keeps, of every parameter that has none yet: the first rollout runs before it exists).
    None on other devices (CPU processes: host memory)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    pending = 0
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not optimizer.state.get(p):
                    local = p.to_local() if hasattr(p, "to_local") else p
                    pending += 2 * local.numel() * local.element_size()  # AdamW: exp_avg, exp_avg_sq
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total - torch.cuda.memory_allocated(device) - pending)


@contextmanager
def units_gathered(net: nn.Module, fsdp, enabled: bool = True):
    """Inside the block the FSDP units of `net` stay gathered (all-gathered once on entry, every process in the same
    order; resharded on exit), so no-grad forwards make no collective and processes may run different numbers of
    them. Nothing to do without FSDP or when not `enabled`. No backward and no in-place weight write inside."""
    if fsdp is None or not enabled:
        yield
        return
    units = sharded_units(net)
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(fsdp.reshard_after_forward, recurse=False)


def gather_full(params: list, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The full tensors of the sharded `params` (DTensors sharded on dim 0 of one 1-D mesh, as FSDP2 shards them),
    each in its dtype from `dtypes`, with one all-gather per distinct dtype (module docstring). Collective: every
    process calls it with the same parameters in the same order. On the device of the local shards."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    out: list[torch.Tensor | None] = [None] * len(params)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (p, dtype) in enumerate(zip(params, dtypes)):
        if p.ndim == 0 or tuple(p.placements) != (Shard(0),) or p.device_mesh.ndim != 1:
            out[i] = p.detach().full_tensor().to(dtype)  # another layout: DTensor's own gather
        else:
            by_dtype.setdefault(dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        mesh = params[idx[0]].device_mesh
        world = mesh.size()
        rows = [-(-params[i].shape[0] // world) for i in idx]  # c: padded rows per rank
        inner = [params[i].shape[1:].numel() for i in idx]     # elements per row
        sizes = [c * r for c, r in zip(rows, inner)]
        local = torch.cat([_padded_rows(params[i].to_local().detach(), c).to(dtype).reshape(-1)
                           for i, c in zip(idx, rows)])          # [sum c x row size]
        full = torch.empty(world * local.numel(), dtype=dtype, device=local.device)
        dist.all_gather_single(full, local, group=mesh.get_group())
        full = full.view(world, local.numel())                   # [world, sum c x row size]
        start = 0
        for i, c, r, n in zip(idx, rows, inner, sizes):
            block = full[:, start:start + n].reshape(world * c, *params[i].shape[1:])  # ranks' rows in order
            out[i] = block[:params[i].shape[0]]
            start += n
        del full, local
    return out


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (a rank's shard holds fewer rows, or none, at the end of dim 0)."""
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])
