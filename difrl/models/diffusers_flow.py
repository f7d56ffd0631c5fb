"""FlowPolicy adapters for diffusers pipeline directories: FLUX.1, SD3 / SD3.5 and Wan 2.1 text-to-video.

    from difrl.models.diffusers_flow import load_flow_policy, save_lora, load_lora
    policy = load_flow_policy("flux", "/models/FLUX.1-dev", dtype="bf16", height=512, width=512)
    sigmas = policy.sigma_schedule(28)                   # the pipeline's own schedule (Flux: shift mu)
    batch = rollout(policy, prompts, seeds, sigmas, kernel="flow_sde", guidance=3.5, ...)
    images = policy.decode(batch.x_final)                # [B, 3, H, W] in [0, 1] (Wan: [B, 3, F, H, W])
    save_lora(policy, "run/lora")                        # diffusers LoRA dir: pipe.load_lora_weights("run/lora")
    load_lora(other_policy, "run/lora")                  # refuses a LoRA made for another model kind

One class per model family holds everything model-specific (DESIGN.md seam 1): prompt encoding
(through the pipeline's own `encode_prompt`, so embeddings are the pipeline's bit for bit),
timestep scaling, Flux's 2x2 latent packing and position ids, classifier-free guidance, and VAE
decoding with the pipeline's scaling / shift factors. Samplers only see `velocity(x, sigma, cond,
guidance) -> v = eps - x0` in fp32, whatever dtype the model runs in.

What `guidance` means (the pipelines' own conventions, so a config value means what it means there):

- SD3 and Wan: true classifier-free guidance when `guidance > 1` (the pipelines' `guidance_scale > 1`
  test): one batched forward over [uncond; cond], `v = v_u + w (v_c - v_u)` in fp32. `guidance <= 1`
  is one conditional forward. The negative prompt (default "", Flow-GRPO's choice, spec §2.6) is set
  per policy (`negative_prompt=`), embedded once and cached.
- FLUX: `guidance` is the *embedded* distilled guidance of guidance-distilled checkpoints (FLUX.1-dev:
  3.5; the pipeline's `guidance_scale`), one forward per step, no uncond pass (spec §2.6). A checkpoint
  without a guidance embedding (FLUX.1-schnell) accepts only guidance 1 (or 0) and says so otherwise.
  True CFG for Flux is the separate constructor option `true_cfg_scale > 1` (the pipeline's
  `true_cfg_scale` with `negative_prompt`), which costs the extra uncond forward.

Latent shapes (one sample; vsf = the VAE's spatial scale factor, 8 for the real models):

- FLUX: packed `((H // (2 vsf)) * (W // (2 vsf)), 4 C)`, e.g. (1024, 64) at 512x512. Noise drawn in the
  packed shape is the same i.i.d. Gaussian as the pipeline's, so `latents=` takes it as is.
- SD3: `(C, H // vsf, W // vsf)`, e.g. (16, 64, 64) at 512x512.
- Wan: `(C, (F - 1) // 4 + 1, H // 8, W // 8)`, e.g. (16, 21, 60, 104) at 480x832x81.

Timesteps as the pipelines pass them: FLUX gets `(1000 sigma) / 1000` cast to the model dtype first
(the pipeline's exact expression, so rollouts match it to the last bit); SD3 and Wan get `1000 sigma`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from difrl.models.base import Cond

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
LORA_MARKER = "difrl_lora.json"  # written beside the diffusers LoRA file: which model kind it was trained on


class PipelineDirError(FileNotFoundError):
    """A pipeline directory (or a LoRA directory) is missing, or lacks a component."""


class ModelKindError(ValueError):
    """A directory holds another model kind than the one asked for."""


@functools.lru_cache(maxsize=1)
def _dtype_keyword() -> str:
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

def check_pipeline_dir(path: str | Path, kind: str) -> Path:
    """Check that `path` is a diffusers pipeline directory of model `kind` with every component the
    adapter needs, before diffusers' own (less specific) errors. Returns the path."""
    cls = ADAPTERS[kind] if kind in ADAPTERS else None
    if cls is None:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(ADAPTERS)}")
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
        hint = next((f"; that is kind {k!r}" for k, c in ADAPTERS.items() if found in c.accepted_classes), "")
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


def present_targets(module: nn.Module, candidates: tuple[str, ...]) -> list[str]:
    """The candidate LoRA target suffixes that name at least one nn.Linear in `module` (peft matches
    `name == t or name.endswith('.' + t)`); e.g. SD3's last block has no `to_add_out`."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    return [t for t in candidates if any(n == t or n.endswith("." + t) for n in names)]


# ---- the shared adapter ----------------------------------------------------------------------------

class DiffusersFlowPolicy:
    """FlowPolicy over a diffusers pipeline object; subclasses fill in the model-specific parts."""

    kind: str = ""
    pipeline_class: str = ""
    accepted_classes: tuple[str, ...] = ()
    required_components: tuple[str, ...] = ()
    lora_candidates: tuple[str, ...] = ()

    def __init__(self, pipe, *, height: int, width: int, negative_prompt: str = "", max_sequence_length: int = 512,
                 cache_prompts: bool = False):
        self.pipe = pipe
        self.height, self.width = int(height), int(width)
        self.negative_prompt = negative_prompt
        self.max_sequence_length = int(max_sequence_length)
        self.cache_prompts = cache_prompts  # text encoders are frozen here, so a prompt's embedding never changes
        self._cache: dict[str, Cond] = {}
        self._negative: Cond | None = None
        self._transformer = pipe.transformer
        self.transformer_config = pipe.transformer.config  # read through this: a peft wrapper hides .config
        pipe.set_progress_bar_config(disable=True)
        self.lora_target_modules = present_targets(pipe.transformer, self.lora_candidates)

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's dtype: its inputs are cast to it, its outputs back to fp32."""
        return self.pipe.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.pipe.transformer.device

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

        pipe_cls = getattr(diffusers, cls.pipeline_class)
        pipe = pipe_cls.from_pretrained(str(path), local_files_only=True, **{_dtype_keyword(): dtype}, **pipe_kwargs)
        if device is not None:
            pipe.to(device)
        for name, comp in pipe.components.items():
            if isinstance(comp, nn.Module):
                comp.eval()  # no dropout: a step's log-prob must be recomputable exactly
                if name != "transformer":
                    comp.requires_grad_(False)  # text encoders and VAE are frozen; the transformer is trained
        return pipe

    def encode(self, prompts: list[str]) -> Cond:
        """Prompt embeddings as the pipeline computes them, [B, ...] on the model's device."""
        prompts = list(prompts)
        if not self.cache_prompts:
            with torch.no_grad():
                return self._encode_batch(prompts)
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if missing:
            with torch.no_grad():
                fresh = self._encode_batch(missing)
            for i, p in enumerate(missing):
                self._cache[p] = {k: v[i:i + 1] for k, v in fresh.items()}
        return {k: torch.cat([self._cache[p][k] for p in prompts]) for k in self._cache[prompts[0]]}

    def negative_cond(self, batch: int) -> Cond:
        """The negative prompt's embeddings (encoded once), expanded to `batch` rows."""
        if self._negative is None:
            with torch.no_grad():
                self._negative = self._encode_batch([self.negative_prompt])
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self._negative.items()}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float = 1.0) -> torch.Tensor:
        """v = eps - x0, fp32 [B, *latent_shape]; true CFG in one batched forward over [uncond; cond]
        when _cfg_scale(guidance) gives a scale (the combination in fp32)."""
        home, dev = x.device, self.device  # the rollout's tensors may live elsewhere (CPU) than the model (GPU)
        x, cond = x.to(dev), {k: v.to(dev) for k, v in cond.items()}
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=dev).expand(x.shape[0])
        scale = self._cfg_scale(guidance)
        if scale is not None:
            both = {k: torch.cat([u, cond[k]]) for k, u in self.negative_cond(x.shape[0]).items()}
            v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both, guidance).float().chunk(2)
            return (v_u + scale * (v_c - v_u)).to(home)
        return self._forward(x, sigma, cond, guidance).float().to(home)

    def _cfg_scale(self, guidance: float) -> float | None:
        """The CFG scale for this `guidance`, or None for one conditional forward (the pipelines'
        `do_classifier_free_guidance = guidance_scale > 1`)."""
        return float(guidance) if guidance > 1.0 else None

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] (Wan: videos [B, 3, F, H, W]) in [0, 1], fp32."""
        vae = self.pipe.vae
        with torch.no_grad():
            z = self._vae_latents(latents.to(vae.device, vae.dtype))
            out = vae.decode(z, return_dict=False)[0]
        return (out.float() * 0.5 + 0.5).clamp(0, 1).to(latents.device)  # the image processors' denormalize

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

    # subclasses: _encode_batch(prompts) -> Cond, _forward(x, sigma, cond, guidance) -> raw model output,
    # _vae_latents(latents) -> what vae.decode takes, latent_shape


def _vae_scale(pipe) -> int:
    return 2 ** (len(pipe.vae.config.block_out_channels) - 1)


# ---- FLUX.1 -------------------------------------------------------------------------------------------

class FluxPolicy(DiffusersFlowPolicy):
    """FLUX.1 (`FluxPipeline`): packed 2x2 latents, CLIP pooled + T5 embeddings, embedded guidance."""

    kind = "flux"
    pipeline_class = "FluxPipeline"
    accepted_classes = ("FluxPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")
    # diffusers' train_dreambooth_lora_flux.py / Flow-GRPO's Flux list (ecosystem.md §2.1)
    lora_candidates = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                       "ff_context.net.2")

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, true_cfg_scale: float = 1.0,
                 negative_prompt: str = "", max_sequence_length: int = 512, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        self.true_cfg_scale = float(true_cfg_scale)
        vsf = _vae_scale(pipe)
        # the pipeline's prepare_latents: latent side 2 * (side // (2 vsf)), then 2x2 patches
        self.latent_h, self.latent_w = 2 * (self.height // (vsf * 2)), 2 * (self.width // (vsf * 2))
        seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        self.latent_shape = (seq_len, self.transformer_config.in_channels)
        self.img_ids = pipe._prepare_latent_image_ids(1, self.latent_h // 2, self.latent_w // 2, self.device, self.dtype)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls.kind)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts: list[str]) -> Cond:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _set_timesteps(self, sched, num_steps: int) -> None:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = sched.config  # FluxPipeline.__call__ step 5: linspace(1, 1/N, N), mu from the packed sequence length
        mu = calculate_shift(self.latent_shape[0], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def _cfg_scale(self, guidance: float) -> float | None:
        # `guidance` is the embedded distilled guidance, never a CFG scale; true CFG is a constructor option
        if not self.transformer_config.guidance_embeds and guidance not in (0.0, 1.0):
            raise ValueError(f"this FLUX transformer has no guidance embedding (a schnell-type checkpoint), so "
                             f"guidance={guidance} would be ignored; pass guidance 1.0 (true CFG: true_cfg_scale=)")
        return self.true_cfg_scale if self.true_cfg_scale > 1.0 else None

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        embeds = cond["prompt_embeds"]
        g = None
        if self.transformer_config.guidance_embeds:
            g = torch.full((x.shape[0],), float(guidance), device=x.device, dtype=torch.float32)
        return self.module(
            hidden_states=x.to(dt),
            timestep=(sigma * 1000).to(dt) / 1000,  # the pipeline's `t.to(latents.dtype) / 1000`
            guidance=g,
            pooled_projections=cond["pooled_prompt_embeds"].to(dt),
            encoder_hidden_states=embeds.to(dt),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dt),
            img_ids=self.img_ids.to(x.device),
            return_dict=False,
        )[0]

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> packed [B, (h/2)(w/2), 4C]."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed [B, L, 4C] -> [B, C, h, w]."""
        return self.pipe._unpack_latents(latents, self.height, self.width, _vae_scale(self.pipe))

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        return self.unpack(latents) / c.scaling_factor + c.shift_factor


# ---- SD3 / SD3.5 ----------------------------------------------------------------------------------------

class SD3Policy(DiffusersFlowPolicy):
    """SD3 / SD3.5 (`StableDiffusion3Pipeline`): two CLIPs + T5, pooled projections, true CFG."""

    kind = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    accepted_classes = ("StableDiffusion3Pipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")  # text_encoder_3 / tokenizer_3 (T5) may be dropped: the pipeline then uses zeros
    # Flow-GRPO's SD3.5 list (scripts/train_sd3.py; ecosystem.md §2.1)
    lora_candidates = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                       "attn.to_out.0", "attn.to_q", "attn.to_v")

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 256, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        vsf = _vae_scale(pipe)
        self.latent_shape = (self.transformer_config.in_channels, self.height // vsf, self.width // vsf)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls.kind)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                       device=self.device, do_classifier_free_guidance=False,
                                                       max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _set_timesteps(self, sched, num_steps: int) -> None:
        kwargs = {}
        if sched.config.get("use_dynamic_shifting", False):  # StableDiffusion3Pipeline.__call__ step 5
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            p = self.transformer_config.patch_size
            c = sched.config
            kwargs["mu"] = calculate_shift((self.latent_shape[1] // p) * (self.latent_shape[2] // p),
                                           c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        sched.set_timesteps(num_steps, **kwargs)

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        return self.module(hidden_states=x.to(dt), timestep=sigma * 1000,
                           encoder_hidden_states=cond["prompt_embeds"].to(dt),
                           pooled_projections=cond["pooled_prompt_embeds"].to(dt), return_dict=False)[0]

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        return latents / c.scaling_factor + c.shift_factor


# ---- Wan 2.1 text-to-video ---------------------------------------------------------------------------------

class WanPolicy(DiffusersFlowPolicy):
    """Wan 2.1 T2V (`WanPipeline`): video latents [C, F, H, W], UMT5 text encoder, CFG with a negative prompt."""

    kind = "wan"
    pipeline_class = "WanPipeline"
    accepted_classes = ("WanPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Flow-GRPO's Wan 2.1 list (train_wan2_1.py); add_* exist only in I2V checkpoints (ecosystem.md §2.1)
    lora_candidates = ("add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v")

    def __init__(self, pipe, *, height: int = 480, width: int = 832, num_frames: int = 81, negative_prompt: str = "",
                 max_sequence_length: int = 512, cache_prompts: bool = False):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("expand_timesteps", False):
            raise ValueError("WanPolicy covers Wan 2.1 text-to-video (one transformer, one timestep per sample); "
                             "this pipeline is a Wan 2.2 two-expert or ti2v checkpoint")
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        self.num_frames = int(num_frames)
        t, s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        _, ph, pw = self.transformer_config.patch_size
        if self.height % (s * ph) or self.width % (s * pw) or (self.num_frames - 1) % t:
            raise ValueError(f"Wan needs height/width multiples of {s * ph}/{s * pw} and num_frames = 4k + 1; "
                             f"got {self.height}x{self.width}x{self.num_frames}")
        self.latent_shape = (self.transformer_config.in_channels, (self.num_frames - 1) // t + 1,
                             self.height // s, self.width // s)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 480, width: int = 832, num_frames: int = 81,
                        device=None, vae_dtype="fp32", **options):
        """The Wan VAE runs in fp32 by default (diffusers' Wan examples load it so)."""
        import diffusers

        check_pipeline_dir(path, cls.kind)
        vae = diffusers.AutoencoderKLWan.from_pretrained(str(path), subfolder="vae", local_files_only=True,
                                                         **{_dtype_keyword(): as_dtype(vae_dtype)})
        pipe = cls._load_pipeline(path, as_dtype(dtype), device, vae=vae)
        return cls(pipe, height=height, width=width, num_frames=num_frames, **options)

    def _euler_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        s = self.pipe.scheduler
        if not isinstance(s, FlowMatchEulerDiscreteScheduler) and "flow_shift" in s.config:
            # real Wan 2.1 directories ship UniPC with flow_shift; difrl samples with Euler steps on the same shift
            return FlowMatchEulerDiscreteScheduler(shift=s.config.flow_shift)
        return super()._euler_scheduler()

    def _encode_batch(self, prompts):
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return {"prompt_embeds": embeds.to(self.dtype)}  # WanPipeline casts to the transformer dtype

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        return self.module(hidden_states=x.to(self.dtype), timestep=sigma * 1000,
                           encoder_hidden_states=cond["prompt_embeds"].to(self.dtype), return_dict=False)[0]

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean  # WanPipeline's exact expression


ADAPTERS: dict[str, type[DiffusersFlowPolicy]] = {"flux": FluxPolicy, "sd3": SD3Policy, "wan": WanPolicy}


def load_flow_policy(kind: str, path: str | Path, **options) -> DiffusersFlowPolicy:
    """The adapter for model `kind` ('flux', 'sd3', 'wan') loaded from the local pipeline directory `path`.
    Options go to the adapter's from_pretrained (dtype, height, width, num_frames, device, ...)."""
    if kind not in ADAPTERS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(ADAPTERS)}")
    return ADAPTERS[kind].from_pretrained(path, **options)


# ---- LoRA the diffusers way ---------------------------------------------------------------------------------

def _peft_parts(module: nn.Module, adapter_name: str):
    """(peft-wrapped module, its LoraConfig, key prefix to strip) for a PeftModel or a diffusers
    model with an adapter (add_adapter / load_lora_weights); unwraps DDP-style `.module` wrappers."""
    from peft import PeftModel

    while not hasattr(module, "peft_config") and isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    if not hasattr(module, "peft_config") or adapter_name not in module.peft_config:
        raise ValueError(f"the policy's module has no LoRA adapter {adapter_name!r} (wrap it with peft first)")
    prefix = "base_model.model." if isinstance(module, PeftModel) else ""
    return module, module.peft_config[adapter_name], prefix


def save_lora(policy: DiffusersFlowPolicy, out_dir: str | Path, adapter_name: str = "default") -> Path:
    """Write the policy's transformer LoRA as a diffusers LoRA directory (pytorch_lora_weights.safetensors)
    that `pipe.load_lora_weights(out_dir)` reads with the right scaling: rank and lora_alpha go in as
    adapter metadata (without it diffusers assumes alpha = r, ecosystem.md §2.2). A small difrl_lora.json
    records the model kind so load_lora can refuse a LoRA made for another model."""
    from peft.utils import get_peft_model_state_dict

    from difrl.utils.io import atomic_write_json

    module, config, prefix = _peft_parts(policy.module, adapter_name)
    state = get_peft_model_state_dict(module, adapter_name=adapter_name)
    state = {k[len(prefix):] if k.startswith(prefix) else k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    meta = config.to_dict()
    out_dir = Path(out_dir)
    type(policy.pipe).save_lora_weights(out_dir, transformer_lora_layers=state,
                                        transformer_lora_adapter_metadata=meta)
    atomic_write_json(out_dir / LORA_MARKER, {
        "kind": policy.kind, "pipeline_class": policy.pipeline_class,
        "transformer_class": type(policy.pipe.transformer).__name__, "rank": config.r,
        "lora_alpha": config.lora_alpha, "target_modules": sorted(config.target_modules)})
    return out_dir


def check_lora_dir(policy: DiffusersFlowPolicy, lora_dir: str | Path) -> dict[str, torch.Tensor]:
    """The transformer LoRA tensors of `lora_dir` (keys without the 'transformer.' prefix), after checking
    that the directory was made for this policy's model kind: the difrl marker if present, and always
    that every LoRA key names a module of this transformer with matching shapes."""
    lora_dir = Path(lora_dir)
    if not lora_dir.is_dir():
        raise PipelineDirError(f"{lora_dir}: no such LoRA directory")
    if not any(lora_dir.glob("*.safetensors")):
        raise PipelineDirError(f"{lora_dir} has no LoRA weights (*.safetensors; expected pytorch_lora_weights.safetensors)")
    marker = lora_dir / LORA_MARKER
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("kind") != policy.kind:
            raise ModelKindError(f"{lora_dir} holds a LoRA for model kind {info.get('kind')!r} "
                                 f"({info.get('pipeline_class')}), not for {policy.kind!r} ({policy.pipeline_class})")
    state = type(policy.pipe).lora_state_dict(str(lora_dir))
    state = state[0] if isinstance(state, tuple) else state
    tf = {k[len("transformer."):]: v for k, v in state.items() if k.startswith("transformer.")}
    if not tf:
        raise ModelKindError(f"{lora_dir} has no transformer LoRA weights for a {policy.pipeline_class} "
                             f"(keys start {sorted(state)[:2]})")
    modules = dict(policy.pipe.transformer.named_modules())
    bad = []
    for key, w in tf.items():
        name, _, kind = key.rpartition(".lora_")
        base = modules.get(name)
        base = getattr(base, "base_layer", base)  # already LoRA-wrapped
        if not isinstance(base, nn.Linear):
            bad.append(f"{key} (no such linear layer)")
        elif kind.startswith("A") and w.shape[1] != base.in_features:
            bad.append(f"{key} (in {w.shape[1]} != {base.in_features})")
        elif kind.startswith("B") and w.shape[0] != base.out_features:
            bad.append(f"{key} (out {w.shape[0]} != {base.out_features})")
    if bad:
        raise ModelKindError(f"{lora_dir} does not fit this {type(policy.pipe.transformer).__name__} "
                             f"(kind {policy.kind!r}): {len(bad)} of {len(tf)} LoRA tensors do not match, e.g. "
                             + "; ".join(bad[:3]))
    return tf


def load_lora(policy: DiffusersFlowPolicy, lora_dir: str | Path, adapter_name: str = "default") -> DiffusersFlowPolicy:
    """Load a diffusers LoRA directory into the policy after check_lora_dir. A policy whose module is
    already peft-wrapped with `adapter_name` (training resume) gets the weights set in place; a plain
    policy gets them through the pipeline's own `load_lora_weights` (the same path a user takes)."""
    tf = check_lora_dir(policy, lora_dir)
    module = policy.module
    if hasattr(module, "peft_config") and adapter_name in module.peft_config:
        from peft import set_peft_model_state_dict

        _, _, prefix = _peft_parts(module, adapter_name)
        result = set_peft_model_state_dict(module, {prefix + k: v for k, v in tf.items()}, adapter_name=adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []))
        missing = [k for k in getattr(result, "missing_keys", []) if ".lora_" in k and f".{adapter_name}." in k]
        if unexpected or missing:
            raise ValueError(f"{lora_dir} does not match the policy's adapter {adapter_name!r}: "
                             f"{len(unexpected)} tensors have no place in it (e.g. {unexpected[:2]}), "
                             f"{len(missing)} of its tensors are not in the directory (e.g. {missing[:2]}); "
                             "wrap with the same target_modules and rank")
        return policy
    if module is not policy.pipe.transformer:
        raise ValueError("the policy's module is wrapped but has no peft adapter "
                         f"{adapter_name!r}; load the LoRA before wrapping it")
    policy.pipe.load_lora_weights(str(lora_dir), adapter_name=adapter_name)
    return policy
