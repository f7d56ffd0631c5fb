"""FLUX.1 (`FluxPipeline`): packed 2x2 latents, CLIP pooled + T5 embeddings, embedded distilled guidance.

    policy = load_flow_policy("flux", "/models/FLUX.1-dev", dtype="bf16", height=512, width=512, true_cfg_scale=1.0)

`guidance` is the *embedded* distilled guidance of guidance-distilled checkpoints (FLUX.1-dev: 3.5; the
pipeline's `guidance_scale`), one forward per step, no uncond pass (docs/reference/specs/flow-grpo-family.md §2.6). A
checkpoint without a guidance embedding (FLUX.1-schnell) accepts only guidance 1 (or 0) and says so otherwise. True CFG
for Flux is the separate constructor option `true_cfg_scale > 1` (the pipeline's `true_cfg_scale` with
`negative_prompt`), which costs the extra uncond forward.

Latent shape (one sample; vsf = the VAE's spatial scale factor, 8 for the real models): packed
`((H // (2 vsf)) * (W // (2 vsf)), 4 C)`, e.g. (1024, 64) at 512x512. Noise drawn in the packed shape is
the same i.i.d. Gaussian as the pipeline's, so `latents=` takes it as is.

Timesteps: `(1000 sigma) / 1000` cast to the model dtype first (the pipeline's exact expression, so
rollouts match it to the last bit).
"""

from __future__ import annotations

import numpy as np
import torch

from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, vae_scale
from difrl.quant.linear import QUANT_PRESETS


class FluxPolicy(DiffusersFlowPolicy):
    """FLUX.1 (`FluxPipeline`): packed 2x2 latents, CLIP pooled + T5 embeddings, embedded guidance."""

    kind = "flux"
    pipeline_class = "FluxPipeline"
    accepted_classes = ("FluxPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")
    # diffusers' train_dreambooth_lora_flux.py / Flow-GRPO's Flux list (docs/reference/specs/ecosystem.md §2.1)
    lora_candidates = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                       "ff_context.net.2")
    quant_preset = QUANT_PRESETS["flux"]  # Sol-RL's skip list (docs/reference/specs/lowprec-and-correctors.md §1.4)
    block_classes = ("FluxTransformerBlock", "FluxSingleTransformerBlock")  # the repeated transformer blocks (regional compile, sharding)

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, true_cfg_scale: float = 1.0,
                 negative_prompt: str = "", max_sequence_length: int = 512, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        self.true_cfg_scale = float(true_cfg_scale)
        vsf = vae_scale(pipe)
        # the pipeline's prepare_latents: latent side 2 * (side // (2 vsf)), then 2x2 patches
        self.latent_h, self.latent_w = 2 * (self.height // (vsf * 2)), 2 * (self.width // (vsf * 2))
        seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        self.latent_shape = (seq_len, self.transformer_config.in_channels)
        self.img_ids = pipe._prepare_latent_image_ids(1, self.latent_h // 2, self.latent_w // 2, self.device, self.dtype)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
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
        return self.pipe._unpack_latents(latents, self.height, self.width, vae_scale(self.pipe))

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        return self.unpack(latents) / c.scaling_factor + c.shift_factor

    @staticmethod
    def tiny_pipeline():
        """A 2-level VAE (vae_scale_factor 2, 4 latent channels), so 32x32 images have 16x16 latents packed to
        [64, 16]; the dynamic-shift scheduler of the real configs (mu from the image sequence length)."""
        import diffusers
        from transformers import CLIPTextModel, T5Config, T5EncoderModel

        from difrl.models.tiny import (tiny_clip_config, tiny_clip_tokenizer, tiny_image_vae, tiny_t5_kwargs,
                                       tiny_t5_tokenizer)

        clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        return diffusers.FluxPipeline(
            transformer=diffusers.FluxTransformer2DModel(
                patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                axes_dims_rope=(4, 4, 8)),
            vae=tiny_image_vae(),
            text_encoder=CLIPTextModel(tiny_clip_config(len(clip_tok), 32, 32)),
            tokenizer=clip_tok,
            text_encoder_2=T5EncoderModel(T5Config(**tiny_t5_kwargs(len(t5_tok), 32))),
            tokenizer_2=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                max_image_seq_len=4096),
        )
