"""Pipelines built from their architecture configs alone (no weights read): what difrl plan simulates at real size.

    from difrl.models.arch import ARCHS, REFERENCE_ARCH, arch_dir, build_arch_pipeline
    with FakeTensorMode():                                    # torch._subclasses.fake_tensor: shapes, no storage
        pipe = build_arch_pipeline(arch_dir("flux1-dev"), torch.bfloat16)   # a FluxPipeline of FLUX.1-dev's shapes
        lm, config = build_arch_lm(arch_dir("llada-8b"), torch.bfloat16)   # LLaDA-8B's shapes on Llama blocks
    policy = FluxPolicy(pipe, height=512, width=512)          # the family's own adapter, as load_flow_policy makes it

A directory here is laid out like a diffusers pipeline directory: `model_index.json` and each component's
`config.json` (difrl/assets/arch/ ships those of the reference checkpoints; a real pipeline directory works too,
its weight files are never opened). Every component is made from its config as `from_pretrained` would make it
before loading weights, in `dtype` (the floating parameters, as `from_pretrained(dtype=...)` gives them) and in eval
mode with the frozen parts' gradients off, as DiffusersFlowPolicy._load_pipeline leaves them. Tokenizers come from
the directory when it has them, else are built in code (difrl/models/tiny.py) with the pipeline's text length, so the
text encoders see sequences of the real length (the pipelines pad to it); their vocabulary is not the real one, which
changes no shape.

A masked LM's folder (MASKED_ARCHS: `config.json` alone, as a transformers model directory without weights) is made
by `build_arch_lm` the same way: its `architectures[0]` class from its config, in `dtype`, eval mode; a config with
`"is_causal": false` (LLaDA) gets bidirectional attention in every layer (difrl/assets/arch/README.md). The caller
wraps it in its policy adapter (difrl.discrete.policy.HFMaskedLM, a layer above this one).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

ARCH_ROOT = Path(__file__).resolve().parent.parent / "assets" / "arch"
# the reference checkpoint of each family: what difrl plan simulates when model.path is not a local directory
REFERENCE_ARCH = {"flux": "flux1-dev", "sd3": "sd3.5-large", "wan": "wan2.1-t2v-14b", "hf_masked": "llada-8b",
                  "sana": "sana-1.6b", "flux2": "flux2-dev", "flux2_klein": "flux2-klein-base-9b",
                  "zimage": "z-image", "qwenimage": "qwen-image",
                  "wan22": "wan2.2-ti2v-5b", "qwenimage_edit": "qwen-image-edit"}
ARCHS = tuple(sorted(p.name for p in ARCH_ROOT.iterdir() if (p / "model_index.json").is_file())) if ARCH_ROOT.is_dir() else ()
# masked LMs: a transformers config.json alone (no model_index.json)
MASKED_ARCHS = tuple(sorted(p.name for p in ARCH_ROOT.iterdir() if (p / "config.json").is_file()
                            and not (p / "model_index.json").is_file())) if ARCH_ROOT.is_dir() else ()
CLIP_TEXT_LEN = 77  # CLIP's context (the pipelines pad CLIP prompts to tokenizer.model_max_length)


def arch_dir(name: str) -> Path:
    """The shipped architecture folder `name` (one of ARCHS or MASKED_ARCHS); ValueError naming the choices otherwise."""
    if name not in ARCHS + MASKED_ARCHS:
        raise ValueError(f"unknown architecture {name!r}: difrl ships {', '.join(ARCHS + MASKED_ARCHS)} "
                         "(difrl/assets/arch/)")
    return ARCH_ROOT / name


def _config(folder: Path) -> dict:
    for name in ("config.json", "scheduler_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    raise FileNotFoundError(f"{folder}: no config.json (an architecture folder needs each component's config)")


def _tokenizer(folder: Path, cls_name: str, pipeline_class: str):
    """The directory's tokenizer (or processor) when it has one, else a code-built one: CLIP or T5-like by its class,
    and for a pipeline whose text encoder is a chat LLM the one its family's tiny pipeline uses (CODE_TOKENIZERS)."""
    import transformers

    from difrl.models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

    if folder.is_dir() and any(folder.iterdir()):
        return getattr(transformers, cls_name).from_pretrained(str(folder), local_files_only=True)
    if "CLIP" in cls_name:
        return tiny_clip_tokenizer(CLIP_TEXT_LEN)
    builder = CODE_TOKENIZERS.get(f"{pipeline_class}.{cls_name}", CODE_TOKENIZERS.get(pipeline_class))
    if builder is not None:
        from difrl.models import tiny

        return getattr(tiny, builder)()
    return tiny_t5_tokenizer()


# pipeline class -> the difrl.models.tiny builder of its tokenizer or processor, the one its family's tiny pipeline
# uses (chat-LLM text encoders; the vocabulary is not the real one, the text lengths are)
CODE_TOKENIZERS = {"SanaPipeline": "tiny_gemma_tokenizer", "QwenImagePipeline": "tiny_qwen2_tokenizer",
                   "ZImagePipeline": "tiny_qwen_tokenizer_in_vocab", "Flux2KleinPipeline": "tiny_qwen_tokenizer",
                   "Flux2Pipeline": "tiny_flux2_processor",
                   # a pipeline with a tokenizer and a processor: "<pipeline class>.<component class>" names the latter's
                   "QwenImageEditPipeline": "qwen_image_edit_tokenizer",
                   "QwenImageEditPipeline.Qwen2VLProcessor": "qwen_image_edit_processor"}


def _model(library: str, cls_name: str, config: dict) -> nn.Module:
    if library == "diffusers":
        import diffusers

        return getattr(diffusers, cls_name).from_config(config)
    import transformers

    cls = getattr(transformers, cls_name)
    return cls(cls.config_class(**{k: v for k, v in config.items() if k != "architectures"}))


def build_arch_pipeline(path: str | Path, dtype: torch.dtype, component_dtypes: dict[str, torch.dtype] | None = None,
                        text_encoders_device: torch.device | None = None):
    """The pipeline of the directory `path` (model_index.json + component configs and config values), with freshly initialised
    parameters in `dtype` (`component_dtypes` overrides it per component, e.g. Wan's VAE in fp32). Call it under
    FakeTensorMode to build a 12-billion-parameter pipeline in seconds and no memory. `text_encoders_device`: where the
    text encoders are made (difrl plan's offloaded ones: "meta", off the simulated GPU); None: the default device."""
    from difrl.models.offload import is_text_encoder

    import diffusers
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    parts = {}
    for name, entry in index.items():
        if not name.startswith("_") and not isinstance(entry, list):
            parts[name] = entry  # a pipeline config value (Wan 2.2: expand_timesteps, boundary_ratio)
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        library, cls_name = entry
        if "Tokenizer" in cls_name or "Processor" in cls_name or "Scheduler" in cls_name:
            # real objects even under FakeTensorMode: a scheduler's sigmas are read as numbers (.item()), which a fake
            # tensor refuses; their tensors are a few hundred floats
            with unset_fake_temporarily():
                parts[name] = (_tokenizer(path / name, cls_name, index.get("_class_name", "")) if "Scheduler" not in cls_name
                               else getattr(diffusers, cls_name).from_config(_config(path / name)))
            continue
        config = _config(path / name)
        # made in its loading dtype, as from_pretrained(dtype=...) leaves the floating parameters (a conversion
        # afterwards would hold both copies at once)
        before = torch.get_default_dtype()
        torch.set_default_dtype((component_dtypes or {}).get(name, dtype))
        try:
            with torch.device(text_encoders_device) if text_encoders_device is not None and is_text_encoder(name) \
                    else contextlib.nullcontext():
                module = _model(library, cls_name, config)
        finally:
            torch.set_default_dtype(before)
        module.eval()
        if name != "transformer":
            module.requires_grad_(False)
        parts[name] = module
    pipe = getattr(diffusers, index["_class_name"])(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_arch_lm(path: str | Path, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    """(model, config dict) of the transformers directory `path` from its config.json alone (no weight is read): the
    class `architectures[0]` with freshly initialised parameters in `dtype`, eval mode. `"is_causal": false` in the
    config: every attention layer attends both ways (the mask transformers builds and the flag its SDPA call reads,
    which would make a padding-free batch causal). Call it under FakeTensorMode for an 8-billion-parameter model in
    seconds and no memory."""
    config = _config(Path(path))
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its loading dtype, as from_pretrained(dtype=...) leaves it
    try:
        model = _model("transformers", config["architectures"][0], config)
    finally:
        torch.set_default_dtype(before)
    if config.get("is_causal") is False:
        for m in model.modules():
            if getattr(m, "is_causal", None) is True:
                m.is_causal = False
    return model.eval(), config


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
