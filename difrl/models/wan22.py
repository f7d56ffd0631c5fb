"""Wan 2.2 TI2V-5B text-to-video (`WanPipeline` with `expand_timesteps=True`): the Wan 2.1 adapter with a timestep per
latent token and the Wan 2.2 VAE (48 latent channels, 16x spatial / 4x temporal compression).

    policy = load_flow_policy("wan22", "/models/Wan2.2-TI2V-5B-Diffusers", dtype="bf16", height=704, width=1280,
                              num_frames=121)                     # the VAE stays fp32 (vae_dtype=), as for Wan 2.1

Latent shape (one sample): `(48, (F - 1) // 4 + 1, H // 16, W // 16)`, e.g. (48, 31, 44, 80) at 704x1280x121;
height and width must be multiples of 32 (VAE 16 x patch 2). Timesteps: `1000 sigma` for every latent token,
`[B, F' * H'/2 * W'/2]`, as the pipeline passes them when `expand_timesteps` is set (its first-frame mask is all ones
for text-to-video, so every token of a row carries that row's timestep; rows of a training micro-batch may carry
different ones). Guidance: the base class's true CFG with a negative prompt when `guidance > 1`, as WanPipeline's
`guidance_scale`. Image-to-video conditioning (the first frame's latent with timestep 0) is not trained.

The two-expert Wan 2.2 T2V-A14B (`transformer_2`, `boundary_ratio`) is refused with what it still needs.
"""

from __future__ import annotations

import torch

from difrl.models.wan import WanPolicy
from difrl.quant.linear import QUANT_PRESETS


class Wan22Policy(WanPolicy):
    """Wan 2.2 TI2V-5B (`WanPipeline`, expand_timesteps): Wan 2.1's adapter with per-token timesteps."""

    kind = "wan22"
    quant_preset = QUANT_PRESETS["wan22"]

    @classmethod
    def _check_variant(cls, pipe) -> None:
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise ValueError(
                "this pipeline is Wan 2.2's two-expert T2V-A14B (transformer_2, boundary_ratio): model.kind=wan22 "
                "trains Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers) only; training both experts needs the "
                "policy's module to route rows by sigma between them (ODE, LoRA per expert, FSDP, rollout copy), "
                "which difrl does not do yet")
        if not pipe.config.get("expand_timesteps", False):
            raise ValueError("this WanPipeline has no expand_timesteps (a Wan 2.1 text-to-video checkpoint): set "
                             "model.kind=wan for it; model.kind=wan22 trains Wan 2.2 TI2V-5B")

    def _forward(self, x, sigma, cond, guidance):
        """x [B, C, F', H', W'], sigma [B] -> the transformer's output, with timestep [B, F' * H'/ph * W'/pw]: each
        row's 1000 sigma on each of its tokens (WanPipeline: `mask[0][0][:, ::2, ::2] * t`, flattened)."""
        self._check_batch(cond, x.shape[0])
        _, ph, pw = self.transformer_config.patch_size
        tokens = x.shape[2] * (x.shape[3] // ph) * (x.shape[4] // pw)
        timestep = (sigma * 1000)[:, None].expand(x.shape[0], tokens)
        return self.module(hidden_states=x.to(self.dtype), timestep=timestep,
                           encoder_hidden_states=cond["prompt_embeds"].to(self.dtype), return_dict=False)[0]

    @staticmethod
    def tiny_pipeline():
        """Wan 2.2's VAE layout (residual blocks, 2x2 pixel patches in, 48 latent channels: 16x spatial and 4x temporal
        compression), so 32x32 and 5 frames give latents [48, 2, 2, 2]; shift 5 with the flow-matching Euler scheduler
        (so a pipeline call is the same ODE as difrl's sampler)."""
        import diffusers
        from transformers import UMT5Config, UMT5EncoderModel

        from difrl.models.tiny import tiny_t5_kwargs, tiny_t5_tokenizer

        t5_tok = tiny_t5_tokenizer()
        z = 48
        gen = torch.Generator().manual_seed(0)  # per-channel statistics of the size of the real ones (mean ~0, std ~1)
        mean = (torch.randn(z, generator=gen) * 0.3).tolist()
        std = (torch.rand(z, generator=gen) * 0.5 + 0.5).tolist()
        return diffusers.WanPipeline(
            transformer=diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
            vae=diffusers.AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1],
                                           num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                                           in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                           scale_factor_temporal=4, latents_mean=mean, latents_std=std),
            text_encoder=UMT5EncoderModel(UMT5Config(**tiny_t5_kwargs(len(t5_tok), 32))),
            tokenizer=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
            expand_timesteps=True,
        )
