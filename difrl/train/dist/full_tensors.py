"""Full tensors of a sharded network: gathering a sharded parameter, laying a full tensor out as a shard, and swapping
a module's shards for full tensors and back (FSDP2's DTensors; the wrapping itself is difrl/train/dist/sharding.py).

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_flux.py configs/flux_tiny.yaml
    with gathered(net, keep=is_main): save(net)     # every process gathers; the main one holds the full weights
    full = gather_to_host(p); p.copy_(like(p, full))  # one tensor gathered / put back into its shard
    reshard(net)                                     # after writing shards in place: the next forward gathers them
    merged = plain_copy(net)                         # inside `gathered`: a plain module of the full weights

A sharded parameter is a DTensor holding this process's rows (dim 0, torch.chunk's split); `is_sharded` tells one
from a plain tensor. The final weights (transformer/, lora/, policy.safetensors) are always gathered, once, at the
end (`gathered`), and held in full by the main process only (it writes them; the others drop each gathered tensor at
once). `shards_replaced` is the one swap of shards for full (or meta) tensors: `gathered`, and the rollout copy's
unit-wise gather and its meta skeleton (difrl/train/flow/rollout_copy.py).

fsdp_reshard_after_forward: false. FSDP2 then keeps a unit's gathered parameters after a forward (registered on
the module in place of the shards; only a backward reshards) and its next forward uses them as they are. Every
in-place write into the shards outside the optimizer step is therefore followed by `reshard(net)`, which frees them
so that the next forward gathers the shards: EMA.swap (the EMA evaluation, DiffusionNFT's old policy, also between
the no-grad and the trained forward of one NFT micro-step) and restore_checkpoint; `gathered` and the checkpoint's
snapshot reshard first so that they read the shards, not a gathered copy (bf16 under mixed precision); the LoRA
reference switch reshards around peft's requires_grad toggles (scaffold.adapter_disabled), which would otherwise
land on the gathered copies and leave the shards frozen. A new writer must do the same. Tested on 2 CPU processes
(tests/test_fsdp.py): a forward after an EMA swap and after a checkpoint restore computes what one plain process
computes with those weights, and a short digits run with DiffusionNFT, EMA and an evaluation every iteration equals
the reshard_after_forward=true run (without the reshards it does not, from the first iteration).

Under fsdp_offload_params the shards are CPU tensors: `gather_to_host` / `gathered` send them through the process
group (which needs a CPU backend: sharding.offload_policy), and `like` keeps a restored shard, EMA or optimizer moment
on the device of the parameter's shard (CPU), not on the mesh's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit in `module`, so that its next forward all-gathers the shards.
    Call after writing sharded parameters in place (an EMA swap, a checkpoint restore) and before reading them
    as the module's parameters: with reshard_after_forward=False FSDP2 keeps a unit's gathered parameters after a
    forward (registered on the module in place of the shards) and its next forward uses them without looking at the
    shards. No communication (every process may call it alone); nothing happens to a unit already resharded or a
    module that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather_to_host(t: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """A sharded tensor gathered (collective: every process calls it, in the same order) and copied to the host
    (DTensor's own full_tensor leaves it on the shard's device); a plain one as is. keep=False: take part in the
    all-gather only, drop the result at once and return None (a process that does not write what is gathered:
    gathered, state.snapshot)."""
    if is_sharded(t):
        full = t.detach().full_tensor()
        return full.cpu() if keep else None
    return t if keep else None


def like(ref: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (the same on every process, e.g. read from a checkpoint) laid out like `ref`: this process's shard
    when `ref` is sharded (no communication), on the device of ref's shard, else `full` itself."""
    if not is_sharded(ref):
        return full
    from torch.distributed.tensor import distribute_tensor

    # distribute_tensor puts the shard on the mesh's device; an offloaded parameter's shard (fsdp_offload_params) is
    # on the CPU, and its EMA and optimizer state must be where it is: the shard is copied into a DTensor like `ref`
    with torch.no_grad():
        out = torch.empty_like(ref, requires_grad=False)
        out.to_local().copy_(distribute_tensor(full.to(ref.dtype), ref.device_mesh, ref.placements,
                                               src_data_rank=None).to_local())
    return out


@contextmanager
def gathered(module: nn.Module, keep: bool = True):
    """Inside the block `module`'s sharded parameters are replaced by their full values (fp32 masters; shards_replaced),
    so saving it (save_pretrained, save_lora, a merged checkpoint) works as unsharded. No forward may run inside.
    Collective: every process enters it (each parameter is all-gathered, in the same order everywhere).

    `keep`: whether this process holds the full values. The final save passes keep=accelerator.is_main_process: the
    main process writes the files, and each other process drops every gathered tensor as soon as its all-gather
    returns (one tensor at a time) and sees meta tensors of the full shapes and dtypes inside the block (no data:
    reading one fails loudly). Without it every process would hold the whole model at once (the host memory of
    8 FLUX copies on one node)."""
    reshard(module)  # the shards registered, not what a forward left gathered (reshard_after_forward=False)

    def full(params):  # one all-gather per parameter, in order; keep=False: each dropped at once, meta in its place
        return [nn.Parameter(t if (t := gather_to_host(p, keep)) is not None else
                             torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
                for p in params]

    with shards_replaced(module.modules(), full):
        yield module


@contextmanager
def shards_replaced(modules, full):
    """Inside the block every sharded parameter registered on `modules` (each module's own, not its children's:
    `net.modules()` for a whole network) is replaced by its tensor from `full(params)`, and put back after (also if
    the block raises); `params`: the distinct ones in the order `modules` registers them (a collective in `full`
    runs in the same order on every process); tied parameters stay tied. The one swap of shards for full tensors:
    `gathered`, rollout_copy's unit-wise gather and its meta skeleton."""
    owners = [(mod, name, p) for mod in modules for name, p in list(mod._parameters.items())
              if p is not None and is_sharded(p)]
    distinct = list({id(p): p for _, _, p in owners}.values())
    replacement = dict(zip(map(id, distinct), full(distinct)))
    for mod, name, p in owners:
        mod._parameters[name] = replacement[id(p)]
    try:
        yield
    finally:
        for mod, name, p in owners:
            mod._parameters[name] = p


def plain_copy(module: nn.Module) -> nn.Module:
    """copy.deepcopy(module), also of a sharded module inside `gathered` (FSDP refuses deepcopy): the copy is a
    plain module holding the full weights (FSDP's classes, state and every module hook left out), e.g. to merge
    LoRA into. The original is untouched."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    saved = []
    for m in module.modules():
        fsdp_cls = type(m) if isinstance(m, FSDPModule) else None
        held = {k: v for k, v in vars(m).items()
                if k.startswith("__composable_api_state_key") or (k.startswith("_") and "hooks" in k and isinstance(v, dict))}
        saved.append((m, fsdp_cls, held))
        if fsdp_cls is not None:
            m.__class__ = next(c for c in fsdp_cls.__bases__ if not issubclass(c, FSDPModule))
        for k, v in held.items():
            if k.startswith("__composable_api_state_key"):
                delattr(m, k)
            else:
                setattr(m, k, type(v)())
    try:
        return copy.deepcopy(module)
    finally:
        for m, fsdp_cls, held in saved:
            if fsdp_cls is not None:
                m.__class__ = fsdp_cls
            for k, v in held.items():
                setattr(m, k, v)
