"""The adapter table: diffusers model kind -> its adapter class (one family file each), its registration hook and
the loader.

    from difrl.models.adapters import ADAPTERS, load_flow_policy
    policy = load_flow_policy("sd3", "/models/sd3.5-medium", dtype="bf16", height=512, width=512)
    path = make_tiny_pipeline("flux", tmp_dir / "flux")   # a tiny random pipeline directory for tests

    from difrl.models import register_model               # a family from outside difrl (docs/guides/adding-a-model.md)
    @register_model("mykind")
    class MyPolicy(DiffusersFlowPolicy): ...

A new diffusers model is one family file in difrl/models/ and one line in BUILTIN_ADAPTERS, or, from a package outside
difrl, a class registered with `@register_model(kind)` and named under the `difrl.models` entry-point group, so that
`difrl train` finds it without importing it first::

    [project.entry-points."difrl.models"]
    mykind = "mypackage.family:MyPolicy"

`model_kinds()` lists every kind (the built-in ones, the registered ones, the entry points' names: nothing is
imported to list them); `adapter_class(kind)` imports an entry point's module only when its kind is asked for. The
model kinds the flow trainer accepts (difrl.worlds.flow_kinds), the tiny test pipelines (difrl/models/tiny.py) and
the quantization presets (each class's `quant_preset`) all come from here. Importing this file does not import
diffusers or transformers: the family files import them where used.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path

import torch

from difrl.models.diffusers_base import DiffusersFlowPolicy
from difrl.models.flux import FluxPolicy
from difrl.models.flux2 import Flux2KleinPolicy, Flux2Policy
from difrl.models.qwenimage import QwenImagePolicy
from difrl.models.qwenimage_edit import QwenImageEditPolicy
from difrl.models.sana import SanaPolicy
from difrl.models.sd3 import SD3Policy
from difrl.models.wan import WanPolicy
from difrl.models.wan22 import Wan22Policy
from difrl.models.zimage import ZImagePolicy

BUILTIN_ADAPTERS: dict[str, type[DiffusersFlowPolicy]] = {"flux": FluxPolicy, "sd3": SD3Policy, "wan": WanPolicy,
                                                       "sana": SanaPolicy, "flux2": Flux2Policy,
                                                       "flux2_klein": Flux2KleinPolicy, "zimage": ZImagePolicy,
                                                       "qwenimage": QwenImagePolicy, "wan22": Wan22Policy,
                                                       "qwenimage_edit": QwenImageEditPolicy}
# every kind known in this process: the built-in ones, then those registered (@register_model, a loaded entry point)
ADAPTERS: dict[str, type[DiffusersFlowPolicy]] = dict(BUILTIN_ADAPTERS)
ENTRY_POINT_GROUP = "difrl.models"
HOW_TO_ADD = ("a new model family is a DiffusersFlowPolicy subclass registered with @difrl.models.register_model(kind) "
              f"and, from a package outside difrl, named under the {ENTRY_POINT_GROUP!r} entry-point group "
              "(docs/guides/adding-a-model.md)")
# the hooks a family defines itself (the base class has no usable default); block_classes: FSDP wraps these blocks
_NEEDED = ("_encode_batch", "_forward", "_vae_latents", "from_pretrained", "tiny_pipeline")


def register_model(kind: str):
    """Class decorator adding an adapter class (a DiffusersFlowPolicy subclass) to ADAPTERS under `kind`, which
    becomes its `kind` (the config's model.kind, the kind its LoRA directories record). Refuses a class that lacks a
    hook or a class attribute the trainer needs, and a kind already taken by another class."""
    def deco(cls):
        problems = check_adapter_class(cls)
        if problems:
            raise TypeError(f"@register_model({kind!r}) on {cls.__module__}.{cls.__qualname__}: " + "; ".join(problems)
                            + " (docs/guides/adding-a-model.md lists each)")
        held = ADAPTERS.get(kind)
        if held is not None and held is not cls and f"{held.__module__}.{held.__qualname__}" != \
                f"{cls.__module__}.{cls.__qualname__}":  # the same class re-imported (a module run twice) is no clash
            raise ValueError(f"model kind {kind!r} is already {held.__module__}.{held.__qualname__}; register "
                             f"{cls.__qualname__} under another kind")
        if cls.__dict__.get("kind") not in (None, "", kind):  # its own kind, not one inherited from the family it extends
            raise ValueError(f"{cls.__qualname__}.kind = {cls.kind!r} but @register_model names {kind!r}; set one")
        cls.kind = kind
        ADAPTERS[kind] = cls
        return cls
    return deco


def check_adapter_class(cls) -> list[str]:
    """What `cls` lacks to be a model family: each problem as a phrase (empty when none)."""
    if not (isinstance(cls, type) and issubclass(cls, DiffusersFlowPolicy)):
        return [f"{cls!r} is not a subclass of difrl.models.diffusers_base.DiffusersFlowPolicy"]
    problems = [f"no {name}()" for name in _NEEDED
                if getattr(cls, name, None) is getattr(DiffusersFlowPolicy, name, None)]
    for attr in ("pipeline_class", "required_components", "block_classes"):
        if not getattr(cls, attr):
            problems.append(f"empty {attr}" + (" (FSDP shards the transformer by these blocks)"
                                               if attr == "block_classes" else ""))
    if not cls.accepted_classes:
        problems.append("empty accepted_classes (the model_index.json _class_name values it loads)")
    return problems


@lru_cache(maxsize=1)
def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def model_kinds() -> tuple[str, ...]:
    """Every diffusers model kind: ADAPTERS' keys, then the entry points' names not yet loaded (none imported)."""
    return (*ADAPTERS, *sorted(k for k in _entry_points() if k not in ADAPTERS))


def unknown_model_kind(kind: str) -> str | None:
    """Why `kind` names no model family (the known ones, a near miss, how to add one); None when it does."""
    import difflib

    known = model_kinds()
    if kind in known:
        return None
    close = difflib.get_close_matches(str(kind), known, n=1, cutoff=0.6)
    return (f"unknown model kind {kind!r}; " + (f"did you mean {close[0]!r}? " if close else "")
            + f"known: {', '.join(known)}; {HOW_TO_ADD}")


def adapter_class(kind: str) -> type[DiffusersFlowPolicy]:
    """The adapter class of `kind`: from ADAPTERS, else its entry point's object, imported now (a class, registered
    under the entry point's name unless its module registered it). Unknown: ValueError naming the known kinds."""
    if kind in ADAPTERS:
        return ADAPTERS[kind]
    ep = _entry_points().get(kind)
    if ep is None:
        raise ValueError(unknown_model_kind(kind))
    obj = ep.load()
    if kind not in ADAPTERS:
        if not isinstance(obj, type):
            raise TypeError(f"entry point {kind} = {ep.value!r} ({ENTRY_POINT_GROUP!r} group) is "
                            f"{type(obj).__name__}, not an adapter class, and registered no kind {kind!r}")
        register_model(kind)(obj)
    return ADAPTERS[kind]


def load_flow_policy(kind: str, path: str | Path, **options) -> DiffusersFlowPolicy:
    """The adapter for model `kind` (one of model_kinds()) loaded from the local pipeline directory `path`.
    Options go to the adapter's from_pretrained (dtype, height, width, num_frames, device, ...), except
    `offload_text_encoders` (model.offload_text_encoders): the text encoders then stay on the CPU, never loaded onto
    the device, and visit it only while embedding (DiffusersFlowPolicy.offload_text_encoders)."""
    from difrl.models.offload import TEXT_ENCODERS_HOME, text_encoders_kept_on

    home = TEXT_ENCODERS_HOME if options.pop("offload_text_encoders", False) else None
    with text_encoders_kept_on(home):
        policy = adapter_class(kind).from_pretrained(path, **options)
    if home is not None:
        policy.offload_text_encoders(home)
    return policy


# ---- tiny test pipelines (each family's `tiny_pipeline`, from the parts in difrl/models/tiny.py) ----------
def arch_flow_policy(kind: str, path: str | Path, **options) -> DiffusersFlowPolicy:
    """The adapter for model `kind` over a pipeline built from the architecture configs in `path` (no weights read;
    difrl.models.arch), with load_flow_policy's options: what difrl plan simulates under FakeTensorMode. The adapter
    class's `fp32_components` (Wan's VAE) are made in fp32, as its from_pretrained loads them. With
    `offload_text_encoders` the text encoders are made on `text_encoders_home` (difrl plan: "meta", the simulated
    host, whose bytes no GPU holds) and offloaded there."""
    from difrl.models.arch import build_arch_pipeline
    from difrl.models.diffusers_base import as_dtype
    from difrl.models.offload import TEXT_ENCODERS_HOME, is_text_encoder

    cls = adapter_class(kind)
    dtype = as_dtype(options.pop("dtype", "fp32"))
    device = options.pop("device", None)
    home = options.pop("text_encoders_home", TEXT_ENCODERS_HOME)
    home = torch.device(home) if options.pop("offload_text_encoders", False) else None
    pipe = build_arch_pipeline(path, dtype, {name: torch.float32 for name in cls.fp32_components},
                               text_encoders_device=home)
    if device is not None:
        for name, comp in pipe.components.items():
            if isinstance(comp, torch.nn.Module) and not (home is not None and is_text_encoder(name)):
                comp.to(device)
    policy = cls(pipe, **options)
    if home is not None:
        policy.offload_text_encoders(home)
    return policy


def build_tiny_pipeline(kind: str, seed: int = 0, **options):
    """The tiny pipeline object for `kind` (one of model_kinds()), in memory, eval mode, fp32; `options` go to the
    family's tiny_pipeline (SD3: variant="sd3.5-medium")."""
    cls = adapter_class(kind)
    torch.manual_seed(seed)
    pipe = cls.tiny_pipeline(**options)
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            comp.eval()  # models built directly are in train mode (T5 dropout: docs/reference/specs/ecosystem.md §1.1)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_tiny_pipeline(kind: str, out_dir: str | Path, seed: int = 0, **options) -> Path:
    """Build the tiny `kind` pipeline with weights drawn from `seed` (and the family's tiny_pipeline `options`) and
    save it to `out_dir` (a diffusers pipeline directory: model_index.json plus one folder per component). Returns
    the path."""
    out_dir = Path(out_dir)
    pipe = build_tiny_pipeline(kind, seed, **options)
    pipe.save_pretrained(out_dir)
    return out_dir
