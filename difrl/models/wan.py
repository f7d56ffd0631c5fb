"""Wan 2.1 text-to-video (`WanPipeline`): video latents [C, F, H, W], UMT5 text encoder, CFG with a negative prompt.

    policy = load_flow_policy("wan", "/models/Wan2.1-T2V-1.3B-Diffusers", dtype="bf16", height=480, width=832,
                              num_frames=81)                      # the VAE stays fp32 (vae_dtype=)

Guidance: the base class's true CFG when `guidance > 1` (difrl/models/diffusers_base.py). Latent shape (one
sample): `(C, (F - 1) // 4 + 1, H // 8, W // 8)`, e.g. (16, 21, 60, 104) at 480x832x81. Timesteps:
`1000 sigma`, as the pipeline passes them. A Wan 2.2 directory (TI2V-5B's per-token timesteps, A14B's two experts)
is refused here, naming model.kind=wan22 (difrl/models/wan22.py).
"""

from __future__ import annotations

import torch

from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, dtype_keyword
from difrl.quant.linear import QUANT_PRESETS


class WanPolicy(DiffusersFlowPolicy):
    """Wan 2.1 T2V (`WanPipeline`): video latents [C, F, H, W], UMT5 text encoder, CFG with a negative prompt."""

    kind = "wan"
    pipeline_class = "WanPipeline"
    accepted_classes = ("WanPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Flow-GRPO's Wan 2.1 list (train_wan2_1.py); add_* exist only in I2V checkpoints
    # (docs/reference/specs/ecosystem.md §2.1)
    lora_candidates = ("add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v")
    quant_preset = QUANT_PRESETS["wan"]  # ours: embedders and the output projection stay exact
    block_classes = ("WanTransformerBlock",)  # the repeated transformer blocks (regional compile, sharding)
    fsdp_fp32_inputs = ("timestep",)  # 1000 sigma: the pipeline embeds it in fp32 (bf16 would round 737.9 to 736)
    model_options = ("num_frames",)
    fp32_components = ("vae",)  # from_pretrained's vae_dtype default

    def __init__(self, pipe, *, height: int = 480, width: int = 832, num_frames: int = 81, negative_prompt: str = "",
                 max_sequence_length: int = 512, cache_prompts: bool = False):
        self._check_variant(pipe)
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
    def _check_variant(cls, pipe) -> None:
        """Refuse a WanPipeline this class does not train: Wan 2.2 (per-token timesteps, or two experts) is kind wan22."""
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("expand_timesteps", False):
            what = "two-expert (A14B)" if getattr(pipe, "transformer_2", None) is not None else "TI2V (expand_timesteps)"
            raise ValueError(f"this pipeline is a Wan 2.2 {what} checkpoint, and model.kind=wan trains Wan 2.1 "
                             "text-to-video (one transformer, one timestep per sample): set model.kind=wan22 "
                             "(difrl/models/wan22.py), or train a Wan 2.1 T2V directory (Wan-AI/Wan2.1-T2V-1.3B-"
                             "Diffusers or -14B-Diffusers)")

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 480, width: int = 832, num_frames: int = 81,
                        device=None, vae_dtype="fp32", **options):
        """The Wan VAE runs in fp32 by default (diffusers' Wan examples load it so)."""
        import diffusers

        check_pipeline_dir(path, cls)
        vae = diffusers.AutoencoderKLWan.from_pretrained(str(path), subfolder="vae", local_files_only=True,
                                                         **{dtype_keyword(): as_dtype(vae_dtype)})
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

    @staticmethod
    def tiny_pipeline():
        """Wan's usual 8x spatial / 4x temporal VAE, so 32x32 and 5 frames give latents [16, 2, 4, 4]; shift 3 with
        the flow-matching Euler scheduler (so a pipeline call is the same ODE as difrl's sampler)."""
        import diffusers
        from transformers import UMT5Config, UMT5EncoderModel

        from difrl.models.tiny import tiny_t5_kwargs, tiny_t5_tokenizer

        t5_tok = tiny_t5_tokenizer()
        return diffusers.WanPipeline(
            transformer=diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
            # base_dim 8: with 3 channels a random decoder's output hardly depends on the latents (a colour reward
            # moved by at most 0.0004 under any latent change of rms 0.5; with 8: 0.011, 7 sample std)
            vae=diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           temperal_downsample=[False, True, True]),
            text_encoder=UMT5EncoderModel(UMT5Config(**tiny_t5_kwargs(len(t5_tok), 32))),
            tokenizer=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
