"""Weight rounding for injected low-precision rollout copies (pure torch: the LLM side uses it too).

    with rounded_weights(model, "fp8_e4m3"):      # every weight matrix rounded to FP8 E4M3, restored on exit
        rollout = sample(model)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

ROUNDING_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@contextmanager
def rounded_weights(module: torch.nn.Module, weight_dtype: str):
    """Temporarily round every weight matrix of `module` to `weight_dtype` and back to fp32 (round to nearest
    by a dtype cast, no scaling: a stand-in for a low-precision rollout copy; issue 5 adds scaled formats).
    Restores the exact fp32 weights on exit, whatever happens inside."""
    if weight_dtype == "fp32":
        yield
        return
    dtype = ROUNDING_DTYPES[weight_dtype]
    saved = []
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2 and p.is_floating_point():
                saved.append((p, p.data))
                p.data = p.data.to(dtype).to(p.dtype)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data
