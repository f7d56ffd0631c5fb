"""Full fine-tuning of a half-precision model: fp32 master weights, gradients and AdamW state, bf16 compute.

    refuse_fp16(cfg.model.dtype)                         # first thing in a trainer: fp16 training is refused
    net, reference, masters, fsdp = trained_network(policy, cfg.train.lora, cfg.seed, need_reference,
                                                    fsdp_settings(accelerator), accelerator.device)
    # = wrap_policy, upcast_masters (before the optimizer and every EMA), masters.fsdp, shard_policy
    with masters.as_loaded(net): net.save_pretrained(d)  # written in the dtypes the model was loaded in

Why. A model loaded in bf16 (model.dtype=bf16; hf_masked's dtype=auto on a GPU) and fully fine-tuned as loaded
keeps its weights, AdamW's moments and the EMA / DiffusionNFT shadows in bf16. bf16 holds 8 significant bits, so an
update below about 2^-9 of a weight rounds away: one AdamW step at lr 1e-5 moved a few percent of a bf16 model's
weights where fp32 moves all of them, and an EMA at decay 0.999 barely moves at all (tests/test_precision.py
measures both on the tiny SD3). Users expect what accelerate's mixed precision and FSDP's MixedPrecisionPolicy
give: fp32 master weights and optimizer state, half-precision compute.

The design. `upcast_masters` makes the trained network's half-precision parameters fp32 in place (the master
weights). Everything that follows the parameters' dtype is then fp32 with no further code: gradients, AdamW's
moments, the EMA, DiffusionNFT's old policy and the stale rollout copy's source (difrl.train.ema.EMA clones the
parameters), gradient all-reduce under DDP and the training checkpoints (exact resume). The adapter runs its forward
under torch.autocast(model.dtype) (its ``autocast_dtype``, difrl.models.base.autocast_to): every rollout and every
training forward go through the same adapter call, so they compute identically and the first on-policy
micro-step's ratio is exactly 1 (train.ratio_check). Under FSDP2 each block is upcast just before it is sharded
(`trained_network`: the whole model's fp32 masters never exist on one GPU, nor a whole copy of the frozen reference,
which is filled and sharded one block at a time) and sharded with MixedPrecisionPolicy(param_dtype=model.dtype,
reduce_dtype=fp32) (`fsdp`): the all-gather moves half-precision weights, gradients are reduced in fp32, and the
same autocast wraps the forward.

Why autocast rather than a half-precision copy of the parameters swapped in around each forward (FSDP's own way):
it is what accelerate's mixed_precision does, and it survives what a swap does not: gradient checkpointing
(model.gradient_checkpointing) recomputes a block inside the backward, after a swap would have been undone, while
torch.utils.checkpoint records and replays the autocast state; torch.compile, DDP and peft take it as it is.
autocast casts a weight to bf16 where a matmul or convolution reads it (the half-precision compute copy: 2 bytes
per such weight, held from the forward until its backward) and keeps the ops it lists as fp32 in fp32.

What stays in model.dtype: the frozen parts (text encoders, VAE), LoRA's frozen base (peft keeps the adapters
themselves in fp32, so a LoRA run has no half-precision trained parameter and is left exactly as it was, with no
autocast), the frozen reference copy of full fine-tuning (never updated, so fp32 would buy nothing; it runs under
the same autocast, so the KL to it starts from zero), the rollout copy's weights (made from the masters cast back,
`as_loaded`), and the saved transformer/ or policy.safetensors (`as_loaded`: each parameter in the dtype it was
loaded in, so transformer/ is a diffusers checkpoint like the one loaded, modules diffusers keeps in fp32 included).

fp16 is refused (`refuse_fp16`): its 5-bit exponent flushes small gradients to zero unless the loss is scaled, and
difrl has no gradient scaler on every path (FSDP2 is sharded by difrl, not by accelerate's prepare; the masked
trainer calls backward itself; a scaler's state would have to be checkpointed for resume). bf16 has fp32's exponent
range, so it needs no scaling; a GPU without bf16 trains in fp32.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch
from torch import nn

from difrl.train.dist.full_tensors import is_sharded
from difrl.train.dist.sharding import MIXED, frozen_fill, frozen_skeleton, shard

HALF = (torch.bfloat16, torch.float16)


def refuse_fp16(model_dtype: str | None) -> None:
    """Stop a training run that would compute in fp16 without a gradient scaler: model.dtype=fp16, or accelerate's
    mixed_precision fp16 (`accelerate launch --mixed_precision fp16`, read from the environment it sets). A located
    ConfigError naming what to use instead. Call it before anything loads."""
    from difrl.config import ConfigError

    why = ("fp16's 5-bit exponent flushes small gradients to zero without a loss scaler, and difrl trains with none "
           "(bf16 has fp32's range and needs none)")
    if model_dtype in ("fp16", "float16"):
        raise ConfigError(f"config key 'model.dtype' = 'fp16' cannot be trained: {why}. Set model.dtype=bf16 (fp32 "
                          "master weights, bf16 compute: difrl/train/precision.py), or fp32 on a GPU without bf16",
                          "model.dtype")
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "fp16":
        raise ConfigError(f"accelerate's mixed_precision is fp16: {why}. Launch with --mixed_precision bf16 (or 'no' "
                          "and model.dtype=bf16)", "mixed_precision")


@dataclasses.dataclass
class MasterWeights:
    """What `upcast_masters` did: the half dtype the trained network computes in (None: nothing was upcast, it
    computes in its parameters' own dtype) and the dtype each upcast parameter was loaded in, by name."""
    compute_dtype: torch.dtype | None = None
    loaded: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    pending: dict[int, nn.Parameter] = dataclasses.field(default_factory=dict)  # not yet upcast (FSDP: per unit)

    def upcast(self, module: nn.Module) -> None:
        """Make the pending half-precision parameters of `module` fp32 master weights in place (shard's `prepare`:
        one FSDP unit at a time, just before it is sharded; tied parameters once)."""
        with torch.no_grad():
            for p in module.parameters():
                if self.pending.pop(id(p), None) is not None:
                    p.data = p.data.float()

    def fsdp(self, settings):
        """FSDP settings (difrl.train.dist.sharding.FSDPSettings, or None) whose MixedPrecisionPolicy gathers the
        parameters in the compute dtype and reduces gradients in fp32; as given when nothing was upcast (accelerate's
        mixed_precision decides, as before)."""
        if settings is None or self.compute_dtype is None:
            return settings
        name = next(k for k, v in MIXED.items() if v == self.compute_dtype)
        return dataclasses.replace(settings, mixed_precision=name)

    @contextmanager
    def as_loaded(self, module: nn.Module):
        """Inside the block the upcast parameters of `module` hold their values cast back to the dtypes they were
        loaded in (a transient copy; the fp32 masters are put back untouched after it), for saving transformer/ or
        policy.safetensors as the model was loaded, or building the rollout copy from. Under FSDP call it inside
        `gathered`. No forward or optimizer step may run inside."""
        held = []
        for name, p in module.named_parameters():
            dtype = self.loaded.get(name)
            if dtype is not None and p.dtype != dtype:
                held.append((p, p.data))
                p.data = p.data.to(dtype)
        try:
            yield module
        finally:
            for p, master in held:
                p.data = master


def upcast_masters(policy, net: nn.Module, defer: bool = False) -> MasterWeights:
    """Full fine-tuning of a half-precision model (`net`'s trained parameters in bf16): make those parameters fp32
    in place (the master weights; tied parameters stay tied) and have `policy` run its forward under autocast to the
    loaded dtype. Call it after wrap_policy and before shard_policy, make_optimizer and any EMA. A network whose
    trained parameters are all fp32 (LoRA's adapters, an fp32 model) is left exactly as it is. Raises ConfigError for
    fp16 parameters (refuse_fp16) and ValueError for an adapter that cannot autocast (no `autocast_dtype`)."""
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    half = {p.dtype for p in trained.values() if p.dtype in HALF}
    if not half:
        return MasterWeights()
    if torch.float16 in half:
        refuse_fp16("fp16")
    if not hasattr(policy, "autocast_dtype"):
        raise ValueError(f"{type(policy).__name__} trains bf16 parameters but has no autocast_dtype: it cannot "
                         "compute in bf16 from fp32 master weights (difrl/train/precision.py)")
    masters = MasterWeights(torch.bfloat16, {n: p.dtype for n, p in trained.items() if p.dtype in HALF},
                            {id(p): p for p in trained.values() if p.dtype in HALF})
    if not defer:  # `defer`: FSDP upcasts each unit as it shards it (MasterWeights.upcast via trained_network)
        masters.upcast(net)
    policy.autocast_dtype = masters.compute_dtype
    return masters


def trained_network(policy, lora, seed: int, need_reference: bool, settings, device=None):
    """The trained network of `policy`, its frozen reference, master weights and FSDP settings, for both trainers:
    (net, reference, masters, fsdp). Without FSDP (`settings` None): wrap_policy (LoRA, or the reference as a copy),
    upcast_masters, as before. Under FSDP nothing is made whole on the device beyond the model as loaded: the
    reference is built as a meta skeleton and filled and sharded one block at a time, and the master weights are
    upcast one block at a time as each is sharded, so setup holds at most one unsharded fp32 block beyond the shards
    (before: the whole model's fp32 masters and a full reference copy on every GPU before the first shard existed,
    difrl plan's setup_peak_gib)."""
    from difrl.train.scaffold import wrap_policy

    sharded = settings is not None
    net, reference = wrap_policy(policy, lora, seed, need_reference=need_reference and not sharded)
    masters = upcast_masters(policy, net, defer=sharded)
    fsdp = masters.fsdp(settings)
    net, reference = shard_policy(policy, net, reference, fsdp, device, masters=masters,
                                  copy_reference=sharded and need_reference and not lora.enabled)
    return net, reference, masters, fsdp


def shard_policy(policy, net, reference, settings, device=None, masters=None, copy_reference: bool = False):
    """Under FSDP (`settings` from difrl.train.dist.sharding.fsdp_settings; None: nothing to do) shard the trained
    network and the frozen reference of full fine-tuning per transformer block (the adapter's `block_classes`), so
    no process holds either whole: `copy_reference` makes the reference from `net` one block at a time as it shards
    it (frozen_skeleton), and `masters` (a deferred upcast_masters) upcasts each block of `net` as it shards it
    (precision.trained_network). Call before make_optimizer: the optimizer must see the sharded parameters. The
    policy computes on `device` from here on, even if offloaded. Returns (net, reference)."""
    if settings is None:
        return net, reference
    from torch.distributed.fsdp import FSDPModule

    getattr(policy, "set_compute_device", lambda _: None)(device)  # not the parameters' (offload: cpu); models/base.py
    blocks, fp32 = policy.block_classes, getattr(policy, "fsdp_fp32_inputs", ())  # e.g. SD3's timestep
    if copy_reference:  # first, while net's blocks still hold their values as loaded
        reference, source = frozen_skeleton(net)
        reference = shard(reference, blocks, settings, device, fp32, prepare=frozen_fill(source))
        del source  # emptied by the fill: no full tensor of net is held from here while net is sharded
    elif reference is not None:
        reference = shard(reference, blocks, settings, device, fp32)
    net = shard(net, blocks, settings, device, fp32, prepare=None if masters is None else masters.upcast)
    if torch.distributed.get_rank() == 0:
        units = [m for m in net.modules() if isinstance(m, FSDPModule) and m is not net]
        names = sorted({type(m).__mro__[2].__name__ for m in units})  # FSDP<Block> -> (FSDP<Block>, FSDPModule, Block)
        local = sum(p.to_local().numel() for p in net.parameters() if is_sharded(p))
        total = sum(p.numel() for p in net.parameters())
        print(f"difrl: FSDP2 over {torch.distributed.get_world_size()} processes: {len(units) + 1} units ({len(units)} blocks of "
              f"{', '.join(names)} + the root), mixed precision {settings.mixed_precision}"
              f"{'' if settings.reshard_after_forward else ', kept gathered after forward'}"
              f"{', offloaded to the CPU' if settings.offload_params else ''}; "
              f"this process holds {local:,} of the network's {total:,} parameters"
              f"{' (the frozen reference sharded the same way)' if reference is not None else ''}")
    return net, reference
