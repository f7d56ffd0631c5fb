"""Time a quantized rollout copy's forward against the model's own (BF16) forward: the measurement behind
`benchmarks/bench_quant.py --gpu`, importable for other benchmarks.

    from difrl.quant.timing import time_rollout_copy
    row = time_rollout_copy(transformer, {"hidden_states": x, "encoder_hidden_states": c, ...}, "fp8_row",
                            backend="auto", skip=QUANT_PRESETS["sd3"]["skip"], min_dim=0)
    row["speedup"], row["backends"], row["rel_err"]        # BF16 ms / copy ms; which backend ran, and why

The copy is built exactly as the trainer builds it (``RolloutCopy``: deep copy, linear layers swapped by
``quantize_module``, weights synced and verified), so the report says which layers run on which backend.
Times are medians of `repeats` calls after `warmup` calls (CUDA events on a GPU, wall clock elsewhere);
the warm-up also absorbs torch.compile's tracing of the torch-native FP8 backend.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from difrl.quant.formats import cosine, relative_error
from difrl.quant.sync import RolloutCopy


@torch.no_grad()
def time_ms(fn: Callable[[], Any], warmup: int, repeats: int, device: torch.device | str) -> list[float]:
    """Per-call milliseconds of fn(): CUDA events on a CUDA device, wall clock elsewhere."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def first_tensor(out: Any) -> torch.Tensor:
    """The output tensor of a forward (a tensor, a tuple's first item, or a diffusers output's .sample)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    return first_tensor(out.sample)


@torch.no_grad()
def time_rollout_copy(module: nn.Module, inputs: dict[str, Any], fmt: str, backend: str = "auto", skip=(),
                      min_dim: int = 0, warmup: int = 3, repeats: int = 10, baseline_ms: float | None = None) -> dict:
    """Median forward ms of `module(**inputs)` (the reference: the module in its own dtype, BF16 on a GPU) and of
    a `RolloutCopy(module, fmt, skip, min_dim, backend)` on the same inputs, and the copy's output error.

    Returns {format, backend (requested), backends ({backend: why} of the quantized layers), quantized ("n/m"
    linear layers), ms_ref, ms_copy, speedup (= ms_ref / ms_copy), rel_err and cosine of the copy's output
    against the reference output, report (the copy's one-line summary)}. Pass `baseline_ms` to reuse a
    reference time measured before (the reference is then run once, for the error only). The copy is freed
    before returning; a format/backend that cannot run raises QuantizationError from quantize_module."""
    device = next(module.parameters()).device
    module.eval()
    y_ref = first_tensor(module(**inputs)).float()
    ms_ref = baseline_ms if baseline_ms is not None else statistics.median(
        time_ms(lambda: module(**inputs), warmup, repeats, device))
    copy = RolloutCopy(module, fmt, skip, min_dim, backend)
    try:
        y = first_tensor(copy.module(**inputs)).float()
        ms = statistics.median(time_ms(lambda: copy.module(**inputs), warmup, repeats, device))
        return {"format": fmt, "backend": backend, "backends": copy.report.backends,
                "quantized": f"{len(copy.report.quantized)}/{len(copy.report.rows)}", "ms_ref": ms_ref, "ms_copy": ms,
                "speedup": ms_ref / ms, "rel_err": relative_error(y_ref, y), "cosine": cosine(y_ref, y),
                "report": copy.report.summary()}
    finally:
        del copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
