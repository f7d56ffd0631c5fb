"""The adapter table: diffusers model kind -> its adapter class (one family file each), and the loader.

    from difrl.models.adapters import ADAPTERS, load_flow_policy
    policy = load_flow_policy("sd3", "/models/sd3.5-medium", dtype="fp16", height=512, width=512)
    path = make_tiny_pipeline("flux", tmp_dir / "flux")   # a tiny random pipeline directory for tests

A new diffusers model is one family file in difrl/models/ and one line here (docs/adding-a-model.md). The
model kinds the flow trainer accepts (difrl.worlds.FLOW_KINDS), the tiny test pipelines
(difrl/models/tiny.py) and the quantization presets (each class's `quant_preset`) all come from this
table. Importing it does not import diffusers or transformers: the family files import them where used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difrl.models.diffusers_base import DiffusersFlowPolicy
from difrl.models.flux import FluxPolicy
from difrl.models.sd3 import SD3Policy
from difrl.models.wan import WanPolicy

ADAPTERS: dict[str, type[DiffusersFlowPolicy]] = {"flux": FluxPolicy, "sd3": SD3Policy, "wan": WanPolicy}


def load_flow_policy(kind: str, path: str | Path, **options) -> DiffusersFlowPolicy:
    """The adapter for model `kind` (a key of ADAPTERS) loaded from the local pipeline directory `path`.
    Options go to the adapter's from_pretrained (dtype, height, width, num_frames, device, ...)."""
    if kind not in ADAPTERS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(ADAPTERS)}")
    return ADAPTERS[kind].from_pretrained(path, **options)


# ---- tiny test pipelines (each family's `tiny_pipeline`, from the parts in difrl/models/tiny.py) ----------
def arch_flow_policy(kind: str, path: str | Path, **options) -> DiffusersFlowPolicy:
    """The adapter for model `kind` over a pipeline built from the architecture configs in `path` (no weights read;
    difrl.models.arch), with load_flow_policy's options: what difrl plan simulates under FakeTensorMode. The adapter
    class's `fp32_components` (Wan's VAE) are made in fp32, as its from_pretrained loads them."""
    from difrl.models.arch import build_arch_pipeline
    from difrl.models.diffusers_base import as_dtype

    if kind not in ADAPTERS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(ADAPTERS)}")
    cls = ADAPTERS[kind]
    dtype = as_dtype(options.pop("dtype", "fp32"))
    device = options.pop("device", None)
    pipe = build_arch_pipeline(path, dtype, {name: torch.float32 for name in cls.fp32_components})
    if device is not None:
        pipe.to(device)
    return cls(pipe, **options)


def build_tiny_pipeline(kind: str, seed: int = 0):
    """The tiny pipeline object for `kind` (a key of ADAPTERS), in memory, eval mode, fp32."""
    if kind not in ADAPTERS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {tuple(ADAPTERS)}")
    torch.manual_seed(seed)
    pipe = ADAPTERS[kind].tiny_pipeline()
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            comp.eval()  # models built directly are in train mode (T5 dropout: ecosystem.md §1.1)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_tiny_pipeline(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny `kind` pipeline with weights drawn from `seed` and save it to `out_dir` (a
    diffusers pipeline directory: model_index.json plus one folder per component). Returns the path."""
    out_dir = Path(out_dir)
    pipe = build_tiny_pipeline(kind, seed)
    pipe.save_pretrained(out_dir)
    return out_dir
