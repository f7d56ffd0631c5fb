"""Quantized linear layers and module swapping (docs/architecture.md seam 7).

    from difrl.quant import quantize_module, QUANT_PRESETS
    copy = copy.deepcopy(model)
    report = quantize_module(copy, "nvfp4", **QUANT_PRESETS["flux"])   # in place; skip list + min dim
    print(report)                                                        # which layers, which backend, why

Each replaced ``nn.Linear`` becomes one of three backends (``backend``: auto | te | torch | emulate):
- ``te``: a ``TELinear`` (``te.Linear`` under ``te.autocast`` with the format's recipe;
  docs/reference/specs/lowprec-and-correctors.md §2.3-2.5), when Transformer Engine is installed and supports the
  format on this GPU;
- ``torch``: a ``TorchFP8Linear`` for fp8 / fp8_row, ``torch._scaled_mm`` with compiled dynamic activation
  quantization, BF16 out (difrl/quant/torch_fp8.py says why and when);
- ``emulate``: a ``QuantLinear``, the exact pure-torch emulation (W4A4 for NVFP4, W8A8 for the FP8 family,
  ``y = qdq_act(x) @ dequant(W_q).T + b`` with fp32 accumulation; docs/reference/specs/lowprec-and-correctors.md §3).
  Exact, and slower than BF16 on a GPU: it warns once when it runs on one.
``auto`` takes the first of te, torch, emulate that can run the format on the layer's device (torch only on a
CUDA GPU with compute capability >= 8.9; on CPU auto is the emulation). Only linear layers are quantized:
attention, norms, embeddings, convolutions stay in the model's precision, as in Sol-RL
(docs/reference/specs/lowprec-and-correctors.md §1.4).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Collection, Iterable

import torch
from torch import nn

from difrl.quant import formats as F
from difrl.quant import torch_fp8

# Sol-RL's exclusions (docs/reference/specs/lowprec-and-correctors.md §1.4): a layer is skipped if its name contains one
# of `skip`, or if max(in, out) <= min_dim. Wan and digits are ours: embedders and the output projection stay exact.
# The trainer reads a policy's own `quant_preset` (difrl/models/: each adapter class names its entry here).
QUANT_PRESETS: dict[str, dict] = {
    "flux": {"skip": ("x_embedder", "context_embedder", "time_text_embed", "norm_out"), "min_dim": 1000},
    "sd3": {"skip": ("pos_embed", "context_embedder", "time_text_embed", "norm_out", "norm1", "ff_context"), "min_dim": 2432},
    # SANA: Sol-RL's list (t_embedder, t_block, cfg_embedder, y_embedder, x_embedder, final_layer, logvar_linear, attn.qkv;
    # min_dim 2240, NVlabs/Sana configs/sol_rl/sana.py) names its native model, where it quantizes exactly the layers
    # wider than 2240: cross_attn.kv_linear (2240 -> 4480) and the LinearFFN's. In diffusers' names
    # (huggingface/diffusers scripts/convert_sana_to_diffusers.py) time_embed holds t_embedder / t_block / cfg_embedder,
    # caption_projection is y_embedder, patch_embed x_embedder, proj_out final_layer; kv_linear is split into
    # attn2.to_k / to_v (2240 -> 2240 each, which min_dim 2240 would keep exact), so the same layers are chosen by name
    # with min_dim 0: every other projection (attn1.* = attn.qkv and attn.proj, attn2.to_q = q_linear, attn2.to_out =
    # proj) stays exact. The diffusers checkpoint's FFN is convolutions (GLUMBConv), which no preset quantizes (Linear
    # layers only).
    "sana": {"skip": ("time_embed", "caption_projection", "patch_embed", "proj_out", "attn1.", "attn2.to_q",
                      "attn2.to_out"), "min_dim": 0},
    "wan": {"skip": ("patch_embedding", "condition_embedder", "proj_out", "norm_out"), "min_dim": 1000},
    "digits": {"skip": ("x_in", "t_mlp", "x_out"), "min_dim": 0},
    # FLUX.2 [dev] / [klein] (Sol-RL has no FLUX.2 list): FLUX.1's skips under their FLUX.2 names (input projections,
    # timestep / guidance embedding, output norm) plus the global AdaLN modulation linears, which FLUX.2 shares across
    # all blocks (one layer's quantization error would shift every block's scale / shift / gate)
    "flux2": {"skip": ("x_embedder", "context_embedder", "time_guidance_embed", "stream_modulation", "norm_out"),
              "min_dim": 1000},
    # Z-Image (ours: Sol-RL has no Z-Image run): its SD3.5-L rule carried over, the embedders (time, caption, patch),
    # the adaLN modulation and the final layer exact, min_dim = the hidden width (3840): the FFN w1/w2/w3 quantized
    "zimage": {"skip": ("t_embedder", "cap_embedder", "all_x_embedder", "adaLN_modulation", "all_final_layer"),
               "min_dim": 3840},
    # Qwen-Image: Sol-RL has no preset for it; ours, as for Wan: the input embedders (image patches, text, timestep),
    # the text stream's input norm and the output norm / projection stay exact; min_dim as FLUX's
    "qwenimage": {"skip": ("img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out", "proj_out"), "min_dim": 1000},
    # Wan 2.2 TI2V-5B: ours, Wan 2.1's (Sol-RL has no Wan): the patch embedding, the time / text embedder (its time
    # MLP runs per token), the output norm and projection stay exact; the blocks' 3072-wide linears are quantized
    "wan22": {"skip": ("patch_embedding", "condition_embedder", "proj_out", "norm_out"), "min_dim": 1000},
}

BACKENDS = ("auto", "te", "torch", "emulate")


class QuantizationError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------- Transformer Engine


def te_recipe(fmt: str):
    """The TE recipe for a difrl format (imported lazily; raises ImportError without TE)."""
    from transformer_engine.common import recipe as R

    if fmt == "nvfp4":
        return R.NVFP4BlockScaling()  # explicitly: Sol-RL's DelayedScaling(E2M1) is per-tensor E5M2 (§1.4 there)
    if fmt == "mxfp8":
        return R.MXFP8BlockScaling()
    if fmt == "fp8_block":
        return R.Float8BlockScaling()
    if fmt == "fp8":
        return R.Float8CurrentScaling(fp8_format=R.Format.E4M3)
    raise ValueError(f"no Transformer Engine recipe for {fmt!r}")


def te_support(fmt: str, device: torch.device | str | None = None) -> tuple[bool, str]:
    """(usable, why) for running `fmt` through Transformer Engine on this machine."""
    if fmt == "bf16":
        return False, "bf16 needs no Transformer Engine"
    if fmt in ("nvfp4_single", "mxfp8_floor", "fp8_row"):  # TE's NVFP4 is always two-level, its MXFP8 scale
        return False, f"Transformer Engine has no {fmt} recipe"  # rounds up, its FP8 current scaling is per tensor
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or a driver/library error at import (TE issue #3381)
        return False, f"transformer_engine is not importable ({type(e).__name__}: {e}); pip install 'difrl[te]'"
    check = {"fp8": "is_fp8_available", "fp8_block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available",
             "nvfp4": "is_nvfp4_available"}[fmt]
    fn = getattr(te, check, None)
    if fn is None:
        return False, f"this Transformer Engine has no {check} (needs TE >= 2.8 for NVFP4)"
    try:
        res = fn(return_reason=True)
    except TypeError:
        res = fn()
    ok, reason = (res if isinstance(res, tuple) else (bool(res), ""))
    cap = torch.cuda.get_device_capability()
    return bool(ok), (f"Transformer Engine on sm_{cap[0]}{cap[1]}" if ok else f"TE says: {reason or 'unsupported'} (sm_{cap[0]}{cap[1]})")


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """not torch.equal(a, b) for tensors of one shape, as a 0-dim bool tensor (no host read; NaN differs from NaN,
    as in torch.equal)."""
    return (a != b).any()


class TELinear(nn.Module):
    """te.Linear (bf16 parameters) run under te.autocast with the format's recipe; input cast to bf16 and the
    output back to the caller's dtype."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        import transformer_engine.pytorch as te

        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self.recipe = te_recipe(fmt)
        self.inner = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                               params_dtype=torch.bfloat16, device=linear.weight.device)
        self.set_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def set_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Copy in a new weight [out, in] (and bias); True if it changed."""
        return bool(self.update_weight(weight, bias))

    @torch.no_grad()
    def update_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """set_weight without the host read: whether anything changed as a 0-dim bool tensor on the weight's device."""
        new = weight.to(self.inner.weight.dtype)
        changed = differs(self.inner.weight, new)
        self.inner.weight.copy_(new)
        if bias is not None:
            changed = changed | differs(self.inner.bias, bias.to(self.inner.bias.dtype))
            self.inner.bias.copy_(bias)
        return changed

    def state_fingerprint(self) -> torch.Tensor:
        return self.inner.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te

        autocast = getattr(te, "autocast", None)
        ctx = autocast(enabled=True, recipe=self.recipe) if autocast else te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)
        with ctx:
            y = self.inner(x.to(torch.bfloat16))
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------- emulation


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized (buffers hold exactly the packed format: NVFP4 takes
    4.5 bits per weight) and whose input is fake-quantized on every call:
        y = qdq(x, fmt, activation) @ dequantize(W_q).T + b      (fp32 accumulate, output in x's dtype)
    The bias stays in high precision (TE keeps it in the parameter dtype), a frozen parameter as in nn.Linear and
    te.Linear: diffusers reads some submodules' dtype as next(module.parameters()).dtype (Wan's time embedder,
    WanTimeTextImageEmbedding.forward), which would raise StopIteration on a module whose only linears are
    quantized and hold nothing but buffers. A quantized layer without a bias still has no parameter."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        F._check_format(fmt)
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self._keys: list[str] = []
        self.register_parameter("bias", None if linear.bias is None
                                else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        self.set_weight(linear.weight.detach())

    def set_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Re-quantize from a high-precision weight [out, in]; True if the stored codes (or the bias) changed."""
        return bool(self.update_weight(weight, bias))

    @torch.no_grad()
    def update_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """set_weight without the host read (on a GPU one per layer and sync: over 1,000 for FLUX): whether the codes
        or the bias changed, as a 0-dim bool tensor on the weight's device."""
        q = F.quantize(weight, self.fmt, "weight")
        changed = torch.ones((), dtype=torch.bool, device=weight.device)  # the first quantization
        if self._keys:
            changed = torch.stack([differs(getattr(self, "w_" + k), v) for k, v in q.data.items()]).any()
        for k, v in q.data.items():
            if k in self._keys:
                getattr(self, "w_" + k).copy_(v)
            else:
                self.register_buffer("w_" + k, v)
        self._keys = list(q.data)
        if bias is not None:
            changed = changed | differs(self.bias, bias.to(self.bias.dtype))
            self.bias.copy_(bias)
        return changed

    def quantized_weight(self) -> F.Quantized:
        return F.Quantized(self.fmt, "weight", torch.Size((self.out_features, self.in_features)),
                           {k: getattr(self, "w_" + k) for k in self._keys})

    def weight_hat(self) -> torch.Tensor:
        """The dequantized weight [out, in] fp32 (what the emulated GEMM multiplies by)."""
        return F.dequantize(self.quantized_weight())

    def weight_hat_rows(self, start: int, stop: int) -> torch.Tensor:
        """weight_hat()[start:stop] from those rows' stored codes and scales only (start on a scale tile)."""
        tr = F.weight_tile_rows(self.fmt)
        end = start + -(-(stop - start) // tr) * tr  # whole tiles: the stored codes are padded to them
        data = {}
        for k, v in self.quantized_weight().data.items():
            if k == "scales":  # one per tile of tr rows (nvfp4*, fp8_block)
                data[k] = v[start // tr:end // tr] if tr > 1 else v[start:stop]
            elif k in ("codes", "data", "exponents") or (k == "scale_inv" and v.ndim == 2):  # one row per weight row
                data[k] = v[start:end] if tr > 1 else v[start:stop]  # (fp8_row's scale_inv is [out, 1])
            else:  # per-tensor scales
                data[k] = v
        return F.dequantize(F.Quantized(self.fmt, "weight", torch.Size((stop - start, self.in_features)), data))

    def state_fingerprint(self) -> torch.Tensor:
        return self.weight_hat()

    @property
    def weight_nbytes(self) -> int:
        return self.quantized_weight().nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on_cuda(x):
            warn_emulation_on_gpu(self.fmt)
        # exact whatever surrounds it: an autocast (mixed-precision full fine-tuning, difrl.train.precision, or
        # accelerate's) would round the dequantized weight to bf16 inside the matmul (a device without autocast,
        # e.g. `meta`, has none to turn off)
        device = x.device.type
        with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
            y = F.qdq(x, self.fmt, "activation") @ self.weight_hat().T
            if self.bias is not None:
                y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, emulated"


_WARNED_ON_GPU: list[str] = []  # the format the once-per-process warning was given for


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def warn_emulation_on_gpu(fmt: str) -> None:
    """Once per process: the exact emulation ran on a CUDA device, where it is slower than BF16."""
    if _WARNED_ON_GPU:
        return
    _WARNED_ON_GPU.append(fmt)
    warnings.warn(
        f"difrl.quant: the {fmt} layers run the exact pure-torch emulation on a CUDA device. It fake-quantizes every "
        "activation in plain torch and is SLOWER than BF16 (16-21x a BF16 Linear at a FLUX shape on an H200). For a "
        "rollout copy faster than BF16 use rollout.precision=fp8_row (or fp8) with rollout.quant_backend=auto or "
        "torch (torch._scaled_mm, compute capability >= 8.9, no extra install), or install Transformer Engine "
        "(pip install 'difrl[te]') for its fp8 recipes and, on Blackwell, mxfp8 / nvfp4.", RuntimeWarning, stacklevel=3)


class TorchFP8Linear(QuantLinear):
    """QuantLinear's storage (E4M3 weight codes and fp32 scales, re-quantized by set_weight at every sync) run
    through torch._scaled_mm: ``y = bf16(scaled_mm(quantize(x), W_q) + b)`` (difrl.quant.torch_fp8.fp8_linear),
    returned in x's dtype. fmt fp8 (per-tensor scales) or fp8_row (per token x per output channel).
    compile: torch.compile the activation quantization into the GEMM call (None = on a CUDA input).
    fast_accum: Hopper's reduced-precision accumulation (off: fp32 accumulation, the tested tolerance)."""

    def __init__(self, linear: nn.Linear, fmt: str, compile: bool | None = None, fast_accum: bool = False):
        if fmt not in torch_fp8.TORCH_FORMATS:
            raise ValueError(f"the torch-native FP8 backend runs {torch_fp8.TORCH_FORMATS}, not {fmt!r}")
        super().__init__(linear, fmt)
        self.rowwise, self.compile, self.fast_accum = fmt == "fp8_row", compile, fast_accum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiled = x.is_cuda if self.compile is None else self.compile
        fn = torch_fp8.compiled_fp8_linear() if compiled else torch_fp8.fp8_linear
        y = fn(x.reshape(-1, self.in_features), self.w_data, self.w_scale_inv, self.bias, self.rowwise, self.fast_accum)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, torch._scaled_mm "
                f"({'rowwise' if self.rowwise else 'per-tensor'} scales)")


# ---------------------------------------------------------------------------------- swapping


@dataclass
class QuantReport:
    """What `quantize_module` did to each nn.Linear: (name, [out, in], action, why)."""

    fmt: str
    rows: list[tuple[str, tuple[int, int], str, str]] = field(default_factory=list)

    @property
    def quantized(self) -> list[str]:
        return [r[0] for r in self.rows if r[2] != "skipped"]

    @property
    def backends(self) -> dict[str, str]:
        """backend -> why (one line per backend used)."""
        out = {}
        for _, _, action, why in self.rows:
            if action != "skipped":
                out.setdefault(action, why)
        return out

    def summary(self) -> str:
        if self.fmt == "fp32":
            return "fp32: an exact copy, nothing quantized"
        n = len(self.quantized)
        parts = [f"{self.fmt}: {n} of {len(self.rows)} linear layers quantized"]
        parts += [f"{k} ({v})" for k, v in self.backends.items()]
        skipped = [r for r in self.rows if r[2] == "skipped"]
        if skipped:
            parts.append(f"{len(skipped)} kept in high precision")
        return "; ".join(parts)

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  {name:40s} {str(list(shape)):14s} {action:8s} {why}" for name, shape, action, why in self.rows]
        return "\n".join(lines)


def _device_of(linear: nn.Linear | None) -> torch.device:
    """Where the layer will run: its weight's device (a rollout copy is built on the policy's device)."""
    if linear is not None:
        return linear.weight.device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def choose_backend(fmt: str, requested: str = "auto", linear: nn.Linear | None = None) -> tuple[str, str]:
    """('te' | 'torch' | 'emulate', why) for `fmt` on `linear`'s device (without a layer: the current CUDA
    device if there is one). 'auto' takes Transformer Engine where it imports and supports the format, else the
    torch-native FP8 backend (fp8 / fp8_row on CUDA sm >= 8.9), else the exact emulation, and says why; 'te' or
    'torch' requested and unusable is a QuantizationError ('torch' is allowed on any device, e.g. CPU tests)."""
    if requested not in BACKENDS:
        raise ValueError(f"quant backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "emulate":
        return "emulate", "exact pure-torch emulation (requested)"
    te_why = ""
    if requested in ("auto", "te"):
        ok, te_why = te_support(fmt)
        if ok and linear is not None:
            mult = 128 if fmt == "fp8_block" else 32 if fmt == "mxfp8" else 16
            if linear.in_features % mult or linear.out_features % mult:
                ok, te_why = False, f"TE needs both GEMM dims divisible by {mult}"
        if ok:
            return "te", te_why
        if requested == "te":
            raise QuantizationError(f"quant backend 'te' was requested for {fmt} but cannot be used: {te_why}")
    dims = None if linear is None else (linear.out_features, linear.in_features)
    device = _device_of(linear)
    ok, torch_why = torch_fp8.torch_fp8_support(fmt, device, dims)
    if requested == "torch":  # on CPU too (a slow reference: what the tests run); on a GPU only where it is fast
        if fmt not in torch_fp8.TORCH_FORMATS or (device.type == "cuda" and not ok):
            raise QuantizationError(f"quant backend 'torch' was requested for {fmt} but cannot be used: {torch_why}")
        return "torch", torch_why if ok else f"torch._scaled_mm on {device.type} (requested; a reference, not fast here)"
    if ok:
        return "torch", f"{torch_why} (Transformer Engine: {te_why})"
    return "emulate", f"exact pure-torch emulation: Transformer Engine: {te_why}; torch-native: {torch_why}"


def quantize_module(module: nn.Module, fmt: str, skip: Iterable[str] = (), min_dim: int = 0,
                    backend: str = "auto", only: Collection[str] | None = None) -> QuantReport:
    """Replace the nn.Linear layers of `module` in place (call it on a copy). A layer is skipped when its
    qualified name contains any `skip` substring or max(in, out) <= min_dim. `only`: the qualified names of the
    layers to look at (a copy built one part at a time); None: all."""
    F._check_format(fmt)
    skip = tuple(skip)
    report = QuantReport(fmt)
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear) or (only is not None and name not in only):
            continue
        shape = (child.out_features, child.in_features)
        hit = next((s for s in skip if s in name), None)
        if hit is not None:
            report.rows.append((name, shape, "skipped", f"name matches {hit!r}"))
            continue
        if max(shape) <= min_dim:
            report.rows.append((name, shape, "skipped", f"max(in, out) = {max(shape)} <= min_dim {min_dim}"))
            continue
        kind, why = ("emulate", "a cast") if fmt == "bf16" else choose_backend(fmt, backend, child)
        new = {"te": TELinear, "torch": TorchFP8Linear, "emulate": QuantLinear}[kind](child, fmt)
        _set_submodule(module, name, new)
        report.rows.append((name, shape, kind, why))
    return report


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def quantized_layers(module: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, (QuantLinear, TELinear))}


def storage_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (a quantized copy's real footprint)."""
    tensors = list(module.parameters()) + [b for b in module.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)
