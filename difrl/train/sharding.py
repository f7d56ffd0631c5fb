"""FSDP2 sharding of the trained network (parameters, gradients, optimizer state split over processes).

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_flux.py configs/flux_tiny.yaml
    settings = fsdp_settings(accelerator)            # None unless the launch asked for FSDP (ACCELERATE_USE_FSDP)
    net = shard(net, policy.block_classes, settings)   # fully_shard per transformer block, then the root
    with gathered(net): save(net)                   # every process: full fp32 weights in place of the shards
    full = full_tensor(p); p.copy_(like(p, full))  # one tensor gathered / put back into its shard

Why difrl calls `torch.distributed.fsdp.fully_shard` itself instead of leaving it to
`accelerator.prepare`: accelerate applies FSDP only on accelerator devices (on CPU processes its
FSDP settings are ignored and the model would be replicated by DDP), and its auto-wrap reads
`_no_split_modules`, which not every model has (BERT's masked LM has none). So the same code
shards on GPUs and on the CPU processes the tests run on (gloo), wrapping the block classes each
adapter names (`policy.block_classes`; `fsdp_transformer_layer_cls_to_wrap` in the accelerate config
overrides them). The settings still come from accelerate's config (its FSDP plugin reads the
environment `accelerate launch` sets): fsdp_version (2 only), reshard_after_forward,
offload_params and mixed_precision (bf16 / fp16: compute in that dtype, fp32 master weights and
gradient reduction). fsdp_auto_wrap_policy is not read: the units are always the blocks (a size-based
policy would cut blocks apart). fsdp_activation_checkpointing is not read either: activation checkpointing
is a model option (hf_masked: model.gradient_checkpointing; the flow adapters have none yet).

A sharded parameter is a DTensor holding this process's rows (dim 0, torch.chunk's split). Checkpoints
and the final weights are gathered to full tensors, so a checkpoint written by N sharded processes is
the same file a single process writes (a run resumes from it on the same number of processes: tested;
another number reads the same files, untested).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FSDPSettings:
    reshard_after_forward: bool = True
    offload_params: bool = False
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16" (accelerate's mixed_precision)
    block_classes: tuple[str, ...] | None = None  # the config's fsdp_transformer_layer_cls_to_wrap, if set


def fsdp_requested() -> bool:
    """Whether this launch asked for FSDP: `accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_settings(accelerator) -> FSDPSettings | None:
    """The FSDP settings of this launch (accelerate's FSDP plugin, read from the environment that
    `accelerate launch --config_file ...` sets), or None when the launch did not ask for FSDP. Raises
    ConfigError for FSDP version 1: difrl shards with FSDP2 only."""
    if not fsdp_requested():
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    from difrl.config import ConfigError

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ConfigError(f"the accelerate config asks for FSDP version {plugin.fsdp_version}; difrl shards with FSDP2 "
                          "(set fsdp_config.fsdp_version: 2, as configs/accelerate/fsdp.yaml does)", "fsdp_version")
    names = plugin.transformer_cls_names_to_wrap
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    mixed = accelerator.mixed_precision if accelerator is not None else "no"
    if mixed not in ("no", *MIXED):
        raise ConfigError(f"mixed_precision {mixed!r} is not supported under FSDP (use no, bf16 or fp16)", "mixed_precision")
    return FSDPSettings(reshard_after_forward=bool(plugin.reshard_after_forward),
                        offload_params=bool(os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"),
                        mixed_precision=mixed, block_classes=tuple(names) if names else None)


def refuse_unsupported(cfg, settings: FSDPSettings | None) -> None:
    """Stop before training when the config asks for something not made to work under sharding (a wrong result
    or a hang is never an option). The rollout copy (rollout.precision != fp32 or rollout.sync_every > 1, and
    so Sol-RL's low-precision candidates) is a whole second network per process built by copying the module;
    under FSDP it would copy shards, so it is refused."""
    if settings is None:
        return
    from difrl.config import ConfigError

    rollout = getattr(cfg, "rollout", None)
    if getattr(rollout, "precision", "fp32") != "fp32" or getattr(rollout, "sync_every", 1) != 1:
        raise ConfigError("rollout.precision / rollout.sync_every: the rollout copy (a quantized or stale second "
                          "network, also Sol-RL's low-precision candidates) is not supported under FSDP: it copies the "
                          "module, which holds only this process's shards there. Use rollout.precision=fp32 and "
                          "rollout.sync_every=1, or DDP (configs/accelerate/ddp.yaml)", "rollout.precision")
    if getattr(rollout, "kind", "flat") in ("solrl", "tree"):
        raise ConfigError(f"rollout.kind={rollout.kind} has not been tested under FSDP (a process doing a different "
                          "number of forward passes than another would hang in the parameter all-gather); use "
                          "rollout.kind=flat with FSDP, or DDP (configs/accelerate/ddp.yaml)", "rollout.kind")


def block_modules(module: nn.Module, class_names) -> list[nn.Module]:
    """The submodules whose class name is one of `class_names` (the transformer blocks FSDP wraps one by one),
    less any holding a parameter that is also used outside it (tied weights, e.g. BERT's word embeddings and
    its output decoder: FSDP2 needs a shared parameter in one unit, so it stays with the root)."""
    names = set(class_names)
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out = []
    for m in module.modules():
        if type(m).__name__ in names:
            inside: dict[int, int] = {}
            for _, p in m.named_parameters(remove_duplicate=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
            if all(uses[i] == n for i, n in inside.items()):
                out.append(m)
    return out


def shard(module: nn.Module, block_classes, settings: FSDPSettings, device: torch.device | None = None) -> nn.Module:
    """fully_shard every block of `module` (one FSDP unit per transformer block: its weights are gathered just
    for its forward / backward), then the root (the rest: embeddings, norms, output). In place; returns module.
    Raises ValueError when no block class is found (a config or adapter naming the wrong classes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    classes = settings.block_classes or tuple(block_classes)
    blocks = block_modules(module, classes)
    if not blocks:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"FSDP: no module of the block classes {list(classes)} in {type(module).__name__} (its classes: "
                         f"{present[:12]}...); set fsdp_transformer_layer_cls_to_wrap in the accelerate config")
    device = device or torch.device("cpu")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    dtype = MIXED.get(settings.mixed_precision)
    kw = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward,
          "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
          "offload_policy": CPUOffloadPolicy() if settings.offload_params else OffloadPolicy()}
    for block in blocks:
        fully_shard(block, **kw)
    # the root too is resharded after each forward (not fully_shard's default for a root): every forward then
    # gathers the current shards, also after they were written in place (EMA swap, checkpoint restore)
    fully_shard(module, **kw)
    return module


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered (collective: every process calls it, in the same order), on the CPU; a plain one as is."""
    if is_sharded(t):
        return t.detach().full_tensor().cpu()
    return t


def like(ref: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (the same on every process, e.g. read from a checkpoint) laid out like `ref`: this process's shard
    when `ref` is sharded (no communication), else `full` itself."""
    if not is_sharded(ref):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(ref.device, ref.dtype), ref.device_mesh, ref.placements, src_data_rank=None)


@contextmanager
def gathered(module: nn.Module):
    """Inside the block `module`'s sharded parameters are replaced by their full values (fp32 masters, gathered on
    every process), so saving it (save_pretrained, save_lora, a merged checkpoint) works as unsharded; the shards
    are put back after. Tied parameters stay tied. No forward may run inside."""
    swapped, full_of = [], {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and is_sharded(p):
                if id(p) not in full_of:
                    full_of[id(p)] = nn.Parameter(full_tensor(p), requires_grad=p.requires_grad)
                swapped.append((mod, name, p))
                mod._parameters[name] = full_of[id(p)]
    try:
        yield module
    finally:
        for mod, name, p in swapped:
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


def state_bytes(params, optimizer) -> dict[str, int]:
    """This process's bytes of parameters, gradients and optimizer state (local shards under FSDP)."""
    def local(t):
        return t.to_local() if is_sharded(t) else t

    params = list(params)
    p = sum(local(x).numel() * local(x).element_size() for x in params)
    g = sum(local(x.grad).numel() * local(x.grad).element_size() for x in params if x.grad is not None)
    o = sum(local(v).numel() * local(v).element_size() for st in optimizer.state.values() for v in st.values()
            if torch.is_tensor(v))
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}
