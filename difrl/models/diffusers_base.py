"""The shared part of the diffusers flow adapters: the base class `DiffusersFlowPolicy`, pipeline-directory
checks, dtype names and the errors. One file per model family holds the rest (diffusers' single-file policy):
FLUX.1 in `flux.py`, SD3 / SD3.5 in `sd3.py`, Wan 2.1 text-to-video in `wan.py`, FLUX.2 [dev] and [klein] in
`flux2.py`; `adapters.py` lists them.

    from difrl.models.adapters import load_flow_policy
    from difrl.models.lora_io import load_lora, save_lora
    policy = load_flow_policy("flux", "/models/FLUX.1-dev", dtype="bf16", height=512, width=512)
    sigmas = policy.sigma_schedule(28)                   # the pipeline's own schedule (Flux: shift mu)
    batch = rollout(policy, prompts, seeds, sigmas, kernel="flow_sde", guidance=3.5, ...)
    images = policy.decode(batch.x_final)                # [B, 3, H, W] in [0, 1] (Wan: [B, F, 3, H, W])
    save_lora(policy, "run/lora")                        # diffusers LoRA dir: pipe.load_lora_weights("run/lora")
    load_lora(other_policy, "run/lora")                  # refuses a LoRA made for another model kind

One class per model family holds everything model-specific (docs/architecture.md seam 1): prompt encoding
(through the pipeline's own `encode_prompt`, so embeddings are the pipeline's bit for bit),
timestep scaling, Flux's 2x2 latent packing and position ids, classifier-free guidance, and VAE
decoding with the pipeline's scaling / shift factors. Samplers only see `velocity(x, sigma, cond,
guidance) -> v = eps - x0` in fp32, whatever dtype the model runs in.

What `guidance` means follows the pipelines' own conventions, so a config value means what it means
there. The base class's default (SD3 and Wan): true classifier-free guidance when `guidance > 1` (the
pipelines' `guidance_scale > 1` test): one batched forward over [uncond; cond], `v = v_u + w (v_c - v_u)`
in fp32 (the `_guide` hook: Qwen-Image rescales it to the conditional velocity's norm). `guidance <= 1` is one
conditional forward. The negative prompt (default "", Flow-GRPO's choice, docs/reference/specs/flow-grpo-family.md §2.6)
is set per policy (`negative_prompt=`), embedded once and cached. FLUX overrides this (`flux.py`: embedded distilled
guidance). Each family file gives its latent shape and timestep scaling. With model.offload_text_encoders the text
encoders live on the CPU (difrl/models/offload.py) and `encode` / `negative_cond` move them to the transformer's
device around `_encode_batch`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import torch
from torch import nn

from difrl.models.base import DEFAULT_QUANT_PRESET, ComputeDevice, Cond, autocast_to
from difrl.models.offload import (TEXT_ENCODERS_HOME, encoders_visiting, is_text_encoder, loading_home,
                                  move_module)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class PipelineDirError(FileNotFoundError):
    """A pipeline directory (or a LoRA directory) is missing, or lacks a component."""


class ModelKindError(ValueError):
    """A directory holds another model kind than the one asked for."""


class ImagePrompt(str):
    """A prompt with its source image, for an image-editing family (`source_images = True`): the text itself (what
    rewards, logs and metadata read: it is a str) carrying `image`, the source image's path. Two ImagePrompts are equal
    (and hash alike: the prompt cache's key) only when text and image both are, so one instruction on two images is two
    prompts. The worlds and the trainer pass prompts through unchanged, so the image reaches `policy.encode`."""

    def __new__(cls, text: str, image):
        self = super().__new__(cls, text)
        self.image = str(image)
        return self

    def __eq__(self, other):
        return isinstance(other, ImagePrompt) and str.__eq__(self, other) and self.image == other.image

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((str(self), self.image))

    def __reduce__(self):  # pickles (a reward process, a spawned worker) as text + path
        return ImagePrompt, (str(self), self.image)

    def __repr__(self):
        return f"ImagePrompt({str(self)!r}, image={self.image!r})"


@functools.lru_cache(maxsize=1)
def dtype_keyword() -> str:
    """diffusers >= 0.42 takes `dtype=` in from_pretrained and warns on the older `torch_dtype=`."""
    try:
        from diffusers.utils import deprecation_utils
    except ImportError:
        return "torch_dtype"
    return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


# ---- pipeline directories ------------------------------------------------------------------------

def check_pipeline_dir(path: str | Path, cls: type[DiffusersFlowPolicy]) -> Path:
    """Check that `path` is a diffusers pipeline directory of the family `cls` (an adapter class) with every
    component the adapter needs, before diffusers' own (less specific) errors. Returns the path."""
    kind = cls.kind
    path = Path(path)
    if not path.is_dir():
        raise PipelineDirError(f"{path}: no such directory (expected a diffusers {cls.pipeline_class} directory "
                               f"for kind {kind!r})")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise PipelineDirError(f"{path} has no model_index.json: not a diffusers pipeline directory (one saved with "
                               f"{cls.pipeline_class}.save_pretrained, or a hub snapshot)")
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index_file} is not valid JSON: {e}") from None
    found = index.get("_class_name")
    if found not in cls.accepted_classes:
        kinds = list(dict.fromkeys(repr(c.kind) for c in _families() if found in c.accepted_classes))
        hint = f"; that is kind {' or '.join(kinds)}" if kinds else ""
        raise ModelKindError(f"{path} holds a {found} (model_index.json _class_name), not a {cls.pipeline_class} "
                             f"as kind {kind!r} needs{hint}")
    for comp in cls.required_components:
        entry = index.get(comp)
        if not entry or entry[0] is None:
            raise PipelineDirError(f"{path} has no component {comp!r} (model_index.json lists none); "
                                   f"{cls.pipeline_class} needs {', '.join(cls.required_components)}")
        if not (path / comp).is_dir():
            raise PipelineDirError(f"{path} is missing component {comp!r}: no {comp}/ folder")
    return path


def _families() -> list[type[DiffusersFlowPolicy]]:
    """Every adapter class defined so far (the family files subclass DiffusersFlowPolicy; difrl.models.adapters
    imports the built-in ones, a registered family's module is imported by then), found without importing the
    table, which imports this file."""
    out, todo = [], list(DiffusersFlowPolicy.__subclasses__())
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo += c.__subclasses__()
    return [c for c in out if c.kind]


def present_targets(module: nn.Module, candidates: tuple[str, ...]) -> list[str]:
    """The candidate LoRA target suffixes that name at least one nn.Linear in `module` (peft matches
    `name == t or name.endswith('.' + t)`); e.g. SD3's last block has no `to_add_out`."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    return [t for t in candidates if any(n == t or n.endswith("." + t) for n in names)]


# ---- the shared adapter ----------------------------------------------------------------------------

class DiffusersFlowPolicy(ComputeDevice):
    """FlowPolicy over a diffusers pipeline object; subclasses fill in the model-specific parts."""

    kind: str = ""
    pipeline_class: str = ""
    accepted_classes: tuple[str, ...] = ()
    required_components: tuple[str, ...] = ()
    lora_candidates: tuple[str, ...] = ()
    quant_preset: dict = DEFAULT_QUANT_PRESET  # quantize_module's skip / min_dim for a low-precision rollout copy
    block_classes: tuple[str, ...] = ()  # class names of the transformer's repeated blocks
    model_options: tuple[str, ...] = ()  # further config fields (cfg.model.<name>) that from_pretrained takes
    # the half dtype the transformer's forward autocasts to when its trained parameters are fp32 master weights
    # (difrl.train.precision: full fine-tuning of a bf16 model); None: it computes in its parameters' own dtype
    autocast_dtype: torch.dtype | None = None
    # keyword arguments of the transformer's forward that FSDP2's mixed precision must not cast to its compute dtype
    # (difrl.train.dist.sharding.keep_input_dtypes): the pipeline passes them in fp32 and the model embeds them in fp32
    fsdp_fp32_inputs: tuple[str, ...] = ()
    # pipeline components from_pretrained loads in fp32 whatever model.dtype is (Wan's VAE); difrl plan builds them so
    fp32_components: tuple[str, ...] = ()
    # an image-editing family: each prompt is an ImagePrompt carrying its source image (the diffusers world reads them
    # from model.prompt_file's records, {"prompt": ..., "image": path}); a plain str prompt is refused by its encode
    source_images: bool = False

    def __init__(self, pipe, *, height: int, width: int, negative_prompt: str = "", max_sequence_length: int = 512,
                 cache_prompts: bool = False):
        self.pipe = pipe
        self.height, self.width = int(height), int(width)
        self.negative_prompt = negative_prompt
        self.max_sequence_length = int(max_sequence_length)
        self.cache_prompts = cache_prompts  # text encoders are frozen here, so a prompt's embedding never changes
        self._cache: dict[str, Cond] = {}
        self._negative: Cond | None = None
        self._truncation_noted = False  # note_truncation: said once per policy
        self._length_checked: set[str] = set()  # prompts whose token counts were checked
        self._transformer = pipe.transformer
        self.transformer_config = pipe.transformer.config  # read through this: a peft wrapper hides .config
        pipe.set_progress_bar_config(disable=True)
        self.lora_target_modules = present_targets(pipe.transformer, self.lora_candidates)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the transformer computes in: its inputs are cast to it, its outputs back to fp32. Its parameters'
        dtype as loaded (model.dtype), also once full fine-tuning has made them fp32 master weights (then the forward
        autocasts to this dtype: `autocast_dtype`), so the inputs, and FLUX's timestep rounding, stay as loaded."""
        return self.autocast_dtype or self.pipe.transformer.dtype

    # -- FlowPolicy -------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._transformer

    @module.setter
    def module(self, m: nn.Module) -> None:  # peft / accelerate wrap the transformer in place of the plain module
        self._transformer = m

    @classmethod
    def _load_pipeline(cls, path: str | Path, dtype: torch.dtype, device, **pipe_kwargs):
        import diffusers
        from diffusers.utils import logging as diffusers_logging

        pipe_cls = getattr(diffusers, cls.pipeline_class)
        bar = diffusers_logging.is_progress_bar_enabled()
        diffusers_logging.disable_progress_bar()  # "Loading pipeline components..." would interleave with the log
        try:
            pipe = pipe_cls.from_pretrained(str(path), local_files_only=True, **{dtype_keyword(): dtype}, **pipe_kwargs)
        finally:
            if bar:
                diffusers_logging.enable_progress_bar()
        home = loading_home()
        if device is not None:
            for name, comp in pipe.components.items():
                if isinstance(comp, nn.Module) and not (home is not None and is_text_encoder(name)):
                    comp.to(device)  # offloaded text encoders: on `home` (CPU), never on the GPU
        for name, comp in pipe.components.items():
            if isinstance(comp, nn.Module):
                comp.eval()  # no dropout: a step's log-prob must be recomputable exactly
                if name != "transformer":
                    comp.requires_grad_(False)  # text encoders and VAE are frozen; the transformer is trained
        return pipe

    # -- text encoders kept off the device between embeddings (model.offload_text_encoders) -------------------
    text_encoders_home: torch.device | None = None  # None: the text encoders stay with the transformer

    def text_encoders(self) -> dict[str, nn.Module]:
        """The pipeline's text encoders by component name (every nn.Module component but the transformer(s) and VAE)."""
        return {n: c for n, c in self.pipe.components.items() if isinstance(c, nn.Module) and is_text_encoder(n)}

    def offload_text_encoders(self, home: torch.device | str = TEXT_ENCODERS_HOME) -> None:
        """Keep the text encoders on `home` (the CPU) between embeddings; each `_encode_batch` then moves them to the
        transformer's device and back (`text_encoders_on_device`). Costs two host <-> device copies of the encoders per
        batch of prompts not yet embedded (with cache_prompts, once per prompt)."""
        self.text_encoders_home = torch.device(home)
        for comp in self.text_encoders().values():
            move_module(comp, self.text_encoders_home)

    @contextlib.contextmanager
    def text_encoders_on_device(self):
        """Offloaded text encoders on the transformer's device inside the block, back home after (the accelerator's
        cache emptied on CUDA, so the freed memory is the transformer's again); no-op when not offloaded."""
        with encoders_visiting(list(self.text_encoders().values()), self.device, self.text_encoders_home):
            yield

    def encode(self, prompts: list[str]) -> Cond:
        """Prompt embeddings as the pipeline computes them, [B, ...] on the model's device."""
        prompts = list(prompts)
        unchecked = [p for p in dict.fromkeys(prompts) if p not in self._length_checked]
        if unchecked and not self._truncation_noted:
            self.note_truncation(unchecked)
            self._length_checked.update(unchecked)
        if not self.cache_prompts:
            with torch.no_grad(), self.text_encoders_on_device():
                return self._encode_batch(prompts)
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if missing:
            with torch.no_grad(), self.text_encoders_on_device():
                fresh = self._encode_batch(missing)
            for i, p in enumerate(missing):
                self._cache[p] = {k: v[i:i + 1] for k, v in fresh.items()}
        return {k: torch.cat([self._cache[p][k] for p in prompts]) for k in self._cache[prompts[0]]}

    def note_truncation(self, prompts: list[str]) -> None:
        """Say once (in place of the tokenizers' and pipelines' own warnings, difrl.utils.quiet) that prompts longer
        than a text encoder takes are truncated: CLIP tokenizers at their model_max_length (77), T5 ones at
        model.max_sequence_length."""
        long, limits = set(), []
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
            tok = getattr(self.pipe, name, None)
            if tok is None:
                continue
            tok = getattr(tok, "tokenizer", tok)  # a processor (FLUX.2 [dev]'s PixtralProcessor) wraps its tokenizer
            limit = tok.model_max_length if type(tok).__name__.startswith("CLIP") else self.max_sequence_length
            lengths = [len(ids) for ids in tok(prompts, verbose=False)["input_ids"]]
            over = {p for p, n in zip(prompts, lengths) if n > limit}
            if over:
                long |= over
                clip = type(tok).__name__.startswith("CLIP")
                limits.append(f"{type(tok).__name__}: {limit} tokens" + ("" if clip else " (model.max_sequence_length)"))
        if long:
            self._truncation_noted = True
            example = min(long, key=len)
            if os.environ.get("RANK", "0") == "0":  # one process says it (accelerate launch / torchrun)
                print(f"difrl: prompts longer than a text encoder takes are truncated, as the pipeline does "
                      f"({'; '.join(limits)}); e.g. {example[:80]!r}")

    def negative_cond(self, batch: int) -> Cond:
        """The negative prompt's embeddings (encoded once), expanded to `batch` rows."""
        if self._negative is None:
            with torch.no_grad(), self.text_encoders_on_device():
                self._negative = self._encode_batch([self.negative_prompt])
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self._negative.items()}

    def uncond(self, cond: Cond, batch: int) -> Cond:
        """CFG's unconditional rows for the `batch` rows of `cond` (the same keys): the negative prompt's embeddings,
        alike for every row. A family whose negative depends on the row (Qwen-Image-Edit: the negative prompt read
        with each row's source image) carries it in `cond` and overrides this."""
        return self.negative_cond(batch)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float = 1.0) -> torch.Tensor:
        """v = eps - x0, fp32 [B, *latent_shape]; true CFG in one batched forward over [uncond; cond]
        when _cfg_scale(guidance) gives a scale (the combination in fp32)."""
        home, dev = x.device, self.device  # the rollout's tensors may live elsewhere (CPU) than the model (GPU)
        x, cond = x.to(dev), {k: v.to(dev) for k, v in cond.items()}
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=dev).expand(x.shape[0])
        scale = self._cfg_scale(guidance)
        if scale is not None:
            scale = self._row_scale(scale, sigma)
            both = {k: torch.cat([u, cond[k]]) for k, u in self.uncond(cond, x.shape[0]).items()}
            with autocast_to(self.autocast_dtype, dev):
                out = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both, guidance)
            v_u, v_c = out.float().chunk(2)
            return self._guide(v_u, v_c, scale).to(home)
        with autocast_to(self.autocast_dtype, dev):
            out = self._forward(x, sigma, cond, guidance)
        return out.float().to(home)

    def forwards_per_step(self, guidance: float) -> int:
        """Network evaluations of one velocity call: 2 with CFG ([uncond; cond] in one batch), else 1 (FLUX's embedded
        guidance included)."""
        return 1 if self._cfg_scale(guidance) is None else 2

    def _row_scale(self, scale: float, sigma: torch.Tensor) -> float | torch.Tensor:
        """The CFG scale of each row at its sigma [B]: a float (every row alike, the default) or a tensor broadcasting
        against the velocity (Wan 2.2 A14B: its low-noise expert's rows take guidance_scale_2)."""
        return scale

    def lora_components(self) -> list[tuple[str, str, str, dict]]:
        """How the policy's LoRA maps to diffusers LoRA files (difrl.models.lora_io): (sub-directory of the LoRA
        directory, prefix of its keys in policy.module, the pipeline's transformer attribute, keyword arguments of
        pipe.load_lora_weights) per trained transformer. One transformer: the directory itself."""
        return [("", "", "transformer", {})]

    def _cfg_scale(self, guidance: float) -> float | None:
        """The CFG scale for this `guidance`, or None for one conditional forward (the pipelines'
        `do_classifier_free_guidance = guidance_scale > 1`)."""
        return float(guidance) if guidance > 1.0 else None

    def _guide(self, v_u: torch.Tensor, v_c: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided velocity from the uncond / cond ones (fp32, [B, *latent_shape]): `v_u + scale (v_c - v_u)`;
        a family whose pipeline post-processes it overrides this (Qwen-Image: the norm rescale)."""
        return v_u + scale * (v_c - v_u)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] (Wan: videos [B, F, 3, H, W], the layout of the pipelines' `.frames` and of
        difrl's video rewards) in [0, 1], fp32."""
        vae = self.pipe.vae
        with torch.no_grad():
            z = self._vae_latents(latents.to(vae.device, vae.dtype))
            out = vae.decode(z, return_dict=False)[0]
        if out.ndim == 5:  # a video VAE decodes [B, 3, F, H, W]
            out = out.transpose(1, 2)
        return (out.float() * 0.5 + 0.5).clamp(0, 1).to(latents.device)  # the image processors' denormalize

    # -- memory and speed options (model.gradient_checkpointing, model.compile) ----------------------
    def enable_gradient_checkpointing(self) -> None:
        """Recompute each transformer block's activations in the backward instead of storing them (diffusers'
        own switch). Only forwards with gradients are affected: rollouts run under no_grad and are unchanged."""
        self.pipe.transformer.enable_gradient_checkpointing()

    def compile_blocks(self, **compile_kwargs) -> int:
        """torch.compile each repeated transformer block (regional compilation, as diffusers recommends: one
        block compiled is reused by all of them, so compiling takes seconds, not the whole model's minutes).
        Compilation is lazy: LoRA layers peft injects later are part of the first traced forward. Ours, not
        diffusers' compile_repeated_blocks, because SD3's transformer lists no _repeated_blocks. Returns the
        number of blocks compiled."""
        blocks = [m for m in self.pipe.transformer.modules() if type(m).__name__ in self.block_classes]
        if not blocks:
            raise ValueError(f"{type(self.pipe.transformer).__name__} has no block of classes {self.block_classes}")
        for block in blocks:
            block.compile(**compile_kwargs)
        return len(blocks)

    # -- helpers shared by the kinds ----------------------------------------------------------------
    def sigma_schedule(self, num_steps: int) -> torch.Tensor:
        """[num_steps + 1] fp32 sigmas (1 -> 0) exactly as the pipeline's scheduler sets them for
        `num_steps` (shift or dynamic shift included), so `pipe(..., num_inference_steps=num_steps)`
        and a difrl rollout over these sigmas take the same steps."""
        sched = self._euler_scheduler()
        self._set_timesteps(sched, num_steps)
        return sched.sigmas.detach().to("cpu", torch.float32)

    def _euler_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        s = self.pipe.scheduler
        if isinstance(s, FlowMatchEulerDiscreteScheduler):
            return FlowMatchEulerDiscreteScheduler.from_config(s.config)  # a copy: the pipeline's stays untouched
        raise ValueError(f"{type(s).__name__} is not a flow-matching Euler scheduler; difrl's samplers take Euler "
                         "steps, so set pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=...) to compare")

    def _set_timesteps(self, sched, num_steps: int) -> None:
        sched.set_timesteps(num_steps)

    def _check_batch(self, cond: Cond, batch: int) -> None:
        for k, v in cond.items():
            if v.shape[0] != batch:
                raise ValueError(f"cond[{k!r}] has {v.shape[0]} rows for a batch of {batch}")

    @staticmethod
    def tiny_pipeline():
        """This family's tiny random pipeline object for tests, built in code (difrl/models/tiny.py seeds the
        weights, sets eval mode and saves it). Real component classes, 1-2 layers, tokenizers built in code."""
        raise NotImplementedError

    # subclasses: _encode_batch(prompts) -> Cond, _forward(x, sigma, cond, guidance) -> raw model output,
    # _vae_latents(latents) -> what vae.decode takes, latent_shape, from_pretrained(path, dtype, ...), tiny_pipeline,
    # block_classes (difrl.models.adapters.register_model checks them; docs/guides/adding-a-model.md has each, with shapes)


def vae_scale(pipe) -> int:
    """The VAE's spatial scale factor (8 for the real image VAEs, 2 for the tiny ones)."""
    return 2 ** (len(pipe.vae.config.block_out_channels) - 1)
