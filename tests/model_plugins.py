"""A model family from outside difrl, registered through the hook: docs/guides/adding-a-model.md's example, run by the tests.

    import model_plugins        # with tests/ on sys.path: registers model.kind "example" (or the difrl.models entry point)

ExamplePolicy adapts diffusers' StableDiffusion3Pipeline (an MMDiT with two CLIP encoders and a T5) and is written
against DiffusersFlowPolicy's hooks from scratch, not by subclassing difrl's SD3 adapter, so that it shows every hook
a family defines. Its tiny pipeline has other widths than difrl's tiny SD3 (a LoRA of one does not fit the other). tests/test_diffusers_models.py and tests/test_train_diffusers.py run their checks
on it as on the built-in families; tests/test_model_registry.py checks that the guide shows this file unchanged.
"""

from __future__ import annotations

import torch

from difrl.models import register_model
from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, vae_scale


@register_model("example")
class ExamplePolicy(DiffusersFlowPolicy):
    """SD3-type MMDiT (`StableDiffusion3Pipeline`): latents [C, H/8, W/8], timestep 1000 sigma, true CFG."""

    pipeline_class = "StableDiffusion3Pipeline"  # the diffusers class from_pretrained loads
    accepted_classes = ("StableDiffusion3Pipeline",)  # model_index.json _class_name values it accepts
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")  # check_pipeline_dir refuses a directory without one, naming it
    lora_candidates = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out")  # module-name suffixes; those present become LoRA targets
    block_classes = ("JointTransformerBlock",)  # the repeated blocks: FSDP2 units, regional compile
    fsdp_fp32_inputs = ("timestep",)  # 1000 sigma, embedded in fp32 by the pipeline: FSDP must not cast it
    quant_preset = {"skip": ("pos_embed", "time_text_embed", "context_embedder", "proj_out"), "min_dim": 0}

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 256, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        vsf = vae_scale(pipe)  # the VAE's spatial scale factor: 8 for the real models, 2 for the tiny one
        self.latent_shape = (self.transformer_config.in_channels, self.height // vsf, self.width // vsf)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)  # a missing directory / component / another model's index: a named error
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts: list[str]) -> Cond:
        # the pipeline's own encode_prompt: [B, L, D] token embeddings and [B, P] pooled ones, as __call__ makes them
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                       device=self.device, do_classifier_free_guidance=False,
                                                       max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float) -> torch.Tensor:
        # x [B, C, h, w], sigma [B] fp32 -> the transformer's raw output [B, C, h, w] (the base class casts it to fp32
        # and, with guidance > 1, has batched [uncond; cond] into x and cond before this call)
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        return self.module(hidden_states=x.to(dt), timestep=sigma * 1000,  # the pipeline's timestep: 1000 sigma
                           encoder_hidden_states=cond["prompt_embeds"].to(dt),
                           pooled_projections=cond["pooled_prompt_embeds"].to(dt), return_dict=False)[0]

    def _vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        c = self.pipe.vae.config  # what vae.decode takes: the pipeline's un-scaling, exactly
        return latents / c.scaling_factor + c.shift_factor

    @staticmethod
    def tiny_pipeline():
        """Two MMDiT layers (the last one context-pre-only), 2-level VAE: 32x32 images have latents [4, 16, 16]."""
        import diffusers
        from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

        from difrl.models.tiny import (tiny_clip_config, tiny_clip_tokenizer, tiny_image_vae, tiny_t5_kwargs,
                                       tiny_t5_tokenizer)

        tok, tok2, t5_tok = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
        return diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(
                sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                caption_projection_dim=16, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
                pos_embed_max_size=16),
            vae=tiny_image_vae(),
            # the CLIP hidden states (16 + 16) are zero-padded to the T5 width (32) = joint_attention_dim; the pooled
            # projections (32 + 32) = pooled_projection_dim
            text_encoder=CLIPTextModelWithProjection(tiny_clip_config(len(tok), 16, 32)),
            tokenizer=tok,
            text_encoder_2=CLIPTextModelWithProjection(tiny_clip_config(len(tok2), 16, 32)),
            tokenizer_2=tok2,
            text_encoder_3=T5EncoderModel(T5Config(**tiny_t5_kwargs(len(t5_tok), 32))),
            tokenizer_3=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
