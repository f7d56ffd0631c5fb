"""The flow-policy adapter protocol (docs/architecture.md seam 1) and helpers for conditioning batches.

    policy = DigitsPolicy.from_checkpoint(path)       # any FlowPolicy
    cond = policy.encode(["a handwritten 3"] * 4)     # dict of [B, ...] tensors
    v = policy.velocity(x, sigma, cond, guidance=1.0) # x: [B, *latent_shape], sigma: [B]
    images = policy.decode(x)                         # [B, C, H, W] in [0, 1]

Everything model-specific (prompt encoding, timestep scaling, packing, classifier-free guidance)
lives behind this protocol; samplers, the rollout engine and the trainer only see tensors.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

import torch
from torch import nn

Cond = dict[str, torch.Tensor]
# quantize_module's keyword arguments for a policy's low-precision rollout copy (difrl.quant): a layer is
# skipped if its name contains one of `skip` or if max(in, out) <= min_dim; this default quantizes every linear
DEFAULT_QUANT_PRESET: dict = {"skip": (), "min_dim": 0}


@runtime_checkable
class FlowPolicy(Protocol):
    """What a flow-matching model must provide to be trained by difrl."""

    latent_shape: tuple[int, ...]  # one sample's latent, e.g. (64,) or (16, 64, 64)
    lora_target_modules: list[str]  # module-name suffixes peft wraps with LoRA
    quant_preset: dict = DEFAULT_QUANT_PRESET  # {"skip": (...), "min_dim": n} for quantize_module / RolloutCopy

    @property
    def module(self) -> nn.Module:
        """The trainable network (LoRA is injected into it; its parameters are optimised)."""

    def encode(self, prompts: list[str]) -> Cond:
        """Prompts -> conditioning tensors with batch dim first. Raises ValueError on a prompt it cannot read."""

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float = 1.0) -> torch.Tensor:
        """Predicted velocity v = eps - x0 at noise level sigma ([B]); returns fp32 [B, *latent_shape]."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images (or videos) in [0, 1], fp32."""


class ComputeDevice:
    """The device a policy's forward computes on (``policy.device``): the one the trainer fixed when it placed or
    sharded the network (``set_compute_device(accelerator.device)``, difrl.train.scaffold.shard_policy), else where
    the network's first parameter is (a policy used as loaded). Not read from the parameters once fixed: under FSDP2
    with CPU offload a parameter is a DTensor whose ``.device`` is its local shard's, the CPU, while every forward
    runs on the GPU (the shards are copied there before each all-gather), so noise, rollouts, losses and the
    autocast context would go to the host."""

    _compute_device: torch.device | None = None

    @property
    def device(self) -> torch.device:
        if self._compute_device is not None:
            return self._compute_device
        param = next(iter(self.module.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    def set_compute_device(self, device: torch.device | str | None) -> None:
        """Fix the compute device (None: back to the parameters' device). Moves nothing. A CPU device is plain
        `cpu`, as CPU tensors report it (accelerate's multi-process CPU device is "cpu:0")."""
        device = None if device is None else torch.device(device)
        self._compute_device = torch.device("cpu") if device is not None and device.type == "cpu" else device


class HoldsNet(ComputeDevice):
    """The `module` property of a policy that keeps its network in ``self.net``; peft, accelerate and the
    trainer's reference swap set it, so the wrapped network replaces the plain one."""

    net: nn.Module

    @property
    def module(self) -> nn.Module:
        return self.net

    @module.setter
    def module(self, m: nn.Module) -> None:
        self.net = m


def forwards_per_step(policy, guidance: float) -> int:
    """Network evaluations of one velocity call at `guidance` (for the trainer's NFE counts): the adapter's own count
    (`policy.forwards_per_step`: diffusers pipelines do classifier-free guidance only for guidance > 1, and FLUX's
    guidance is embedded, one forward whatever its value), else 2 for a guidance other than 1 (the bundled worlds'
    CFG: one batched pass over [uncond; cond]) and 1 otherwise."""
    own = getattr(policy, "forwards_per_step", None)
    return int(own(guidance)) if callable(own) else (2 if guidance != 1.0 else 1)


def policy_device(policy) -> torch.device:
    """The device the policy computes on: an adapter's own ``device`` (ComputeDevice: the one the trainer fixed),
    else its network's first parameter's; the CPU for a parameter-free stub. Rollouts keep every per-step tensor here
    (docs/architecture.md, Many processes: a trajectory stays on the policy's device until it is done)."""
    dev = getattr(policy, "device", None)
    if dev is not None:
        return torch.device(dev)
    param = next(iter(policy.module.parameters()), None) if hasattr(policy, "module") else None
    return param.device if param is not None else torch.device("cpu")


def autocast_to(dtype: torch.dtype | None, device) -> AbstractContextManager:
    """The context an adapter runs its network's forward in: torch.autocast to `dtype` on `device`'s type when the
    trained network holds fp32 master weights and computes in `dtype` (an adapter's ``autocast_dtype``, set by
    difrl.train.precision), else nothing, so a network used as loaded (LoRA, fp32, inference) computes as before."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def cond_select(cond: Cond, index: torch.Tensor | slice) -> Cond:
    """Rows `index` of every conditioning tensor."""
    return {k: v[index] for k, v in cond.items()}


def cond_repeat(cond: Cond, times: int) -> Cond:
    """Repeat every row `times` times, row-major: [c0, c0, ..., c1, c1, ...] (one per trained step)."""
    return {k: v.repeat_interleave(times, dim=0) for k, v in cond.items()}


def cond_cat(conds: list[Cond]) -> Cond:
    return {k: torch.cat([c[k] for c in conds], dim=0) for k in conds[0]}
