"""SD3 / SD3.5 (`StableDiffusion3Pipeline`): two CLIPs + T5, pooled projections, true classifier-free guidance.

    policy = load_flow_policy("sd3", "/models/sd3.5-medium", dtype="bf16", height=512, width=512)

Guidance: the base class's true CFG when `guidance > 1` (difrl/models/diffusers_base.py).
Latent shape (one sample; vsf = the VAE's spatial scale factor, 8 for the real models):
`(C, H // vsf, W // vsf)`, e.g. (16, 64, 64) at 512x512. Timesteps: `1000 sigma`, as the pipeline passes them.

SD3.5 Large and Medium are this kind too: the same pipeline and transformer class, whose config adds RMS qk-norm
(`qk_norm="rms_norm"`, both) and, on Medium, a second self-attention `attn2` over the image tokens in the first
blocks (`dual_attention_layers`, 0-12 of 24). `tiny_pipeline("sd3.5-medium")` builds that shape for the tests.
LoRA targets (`lora_candidates`): the joint attention's eight projections, the list Flow-GRPO (yifan123/flow_grpo
scripts/train_sd3.py), Flow-Factory (SD3_5Adapter.default_target_modules) and diffusers' train_dreambooth_lora_sd3.py
use for SD3.5, so `attn2.*` is NOT targeted: peft matches by suffix and `attn.to_q` never names `attn2.to_q`, which
keeps a run's trained parameters (and its rank's meaning) those of the reference recipes. A run that wants the dual
attention adapted too names it: `train.lora.targets=[attn.to_q, ..., attn2.to_q, attn2.to_k, attn2.to_v,
attn2.to_out.0]`.
"""

from __future__ import annotations

from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, vae_scale
from difrl.quant.linear import QUANT_PRESETS


class SD3Policy(DiffusersFlowPolicy):
    """SD3 / SD3.5 (`StableDiffusion3Pipeline`): two CLIPs + T5, pooled projections, true CFG."""

    kind = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    accepted_classes = ("StableDiffusion3Pipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")  # text_encoder_3 / tokenizer_3 (T5) may be dropped: the pipeline then uses zeros
    # Flow-GRPO's SD3.5 list (yifan123/flow_grpo scripts/train_sd3.py; docs/reference/specs/ecosystem.md §2.1)
    lora_candidates = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                       "attn.to_out.0", "attn.to_q", "attn.to_v")
    quant_preset = QUANT_PRESETS["sd3"]  # Sol-RL's skip list (docs/reference/specs/lowprec-and-correctors.md §1.4)
    block_classes = ("JointTransformerBlock",)  # the repeated transformer blocks (regional compile, sharding)
    fsdp_fp32_inputs = ("timestep",)  # 1000 sigma: the pipeline embeds it in fp32 (bf16 would round 737.9 to 736)

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 256, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        vsf = vae_scale(pipe)
        self.latent_shape = (self.transformer_config.in_channels, self.height // vsf, self.width // vsf)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
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

    @staticmethod
    def tiny_pipeline(variant: str = "sd3"):
        """A 2-level VAE (vae_scale_factor 2, 4 latent channels), so 32x32 images have 16x16 latents; static shift 3.
        Two transformer layers: the last one is context-pre-only (no to_add_out), the first has every LoRA target.
        CLIP hidden states (16 + 16) are zero-padded up to the T5 width (32) = joint_attention_dim; pooled
        projections (32 + 32) = pooled_projection_dim, as in SD3 (768 + 1280 -> 4096; 2048).
        `variant="sd3.5-medium"`: SD3.5-Medium's shape, RMS qk-norm and the first layer a dual-attention one (attn2)."""
        import diffusers
        from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

        from difrl.models.tiny import (tiny_clip_config, tiny_clip_tokenizer, tiny_image_vae, tiny_t5_kwargs,
                                       tiny_t5_tokenizer)

        variants = {"sd3": {}, "sd3.5-medium": {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}}
        if variant not in variants:
            raise ValueError(f"unknown tiny SD3 variant {variant!r}; expected one of {sorted(variants)}")
        clip_tok, clip_tok2, t5_tok = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
        return diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(
                sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
                pos_embed_max_size=16, **variants[variant]),
            vae=tiny_image_vae(),
            text_encoder=CLIPTextModelWithProjection(tiny_clip_config(len(clip_tok), 16, 32)),
            tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(tiny_clip_config(len(clip_tok2), 16, 32)),
            tokenizer_2=clip_tok2,
            text_encoder_3=T5EncoderModel(T5Config(**tiny_t5_kwargs(len(t5_tok), 32))),
            tokenizer_3=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
