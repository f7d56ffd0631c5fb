"""One training step under FSDP2, as accelerate's GPU path runs it: its branches, gradient accumulation, clipping.

    take_fsdp_branches(accelerator)                  # an FSDP launch runs accelerate's FSDP code on CPU processes too
    with grad_sync(accelerator, net, sharded, sync): loss.backward()   # FSDP2: sharded accumulation, no no_sync
    norm = clip_sharded_grad_norm_(params, 1.0)      # one all-reduce of the shards' sums of squares

Why these are not accelerate's own calls: on CPU processes (every multi-process test) accelerate never takes its
FSDP branches, so its `no_sync` did nothing there and FSDP2's unsharded accumulation stayed invisible; and its
FSDP2 `no_sync` is exactly what a sharded run must not do (difrl plan measures both: difrl/train/planner/flow.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from difrl.train.dist.full_tensors import is_sharded
from difrl.train.dist.sharding import fsdp_requested


def take_fsdp_branches(accelerator) -> None:
    """Make accelerate treat this launch as the FSDP launch it is, also on CPU processes.

    accelerate sets distributed_type = FSDP only for accelerator devices (accelerate/state.py: the MULTI_GPU ...
    MULTI_NEURON branch); CPU processes launched with an FSDP config stay MULTI_CPU, so `no_sync`, `is_fsdp2`,
    `clip_grad_norm_` and the state-dict helpers ran their DDP/CPU code in our multi-process tests and their FSDP2
    code on a GPU cluster (docs/reference/specs/scale.md §3.1). Here the accelerator's state takes the FSDP type and
    plugin the launch asked for, so the tests (gloo) and difrl plan run the branches a GPU run takes. PartialState
    (gather, barriers, device) is not touched: collectives stay on the CPU path gloo needs. Nothing happens when the
    launch did not ask for FSDP or accelerate already took the branch."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not fsdp_requested() or accelerator.num_processes < 2 or accelerator.distributed_type == DistributedType.FSDP:
        return
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP


def grad_sync(accelerator, net: nn.Module, sharded: bool, sync: bool):
    """The context of one micro-step's backward under gradient accumulation; `sync`: the update's last micro-step.
    DDP: no all-reduce until the last one (accelerate's no_sync). FSDP2: every micro-step reduce-scatters and its
    gradients accumulate sharded. accelerate's no_sync would call set_requires_gradient_sync(False), and FSDP2 then
    accumulates *unsharded* gradients in reduce_dtype (fp32) on every process until the sync: 4 bytes per parameter
    of the whole model per GPU (44 GiB for FLUX.1-dev; difrl plan shows it as unsharded_grads_gib). The price is one
    reduce-scatter per micro-step instead of per update."""
    if sync or sharded:
        return nullcontext()
    return accelerator.no_sync(net)


def clip_sharded_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) for FSDP2's sharded gradients with one all-reduce: the sum of squares
    of this process's gradient shards (fp32), summed over the processes, is the squared norm of the whole gradient;
    every shard is scaled in place by min(1, max_norm / (norm + 1e-6)). Returns the norm (a plain tensor). torch's
    clip on DTensor gradients runs DTensor ops per parameter, and difrl plan saw the update's peak grow by 8 times
    the sharded gradients inside it (FLUX.1-dev on 8 GPUs): this one holds a scalar per parameter at most."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if is_sharded(g)]
    plain = [g for g in grads if not is_sharded(g)]  # the same on every process: not summed over them
    device = (sharded or plain)[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    if sharded:
        torch.distributed.all_reduce(sq, group=next(g for g in grads if is_sharded(g)).device_mesh.get_group())
    for g in plain:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(device) ** 2
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in sharded + plain:
        g.mul_(coef.to(g.device, g.dtype))
    return norm
