"""FLUX.2 [dev] (`Flux2Pipeline`, kind "flux2") and FLUX.2 [klein] (`Flux2KleinPipeline`, kind "flux2_klein"): one
Flux2Transformer2DModel over 2x2-patchified 128-channel latents, an LLM's stacked hidden states as the text embedding.

    policy = load_flow_policy("flux2_klein", "/models/FLUX.2-klein-base-9B", dtype="bf16", height=512, width=512)
    policy = load_flow_policy("flux2", "/models/FLUX.2-dev", dtype="bf16", height=512, width=512)

Text: the pipeline's own `encode_prompt` (a chat template around the prompt, padded / truncated to
`max_sequence_length`, the hidden states of three layers stacked per token: [dev] Mistral Small 3.x layers
(10, 20, 30), [klein] Qwen3 layers (9, 18, 27); embedding [B, L, 3 D]). Text position ids (0, 0, 0, l) and image
ones (0, i, j, 0) are the pipeline's `_prepare_text_ids` / `_prepare_latent_ids`.

Guidance: [dev] is guidance-distilled: `guidance` is the *embedded* guidance (the pipeline's `guidance_scale`,
4.0 by default), one forward per step, no uncond pass. [klein] has no guidance embedding: the base checkpoints
(FLUX.2-klein-base-4B / -9B, the ones Flow-Factory trains) do true CFG for `guidance > 1` with the empty negative
prompt (the pipeline's `do_classifier_free_guidance`, [uncond; cond] in one batch here); the step-distilled ones
(model_index.json `is_distilled: true`) ignore guidance in the pipeline, and refuse `guidance > 1` here.

Latent shape (one sample; vsf = the VAE's spatial scale factor, 8 for the real model): the pipeline's
`prepare_latents` layout `(4 C, H // (2 vsf), W // (2 vsf))` (C = 32 VAE channels, so (128, 32, 32) at 512x512),
batch-normalised by the VAE's `bn` statistics; `pipe(latents=...)` takes it as it is. The transformer sees it
flattened to tokens [B, h w, 4 C] (`pack`); decoding un-normalises, un-patchifies and runs the VAE.

Timesteps: sigmas `linspace(1, 1/N, N)` shifted by the pipeline's `compute_empirical_mu(h w, N)` (it depends on
the number of steps too); the transformer gets `(1000 sigma)` cast to the model dtype, / 1000 (the pipeline's
expression, so rollouts match it to the last bit).
"""

from __future__ import annotations

import numpy as np
import torch

from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, vae_scale
from difrl.quant.linear import QUANT_PRESETS


class Flux2Policy(DiffusersFlowPolicy):
    """FLUX.2 [dev] (`Flux2Pipeline`): Mistral3 text encoder, embedded distilled guidance."""

    kind = "flux2"
    pipeline_class = "Flux2Pipeline"
    accepted_classes = ("Flux2Pipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # every Linear of the repeated blocks (diffusers' Flux2 _tp_plan lists the same ones): the double blocks' attention
    # and SwiGLU linears, the single blocks' fused qkv+mlp projection; their output projection is added per block
    # in __init__
    lora_candidates = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                       "ff_context.linear_out", "attn.to_qkv_mlp_proj")
    quant_preset = QUANT_PRESETS["flux2"]
    block_classes = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 512, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        # the single blocks' output projection is a Linear named attn.to_out, a suffix that also names the double blocks'
        # to_out ModuleList (which peft refuses): one name per block, as diffusers' train_dreambooth_lora_flux2_klein.py
        self.lora_target_modules += [f"single_transformer_blocks.{i}.attn.to_out"
                                     for i in range(self.transformer_config.num_single_layers)]
        vsf = vae_scale(pipe)
        # prepare_latents: latent side 2 * (side // (2 vsf)), then 2x2 patches -> (4C, h, w)
        self.grid_h, self.grid_w = self.height // (2 * vsf), self.width // (2 * vsf)
        if self.grid_h < 1 or self.grid_w < 1:
            raise ValueError(f"height={height}, width={width}: FLUX.2 needs both at least {2 * vsf} pixels")
        self.latent_shape = (self.transformer_config.in_channels, self.grid_h, self.grid_w)
        # [1, h w, 4] int64 (t, i, j, l) coordinates in the packed token order
        self.img_ids = pipe._prepare_latent_ids(torch.empty(1, 1, self.grid_h, self.grid_w)).to(self.device)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts: list[str]) -> Cond:
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds}  # [B, L, 3 D]; the text ids follow from its shape

    def _set_timesteps(self, sched, num_steps: int) -> None:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        # Flux2(Klein)Pipeline.__call__: sigmas linspace(1, 1/N, N) (the scheduler's own when use_flow_sigmas),
        # mu from the token count and N
        mu = compute_empirical_mu(image_seq_len=self.grid_h * self.grid_w, num_steps=num_steps)
        if getattr(sched.config, "use_flow_sigmas", False):
            sched.set_timesteps(num_steps, mu=mu)
        else:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def _cfg_scale(self, guidance: float) -> float | None:
        # `guidance` is the embedded distilled guidance, never a CFG scale
        if not self.transformer_config.guidance_embeds and guidance not in (0.0, 1.0):
            raise ValueError(f"this FLUX.2 transformer has no guidance embedding, so guidance={guidance} would be "
                             "ignored; pass guidance 1.0")
        return None

    def _guidance(self, x: torch.Tensor, guidance: float) -> torch.Tensor | None:
        if not self.transformer_config.guidance_embeds:
            return None
        return torch.full((x.shape[0],), float(guidance), device=x.device, dtype=torch.float32)

    def _forward(self, x, sigma, cond, guidance):
        """x [B, 4C, h, w] -> the transformer's velocity [B, 4C, h, w] (tokens [B, h w, 4C] in between)."""
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        embeds = cond["prompt_embeds"]
        out = self.module(
            hidden_states=self.pack(x).to(dt),
            timestep=(sigma * 1000).to(dt) / 1000,  # the pipeline's `t.to(latents.dtype) / 1000`
            guidance=self._guidance(x, guidance),
            encoder_hidden_states=embeds.to(dt),
            txt_ids=self.pipe._prepare_text_ids(embeds).to(x.device),  # [B, L, 4]: (0, 0, 0, l)
            img_ids=self.img_ids.to(x.device),
            return_dict=False,
        )[0]
        return self.unpack(out)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 4C, h, w] -> tokens [B, h w, 4C] (the pipeline's `_pack_latents`)."""
        return self.pipe._pack_latents(latents)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, h w, 4C] -> [B, 4C, h, w] (row-major, as `_prepare_latent_ids` numbers them)."""
        return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, self.grid_h, self.grid_w)

    def _vae_latents(self, latents):
        # the pipeline's decode: undo the VAE's batch norm, then the 2x2 patches -> [B, C, 2h, 2w]
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                            latents.dtype)
        return self.pipe._unpatchify_latents(latents * std + mean)

    @staticmethod
    def tiny_pipeline():
        """A Mistral3 encoder (31 layers of width 16, so the pipeline's layers 10, 20, 30 exist; a 1-layer Pixtral
        vision tower it never runs), a 2-level Flux2 VAE (vae_scale_factor 2, 4 latent channels: 32x32 images
        have (16, 8, 8) latents), the FLUX.2 scheduler config."""
        import diffusers
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        from difrl.models.tiny import tiny_flux2_processor, tiny_mistral3_kwargs

        processor = tiny_flux2_processor()
        tok = processor.tokenizer
        encoder = Mistral3ForConditionalGeneration(Mistral3Config(**tiny_mistral3_kwargs(
            len(tok), tok.convert_tokens_to_ids("[IMG]"))))
        return diffusers.Flux2Pipeline(transformer=_tiny_transformer(48, 2.0, guidance_embeds=True), vae=_tiny_vae(),
                                       text_encoder=encoder, tokenizer=processor, scheduler=_scheduler())


class Flux2KleinPolicy(Flux2Policy):
    """FLUX.2 [klein] (`Flux2KleinPipeline`): Qwen3 text encoder, true CFG (base checkpoints)."""

    kind = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    accepted_classes = ("Flux2KleinPipeline",)

    def _cfg_scale(self, guidance: float) -> float | None:
        if guidance <= 1.0:
            return None
        if self.pipe.config.get("is_distilled", False):
            raise ValueError(f"this FLUX.2 [klein] checkpoint is step-distilled (model_index.json is_distilled: "
                             f"true): its pipeline ignores guidance={guidance}; pass guidance 1.0 (or train a "
                             "klein-base checkpoint)")
        return float(guidance)  # true CFG, negative prompt "" as the pipeline's

    @staticmethod
    def tiny_pipeline():
        """A Qwen3 encoder (28 layers of width 16, so the pipeline's layers 9, 18, 27 exist), no guidance
        embedding (a klein-base), the VAE and scheduler of the [dev] tiny pipeline."""
        import diffusers
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from difrl.models.tiny import tiny_qwen3_kwargs, tiny_qwen_tokenizer

        tok = tiny_qwen_tokenizer()
        return diffusers.Flux2KleinPipeline(
            transformer=_tiny_transformer(48, 3.0, guidance_embeds=False), vae=_tiny_vae(),
            text_encoder=Qwen3ForCausalLM(Qwen3Config(**tiny_qwen3_kwargs(len(tok)))), tokenizer=tok,
            scheduler=_scheduler(), is_distilled=False)


def _tiny_transformer(text_dim: int, mlp_ratio: float, guidance_embeds: bool):
    import diffusers

    # in_channels = 4 x 4 VAE channels; the 4 rope axes (t, h, w, l) sum to the head dim 16. [dev] and [klein] get other
    # MLP widths, so that one's LoRA does not fit the other (the real ones differ in width: 6144 and 4096)
    return diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=text_dim, timestep_guidance_channels=32, mlp_ratio=mlp_ratio, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds)


def _tiny_vae():
    import diffusers

    vae = diffusers.AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, sample_size=32, use_quant_conv=False, use_post_quant_conv=False)
    # batch-norm statistics the decode undoes (the real ones are measured; fresh ones are 0 / 1 and would hide it)
    g = torch.Generator().manual_seed(0)
    vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=g))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    return vae


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # black-forest-labs/FLUX.2-dev scheduler_config.json (the klein ones are the same)
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096,
                                           time_shift_type="exponential")
