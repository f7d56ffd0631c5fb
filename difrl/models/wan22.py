"""Wan 2.2 text-to-video (`WanPipeline`): TI2V-5B (`expand_timesteps`: a timestep per latent token, the 48-channel
VAE) and T2V-A14B (two experts, `transformer` for high noise and `transformer_2` for low noise).

    policy = load_flow_policy("wan22", "/models/Wan2.2-TI2V-5B-Diffusers", dtype="bf16", height=704, width=1280,
                              num_frames=121)                     # the VAE stays fp32 (vae_dtype=), as for Wan 2.1
    policy = load_flow_policy("wan22", "/models/Wan2.2-T2V-A14B-Diffusers", dtype="bf16", height=480, width=832,
                              num_frames=81, guidance_scale_2=3.0, train_experts="both")

Latent shape (one sample): `(C, (F - 1) // 4 + 1, H // s, W // s)`: TI2V-5B C = 48, s = 16 (e.g. (48, 31, 44, 80) at
704x1280x121; height and width multiples of 32); A14B the Wan 2.1 VAE, C = 16, s = 8. Timesteps: `1000 sigma`; with
`expand_timesteps` on every latent token, `[B, F' * H'/2 * W'/2]`, as the pipeline passes them (its first-frame mask
is all ones for text-to-video; rows of a training micro-batch may carry different timesteps). Image-to-video
conditioning (the first frame's latent with timestep 0) is not trained.

Two experts (A14B): `policy.module` is one `WanExperts` module holding both transformers, so LoRA, FSDP sharding,
checkpoints, the rollout copy and difrl plan see one module. Each row goes to the expert the pipeline would use at its
timestep: `transformer` when `1000 sigma >= boundary_ratio * num_train_timesteps`, else `transformer_2` (training
micro-batches mix steps, so the routing is per row). Under several processes every process runs every expert some
process needs in that forward, and both in a forward with gradients (an expert with none of this process's rows runs on
one row whose output is multiplied by 0), so FSDP's gathers and DDP's / FSDP's gradient reductions stay in step. `train_experts` (model.train_experts) picks what trains:
"both" (default: each transition trains the expert that produced it), "high" or "low"; the other expert is frozen
(no LoRA on it; full fine-tuning leaves it out of the optimizer). Saved files: LoRA as RUN/lora (the high-noise
expert: `pipe.load_lora_weights(RUN/lora)`) and RUN/lora/transformer_2 (`pipe.load_lora_weights(RUN/lora/transformer_2,
load_into_transformer_2=True)`); a full fine-tune as RUN/transformer and RUN/transformer_2 (each `from_pretrained`).

Guidance: true CFG with a negative prompt when `guidance > 1` (WanPipeline's `guidance_scale`), the low-noise expert's
rows with `guidance_scale_2` (model.guidance_scale_2; None: the same scale), as the pipeline does.
"""

from __future__ import annotations

import torch
from torch import nn

from difrl.models.diffusers_base import present_targets
from difrl.models.wan import WanPolicy
from difrl.quant.linear import QUANT_PRESETS

TRAIN_EXPERTS = ("both", "high", "low")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class WanExperts(nn.Module):
    """Wan 2.2 A14B's two experts as one module with a transformer's forward: row b goes to `transformer` (high noise)
    when timestep[b] >= boundary_timestep, else to `transformer_2`. hidden_states [B, C, F, H, W], timestep [B] (or
    [B, tokens]), encoder_hidden_states [B, L, D] -> ([B, C, F, H, W],)."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_timestep = float(boundary_timestep)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def config(self):
        return self.transformer.config

    def high_noise_rows(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows the high-noise expert takes (WanPipeline: `t >= boundary_timestep`)."""
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        if _is_fake(t):  # difrl plan: no values; every row through the high-noise expert (one expert's activations)
            return torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
        return t >= self.boundary_timestep

    def _needed(self, high: torch.Tensor) -> list[bool]:
        """Which experts run in this forward: those with rows here; under several processes those with rows on any
        process (a MAX all-reduce), so every process gathers the same FSDP units in the same order, and in a forward
        with gradients both (every trained parameter then takes part in each backward: DDP's reducer and FSDP's
        reduce-scatters expect the same parameters on every process and every step)."""
        import torch.distributed as dist

        if _is_fake(high):
            return [True, True]  # difrl plan: the low-noise expert runs its one-row stand-in
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if several and torch.is_grad_enabled():
            return [True, True]
        need = torch.stack([high.any(), (~high).any()]).to(torch.int32)
        if several:
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
        return [bool(n) for n in need.tolist()]

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
        high = self.high_noise_rows(timestep)
        out = hidden_states.new_zeros(hidden_states.shape)
        for i, (expert, rows, needed) in enumerate(zip((self.transformer, self.transformer_2), (high, ~high),
                                                       self._needed(high))):
            if not needed:
                continue
            if _is_fake(rows):  # difrl plan: every row on the high-noise expert, the one-row stand-in on the other
                idx = torch.arange(rows.shape[0] if i == 0 else 0, device=rows.device)
            else:
                idx = rows.nonzero().squeeze(1)
            stand_in = idx.numel() == 0  # needed elsewhere: run one row, contribute 0 (its gradient is zero)
            if stand_in:
                idx = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
            y = expert(hidden_states=hidden_states[idx], timestep=timestep[idx],
                       encoder_hidden_states=encoder_hidden_states[idx], return_dict=False, **kwargs)[0]
            out = out.to(y.dtype)
            out = out + 0 * y.sum() if stand_in else out.index_put((idx,), y)
        return (out,)

    def save_pretrained(self, path, **kwargs) -> None:
        """RUN/transformer (the high-noise expert) and, beside it, RUN/transformer_2: each a diffusers checkpoint."""
        from pathlib import Path

        self.transformer.save_pretrained(path, **kwargs)
        self.transformer_2.save_pretrained(Path(path).parent / "transformer_2", **kwargs)


class Wan22Policy(WanPolicy):
    """Wan 2.2 (`WanPipeline`): TI2V-5B (per-token timesteps) or A14B (two experts routed per row by timestep)."""

    kind = "wan22"
    quant_preset = QUANT_PRESETS["wan22"]
    model_options = ("num_frames", "guidance_scale_2", "train_experts")

    def __init__(self, pipe, *, guidance_scale_2: float | None = None, train_experts: str = "both", **options):
        super().__init__(pipe, **options)
        two = getattr(pipe, "transformer_2", None) is not None
        if train_experts not in TRAIN_EXPERTS:
            raise ValueError(f"model.train_experts={train_experts!r}: expected one of {', '.join(TRAIN_EXPERTS)}")
        if not two and (guidance_scale_2 is not None or train_experts != "both"):
            raise ValueError("model.guidance_scale_2 and model.train_experts are for Wan 2.2's two-expert A14B "
                             "(transformer_2); this pipeline has one transformer (TI2V-5B): leave them unset")
        self.guidance_scale_2 = guidance_scale_2
        self.train_experts = train_experts
        if two:
            boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
            self._transformer = WanExperts(pipe.transformer, pipe.transformer_2, boundary)
            trained = {"both": ("transformer", "transformer_2"), "high": ("transformer",), "low": ("transformer_2",)}
            for name in ("transformer", "transformer_2"):
                getattr(pipe, name).requires_grad_(name in trained[train_experts])
            if train_experts != "both":  # peft targets named in full, inside the trained expert only
                names = [n for n, m in pipe.transformer.named_modules() if isinstance(m, nn.Linear)]
                keep = present_targets(pipe.transformer, self.lora_candidates)
                self.lora_target_modules = [f"{trained[train_experts][0]}.{n}" for n in names
                                            if any(n == t or n.endswith("." + t) for t in keep)]

    @classmethod
    def _check_variant(cls, pipe) -> None:
        two, ratio = getattr(pipe, "transformer_2", None) is not None, pipe.config.get("boundary_ratio")
        if two != (ratio is not None):
            raise ValueError(f"this WanPipeline has {'a' if two else 'no'} transformer_2 and boundary_ratio={ratio}: "
                             "Wan 2.2 A14B needs both (the pipeline switches experts at boundary_ratio x 1000)")
        if not two and not pipe.config.get("expand_timesteps", False):
            raise ValueError("this WanPipeline has no expand_timesteps and no transformer_2 (a Wan 2.1 text-to-video "
                             "checkpoint): set model.kind=wan for it; model.kind=wan22 trains Wan 2.2 (TI2V-5B, A14B)")

    def experts(self) -> list[nn.Module]:
        """The pipeline's transformers (A14B: both experts)."""
        return [m for m in (self.pipe.transformer, getattr(self.pipe, "transformer_2", None)) if m is not None]

    def lora_components(self) -> list[tuple[str, str, str, dict]]:
        """(sub-directory of the LoRA directory, prefix of its keys in policy.module, pipeline attribute, keyword
        arguments of pipe.load_lora_weights) per trained transformer (difrl.models.lora_io)."""
        if not isinstance(self._base_module(), WanExperts):
            return super().lora_components()
        parts = [("", "transformer.", "transformer", {}),
                 ("transformer_2", "transformer_2.", "transformer_2", {"load_into_transformer_2": True})]
        return [p for p in parts if self.train_experts in ("both", "high" if p[2] == "transformer" else "low")]

    def _base_module(self) -> nn.Module:
        m = self._transformer
        while not isinstance(m, WanExperts) and hasattr(m, "get_base_model"):  # a peft wrapper
            m = m.get_base_model()
        return m

    def _row_scale(self, scale: float, sigma: torch.Tensor):
        """The CFG scale per row: guidance_scale_2 on the low-noise expert's rows (the pipeline's
        `current_guidance_scale`), [B, 1, 1, 1, 1]; one scale when there is one expert or no guidance_scale_2."""
        experts = self._base_module()
        if self.guidance_scale_2 is None or not isinstance(experts, WanExperts):
            return scale
        high = experts.high_noise_rows(sigma * 1000)
        return torch.where(high, scale, float(self.guidance_scale_2)).view(-1, 1, 1, 1, 1)

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    def compile_blocks(self, **compile_kwargs) -> int:
        blocks = [m for e in self.experts() for m in e.modules() if type(m).__name__ in self.block_classes]
        for block in blocks:
            block.compile(**compile_kwargs)
        return len(blocks)

    def _forward(self, x, sigma, cond, guidance):
        """x [B, C, F', H', W'], sigma [B] -> the transformer's (A14B: the routed experts') output, timestep 1000 sigma
        [B]; with expand_timesteps [B, F' * H'/ph * W'/pw]: each row's 1000 sigma on each of its tokens (WanPipeline:
        `mask[0][0][:, ::2, ::2] * t`, flattened)."""
        self._check_batch(cond, x.shape[0])
        timestep = sigma * 1000
        if self.pipe.config.get("expand_timesteps", False):
            _, ph, pw = self.transformer_config.patch_size
            timestep = timestep[:, None].expand(x.shape[0], x.shape[2] * (x.shape[3] // ph) * (x.shape[4] // pw))
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

    @staticmethod
    def tiny_two_expert_pipeline(boundary_ratio: float = 0.7):
        """A tiny A14B layout for tests: two experts (Wan 2.1's tiny transformer sizes, 16 latent channels, different
        random weights), Wan 2.1's tiny VAE, `boundary_ratio`; Wan 2.1's tiny scheduler (shift 3), so 4 Euler steps take
        timesteps 1000 and 858 on the high-noise expert and 602 and 9 on the low-noise one (none on the boundary)."""
        import diffusers

        from difrl.models.wan import WanPolicy

        pipe = WanPolicy.tiny_pipeline()

        def expert():
            return diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)

        return diffusers.WanPipeline(transformer=expert(), transformer_2=expert(), vae=pipe.vae,
                                     text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, scheduler=pipe.scheduler,
                                     boundary_ratio=boundary_ratio)
