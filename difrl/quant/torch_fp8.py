"""The torch-native FP8 GEMM of the rollout copy: E4M3 weights quantized once per sync, activations quantized
dynamically and fed straight into ``torch._scaled_mm``, BF16 out. No Transformer Engine needed.

    from difrl.quant import quantize_module
    report = quantize_module(copy, "fp8_row", backend="torch")     # or backend="auto" on a GPU with sm >= 8.9
    y = fp8_linear(x2d, w_q, w_scale_inv, bias, rowwise=True)     # the function each TorchFP8Linear calls

What it computes, for x [M, K] and a weight W [N, K] stored as E4M3 codes w_q and dequantization scales s_w
(one per tensor for ``fp8``, one per output channel [N, 1] for ``fp8_row``; difrl.quant.formats):
    c = 448 / amax(x) (per tensor, or per row of x), x_q = e4m3(x * c), s_x = 1 / c   (formats._fp8_tensor / _fp8_rows)
    y   = bf16( s_x s_w^T * (x_q @ w_q^T) + b )          one torch._scaled_mm call, fp32 accumulation
The emulation (QuantLinear) computes bf16-free ``qdq(x) @ dequant(W_q)^T + b`` from the same codes and scales,
so the two differ only by fp32 rounding (each side accumulates K products in its own order) and by BF16
rounding (the bias going in, the output coming out): elementwise
    |y - y_emul| <= 2^-8 (|y_emul| + |b|) + 2 (K + 4) 2^-24 (|x_hat| @ |w_hat|^T + |b|) (1 + 2^-7)
(``accumulation_tolerance``; tests/test_quant.py checks it per-tensor and rowwise, and that it is tight enough
to reject the other granularity or an unquantized activation).

Why this and not torchao's float8 inference workflow (``Float8DynamicActivationFloat8WeightConfig`` with
``PerTensor`` / ``PerRow``), read at torchao 0.18 (torchao/quantization/quantize_/workflows/float8/):
- Same kernel. Without the optional mslk package torchao's Float8Tensor linear ends in ``torch._scaled_mm``
  with the same per-tensor or rowwise scales; the activation quantization is fused only when the model is
  torch.compile'd. What torchao adds is a tensor subclass around the weight, not a faster GEMM.
- The rollout copy re-quantizes after every optimizer step and then verifies every layer against the policy
  (difrl/quant/sync.py). Here the weight lives in plain buffers (``w_data`` E4M3 [N, K], ``w_scale_inv``)
  filled by ``difrl.quant.formats.quantize``, exactly what the exact emulation stores, so a sync is an in-place
  ``copy_`` (no new tensors, nothing for torch.compile to re-trace) and verification is bit-for-bit against
  the format. A tensor subclass would be rebuilt per sync and checked through torchao's internal layout.
- torchao is an optional package and its default ``Float8MMConfig`` turns on ``use_fast_accum`` (Hopper's
  reduced-precision tensor-core accumulation); we default to fp32 accumulation so the stated tolerance against
  the emulation holds; ``fast_accum=True`` is there for measurement.
- ``torch._scaled_mm`` is in torch itself and runs on CPU (per-tensor and rowwise; fp8 e4m3 in, bf16 out),
  so these numerics are tested in CPU CI.
The activation quantize + GEMM is one function, compiled with ``torch.compile(dynamic=True)`` on CUDA: inductor
fuses the amax reduction and the scale-and-cast into one kernel for rowwise scales (two for per-tensor: a global
amax must finish first), which is what makes FP8 pay off (unfused quantization ate the GEMM's 1.7x on an H200,
docs/reference/specs/gpu-regime.md). Rowwise (``fp8_row``) is the recommended candidate format: the better fusion and
the smaller error. On CPU it runs eagerly (a reference: it is not faster than the emulation there).

Device rule (``rollout.quant_backend: auto``): this backend is chosen for fp8 / fp8_row when the layer lives on
a CUDA device of compute capability >= 8.9 (Ada, Hopper, Blackwell: FP8 tensor cores) and both GEMM dims are
multiples of 16 (cuBLASLt's FP8 requirement). It is never auto-chosen on CPU (the exact emulation stays the
default there); ``backend="torch"`` forces it on any device. MXFP8 / NVFP4 are not run here: on Blackwell
they go through Transformer Engine when installed, otherwise (and on Hopper, which has no MX / FP4 tensor
cores) they are emulated, and the reason says so.
"""

from __future__ import annotations

import torch

from difrl.quant import formats as F

TORCH_FORMATS = ("fp8", "fp8_row")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
DIM_MULTIPLE = 16  # cuBLASLt FP8 GEMMs need K and N divisible by 16


def fp8_linear(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None,
               rowwise: bool, fast_accum: bool = False) -> torch.Tensor:
    """y [M, N] bf16 = quantize(x [M, K]) @ W_q^T scaled, + bias. w_data: E4M3 [N, K] (row-major; its .t() is
    the column-major operand _scaled_mm wants), w_scale_inv: fp32 [1] (fp8) or [N, 1] (fp8_row) dequantization
    scales. The activation is quantized exactly as formats.qdq(x, fmt) does."""
    if rowwise:
        x_q, x_scale_inv = F._fp8_rows(x)  # [M, K] e4m3, [M, 1] fp32
        w_scale = w_scale_inv.view(1, -1)  # [N, 1] contiguous -> [1, N]
    else:
        x_q, x_scale_inv = F._fp8_tensor(x, torch.float8_e4m3fn)  # [M, K], [] fp32
        w_scale = w_scale_inv.reshape(())
    # cuBLASLt's FP8 GEMM takes the first operand row-major only; x_q has x's strides (a transposed view stays
    # column-major through the elementwise quantization), so it is made contiguous: free when it already is
    return torch._scaled_mm(x_q.contiguous(), w_data.t(), scale_a=x_scale_inv, scale_b=w_scale,
                            bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def accumulation_tolerance(x_hat: torch.Tensor, w_hat: torch.Tensor, bias: torch.Tensor | None,
                           y_emul: torch.Tensor) -> torch.Tensor:
    """The elementwise bound on |fp8_linear(x) - y_emul| stated in the module docstring: x_hat [.., K] and w_hat
    [N, K] the dequantized operands (fp32), y_emul = x_hat @ w_hat^T + b in fp32. u_bf16 = 2^-8, u_fp32 = 2^-24."""
    b = torch.zeros(()) if bias is None else bias.detach().float().abs()
    s = x_hat.abs() @ w_hat.abs().T + b  # sum |x_k w_k| (+ |b|): what fp32 rounding errors scale with
    K = x_hat.shape[-1]
    return 2.0 ** -8 * (y_emul.abs() + b) + 2 * (K + 4) * 2.0 ** -24 * s * (1 + 2.0 ** -7)


_COMPILED = []


def compiled_fp8_linear():
    """fp8_linear under torch.compile (built once per process; dynamic shapes, so every layer shares it)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(fp8_linear, dynamic=True))
    return _COMPILED[0]


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def torch_fp8_support(fmt: str, device: torch.device, dims: tuple[int, int] | None = None) -> tuple[bool, str]:
    """(fast here, why) for running `fmt` through torch._scaled_mm on `device`; dims = (out, in) of the layer.
    True only for fp8 / fp8_row on a CUDA device of compute capability >= 8.9 (the module docstring's rule)."""
    cap = cuda_capability(device)
    if cap is None:
        return False, f"no CUDA device ({device.type})"
    where = f"sm_{cap[0]}{cap[1]}"
    if fmt in ("mxfp8", "mxfp8_floor", "nvfp4", "nvfp4_single"):
        if cap is not None and cap[0] >= 10:
            return False, (f"{fmt} has native tensor cores on {where} but difrl runs them only through Transformer "
                           "Engine (pip install 'difrl[te]'); its torch-native backend covers fp8 / fp8_row")
        return False, (f"{fmt} has no native kernel on {where} (MXFP8 / NVFP4 tensor cores need Blackwell, sm_100+), so "
                       "it is emulated and slower than BF16; fp8_row (or fp8) with the torch backend is the fast "
                       "candidate format on an FP8 GPU (sm >= 8.9)")
    if fmt not in TORCH_FORMATS:
        return False, f"the torch-native backend runs {TORCH_FORMATS} only, not {fmt}"
    if cap < MIN_CAPABILITY:
        return False, f"{where} has no FP8 tensor cores (torch._scaled_mm needs compute capability >= 8.9)"
    if dims is not None and (dims[0] % DIM_MULTIPLE or dims[1] % DIM_MULTIPLE):
        return False, f"FP8 GEMMs need both dims divisible by {DIM_MULTIPLE}, this layer is {list(dims)}"
    return True, f"torch._scaled_mm on {where}, activation quantization compiled into its input"
