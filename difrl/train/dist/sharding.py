"""FSDP2 sharding of the trained network (parameters, gradients, optimizer state split over processes).

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_flux.py configs/flux_tiny.yaml
    settings = fsdp_settings(accelerator)            # None unless the launch asked for FSDP (ACCELERATE_USE_FSDP)
    net = shard(net, policy.block_classes, settings)   # fully_shard per transformer block, then the root
    state_bytes(net.parameters(), optimizer)          # this process's bytes of its shards, gradients and moments

The full tensors of the sharded network (gathering, laying out as a shard, `gathered` for the final save, `reshard`
after an in-place write) are difrl/train/dist/full_tensors.py.

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

Both trainers split their samples over the processes under FSDP as under DDP (difrl/train/flow/trainer.py,
difrl/train/masked/plan.py): each process rolls out and trains on its share of the global batch, and FSDP2 only
adds the sharding of the model. Every process must run the same sequence of sharded forwards (each all-gathers):
the masked trainer's rollouts, whose forward count depends on the samples, run with the units gathered once
(masked_plan.rollout_forwards).

A sharded parameter is a DTensor holding this process's rows (dim 0, torch.chunk's split). Checkpoints are
sharded by default under FSDP (train.checkpoint_format: each process writes its own rows with
torch.distributed.checkpoint, difrl/train/run/sharded_state.py; a run resumes on another number of processes: tested
2 -> 1 and 1 -> 2) or, with checkpoint_format=gathered, gathered to the full tensors a single process writes. The
final weights (transformer/, lora/, policy.safetensors) are always gathered, once, at the end (full_tensors.gathered),
and held in full by the main process only.

The rollout copy of a sharded policy (a full low-precision copy per process, built one gathered unit at a time) is
difrl/train/flow/rollout_copy.py; the equal forward counts that FSDP needs of trees and Sol-RL, difrl/train/flow/plan.py.

fsdp_reshard_after_forward: false. FSDP2 then keeps a unit's gathered parameters after a forward and its next
forward uses them as they are: every in-place write into the shards outside the optimizer step is followed by
full_tensors.reshard (that module says who calls it and how it is tested).

fsdp_offload_params: true (CPUOffloadPolicy). The shards, their gradients and the optimizer step live on the CPU.
FSDP itself copies them to the device for its all-gather and reduce-scatter, but gradient clipping (the norm of
sharded gradients is reduced over processes) and full_tensors.gather_to_host / gathered (an all-gather) send the CPU
tensors through the process group, and NCCL refuses CPU tensors. So the Accelerator starts the group as
cuda:nccl,cpu:gloo (process_group_kwargs; accelerate 1.16 does so on its own for an FSDP offload launch), a
one-dimensional mesh over all processes uses that default group, and offload_policy refuses (ConfigError) a group
without a CPU backend. full_tensors.like keeps a restored shard, EMA or optimizer moment on the device of the
parameter's shard (CPU), not on the mesh's. Tested on 2 CPU processes only (tests/test_fsdp.py): a short digits run
(DiffusionNFT, EMA, an evaluation every iteration) with offload equals the run without; the EMA-swap / restore check
with offload; the refusal, with a cuda:gloo group (no CPU backend: it refuses CPU tensors with the error NCCL gives).
Not tested: anything on a GPU. NCCL never ran, nor the dual-backend group, nor FSDP moving offloaded shards between
host and device, nor full_tensors.like with a CPU shard on a CUDA mesh (on CPU processes the mesh and the shards are
both on the CPU, so offload moves nothing there). Host memory is pinned only on an accelerator: pinning needs a GPU
driver.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from difrl.train.dist.full_tensors import is_sharded

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


def offload_requested() -> bool:
    """Whether the launch asks for fsdp_offload_params (`accelerate launch` sets FSDP_OFFLOAD_PARAMS from the config)."""
    return os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"


def process_group_kwargs(cpu: bool) -> list:
    """The Accelerator's kwargs_handlers: under FSDP with offload_params on GPUs, a process group with a gloo backend
    for CPU tensors next to NCCL (offload_policy says why). accelerate 1.16 does the same on its own when its backend
    is nccl and FSDP_OFFLOAD_PARAMS is set; asking for it keeps difrl independent of that, and offload_policy checks
    the group that was actually started."""
    if cpu or not (fsdp_requested() and offload_requested()):
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="cuda:nccl,cpu:gloo")]


def offload_policy(settings: FSDPSettings, device_type: str, group):
    """FSDP2's offload policy for `settings` on a mesh of `device_type` whose process group is `group`.

    fsdp_offload_params keeps each process's shards, their gradients and the optimizer step on the CPU
    (CPUOffloadPolicy; FSDP copies a unit's shards to the device for its all-gather and the reduced gradients back).
    Two things then touch CPU tensors through `group`: gradient clipping (torch's clip_grad_norm_ on the sharded
    gradients yields a norm that is a partial sum over processes: it is all-reduced) and gather_to_host / gathered (an
    all-gather of the shards). NCCL refuses CPU tensors, so on an accelerator the group must have a CPU backend too
    (cuda:nccl,cpu:gloo, see process_group_kwargs); else this raises ConfigError before any work. Pinned host memory
    only where there is a device to copy to: pinning needs a GPU driver, so CPU processes would fail."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not settings.offload_params:
        return OffloadPolicy()
    if device_type != "cpu":
        backends = torch.distributed.get_backend_config(group)  # e.g. "cuda:nccl" or "cuda:nccl,cpu:gloo"
        if "cpu" not in [b.split(":")[0] for b in backends.split(",")]:
            from difrl.config import ConfigError

            raise ConfigError(f"fsdp_offload_params: true keeps the shards and their gradients on the CPU, and gradient "
                              "clipping and the gathered checkpoints reduce / gather them through the process group, "
                              f"whose backends ({backends}) have none for CPU tensors. Start the group with a CPU "
                              "backend as well (backend cuda:nccl,cpu:gloo: what accelerate launch with "
                              "fsdp_offload_params: true does), or set fsdp_offload_params: false", "fsdp_offload_params")
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


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
                        offload_params=offload_requested(),
                        mixed_precision=mixed, block_classes=tuple(names) if names else None)


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


def shard(module: nn.Module, block_classes, settings: FSDPSettings, device: torch.device | None = None,
          fp32_inputs: tuple[str, ...] = (), prepare=None) -> nn.Module:
    """fully_shard every block of `module` (one FSDP unit per transformer block: its weights are gathered just
    for its forward / backward), then the root (the rest: embeddings, norms, output). In place; returns module.
    `fp32_inputs`: keyword arguments of the root's forward that keep the dtype the caller gives them under mixed
    precision (the adapter's fsdp_fp32_inputs, see keep_input_dtypes). `prepare(unit)`: called on each block just
    before it is sharded and on the root before the root (whose own parameters are then the ones not in a block), so
    that work on the full weights (fp32 master weights, a frozen copy's values) is done one unit at a time and never
    holds more than one unsharded block beyond the shards (difrl/train/precision.py `trained_network`). Raises
    ValueError when no block class is found (a config or adapter naming the wrong classes).

    Only the root casts its floating inputs to the compute dtype (MixedPrecisionPolicy's cast_forward_inputs): a
    block takes what the root's layers computed in the dtype they computed it, as without FSDP. Casting at every
    block would give, e.g., a FLUX block its rotary (cos, sin) and every Wan block its fp32 time projection in bf16,
    which diffusers computes in fp32 unsharded (and under autocast): FSDP and DDP runs of one config would differ
    silently (tests/test_fsdp_families.py compares each block's inputs, sharded and not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    classes = settings.block_classes or tuple(block_classes)
    blocks = block_modules(module, classes)
    if not blocks:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"FSDP: no module of the block classes {list(classes)} in {type(module).__name__} (its classes: "
                         f"{present[:12]}...); set fsdp_transformer_layer_cls_to_wrap in the accelerate config")
    device = device or torch.device("cpu")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh reads its ranks as numbers; difrl plan shards under FakeTensorMode
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    dtype = MIXED.get(settings.mixed_precision)
    kw = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward,
          "offload_policy": offload_policy(settings, mesh.device_type, mesh.get_group())}
    reduce = torch.float32 if dtype else None
    root = type(module).__name__  # fully_shard renames the class (FSDP<name>)
    for block in blocks:
        if prepare is not None:
            prepare(block)
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce,
                                                           cast_forward_inputs=False), **kw)
    if prepare is not None:
        prepare(module)
    # the root too is resharded after each forward (not fully_shard's default for a root): every forward then
    # gathers the current shards, also after they were written in place (EMA swap, checkpoint restore)
    fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce), **kw)
    if dtype is not None:
        keep_input_dtypes(module, fp32_inputs)
    quiet_checked_view_outputs(root)
    return module


def frozen_skeleton(module: nn.Module) -> tuple[nn.Module, dict]:
    """A copy of `module` whose parameters are on the meta device (no memory), frozen, tied where `module`'s are, and
    the map from each to the parameter of `module` it copies; buffers are copied as they are (small). `fill(unit)`
    (frozen_fill) gives a unit its values just before it is sharded: a frozen reference copy is thus made and
    sharded one block at a time instead of deep-copying the whole model onto every GPU first."""
    import copy

    memo, source = {}, {}
    for p in module.parameters():
        if id(p) not in memo:
            meta = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            memo[id(p)], source[id(meta)] = meta, p
    return copy.deepcopy(module, memo), source


def frozen_fill(source: dict):
    """The `prepare` of `shard` for a frozen_skeleton: each meta parameter of the unit becomes a frozen copy of the
    parameter it stands for (on that one's device, in its dtype); tied parameters stay tied (a tie never crosses
    units: block_modules leaves a shared parameter to the root). Each source is forgotten once copied and each copy
    is held only by its unit, so after the unit is sharded neither full tensor is kept alive from here."""

    def fill(unit: nn.Module) -> None:
        made: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for mod in unit.modules():
                for name, p in list(mod._parameters.items()):
                    if p is None or id(p) not in source:
                        continue
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(source[id(p)].detach().clone(), requires_grad=False)
                    mod._parameters[name] = made[id(p)]
        for key in made:
            source.pop(key, None)

    return fill


def keep_input_dtypes(root: nn.Module, names: tuple[str, ...]) -> None:
    """Let the keyword arguments `names` of the sharded `root`'s forward through FSDP2's input cast as they are.

    MixedPrecisionPolicy(cast_forward_inputs=True) casts every floating argument of a unit's forward to param_dtype,
    the root's included (docs/reference/specs/scale.md §2). Most of them should be (latents, prompt embeddings: the
    root's own layers compute in bf16), but SD3's and Wan's pipelines pass the timestep 1000 sigma in fp32 and embed it
    in fp32 (a sinusoid cast to the weights' dtype only after): in bf16 (8 significant bits) 737.9 arrives as 736.0, a
    different conditioning from the pipeline's and from the same run unsharded (autocast leaves it fp32). So a
    pre-forward hook placed before FSDP's holds these arguments and one placed after it puts them back; the
    adapter decides their dtype, as without FSDP. tests/test_fsdp_families.py checks the timestep that reaches the
    embedding under FSDP bf16."""
    if not names:
        return
    held: dict = {}

    def hold(_, args, kwargs):
        held.clear()
        held.update({n: kwargs[n] for n in names if n in kwargs})

    def put_back(_, args, kwargs):
        if not held:
            return None
        kwargs = {**kwargs, **held}
        held.clear()
        return args, kwargs

    root.register_forward_pre_hook(hold, prepend=True, with_kwargs=True)  # before FSDP's (also prepended, earlier)
    root.register_forward_pre_hook(put_back, with_kwargs=True)  # after it


# FSDP2 blocks whose outputs are views and were checked to be used out of place only: diffusers' FLUX single-stream
# block returns two slices of one tensor, which the next block joins with torch.cat (and the root's norm_out reads)
VIEW_OUTPUT_BLOCKS = ("FluxSingleTransformerBlock",)


def quiet_checked_view_outputs(root_class: str) -> None:
    """Drop torch's warning "FSDP2-wrapped module (...) returned a view tensor. An in-place op on this view ... will
    silently drop the pre-backward hook ... wrong gradients" for the root and VIEW_OUTPUT_BLOCKS only. torch warns
    for every view output, whether or not anything writes to it; the danger is an in-place write. A root's output
    (FluxTransformer2DModel, WanTransformer3DModel, the masked transformer: a reshape of the last linear layer's
    output) is read only by the adapter (velocity, logits), which never writes to it in place (mask_logit is out of
    place for this reason); FSDP runs equal one process in tests/test_fsdp.py. The warning of any other module,
    e.g. a block of a new model family, still shows: check its consumer, then add it here."""
    import re
    import warnings

    names = "|".join(re.escape(n) for n in (root_class, *VIEW_OUTPUT_BLOCKS))
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP(?:{names})\) returned a view tensor",
                            category=UserWarning)


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
