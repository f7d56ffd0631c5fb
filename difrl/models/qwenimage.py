"""Qwen-Image (`QwenImagePipeline`): packed 2x2 latents of a video-style VAE, Qwen2.5-VL prompt embeddings with a mask,
true CFG with the pipeline's norm rescale.

    policy = load_flow_policy("qwenimage", "/models/Qwen-Image", dtype="bf16", height=512, width=512)

Guidance: `guidance` is the pipeline's `true_cfg_scale` (Flow-GRPO's `pickscore_qwenimage`: 4). For `guidance > 1` one
batched forward over [uncond; cond] (the negative prompt, default "", embedded once), then the pipeline's combination
`v = v_u + w (v_c - v_u)` rescaled per token to the conditional velocity's norm, `v * |v_c| / |v|` over the packed
channel axis (`_guide`, in fp32). `guidance <= 1`: one conditional forward. Qwen-Image is not guidance-distilled: a
transformer with `guidance_embeds` is refused (diffusers' forward cannot embed it either).

Prompts: what the pipeline's `encode_prompt` computes (its chat template; the 34 leading hidden states of the template's
system part are dropped, `prompt_template_encode_start_idx`), the last hidden state of Qwen2.5-VL, gathered with static
shapes so that difrl plan runs it on fake tensors (`_encode_batch`; bit for bit the pipeline's). The pipeline pads a batch
to its longest prompt with a mask; here every prompt is zero-padded to `max_sequence_length` tokens with its mask
(`prompt_embeds_mask`, [B, max_sequence_length] long, 1 = a real token), so conditions of any prompts concatenate (CFG's
[uncond; cond], the prompt cache, rollout chunks). The mask keeps the padding out of the joint attention and text RoPE
positions start at the same place, so the velocity is the pipeline's up to float rounding; the padding costs attention
tokens, so set model.max_sequence_length near the prompts' length (+ 5 tokens of the template's end).

Latent shape (one sample; vsf = the VAE's spatial scale factor, 2 ** len(vae.temperal_downsample), 8 for the real
model): packed `((H // (2 vsf)) * (W // (2 vsf)), 4 z_dim)`, e.g. (1024, 64) at 512x512. The VAE is Wan-style 3D:
one frame, `[B, z_dim, 1, h, w]`, de-normalised with the config's per-channel latents_mean / latents_std. Noise drawn
in the packed shape is the pipeline's i.i.d. Gaussian, so `latents=` takes it as is.

Timesteps: `(1000 sigma)` cast to the model dtype, then / 1000 (the pipeline's `t.to(latents.dtype) / 1000`; the
transformer casts it to its own dtype anyway, so no input is kept fp32 under FSDP). Sigmas: linspace(1, 1/N, N) with
the dynamic shift mu from the packed sequence length (the real scheduler's exponential shift and shift_terminal 0.02).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir
from difrl.quant.linear import QUANT_PRESETS


def real_tokens(hidden: torch.Tensor, attention_mask: torch.Tensor, drop: int, length: int):
    """The pipeline's `_extract_masked_hidden` + `[drop:]` + zero padding, with static shapes: each row's real tokens
    (attention_mask 1) in order, the first `drop` left out, the next at most `length` kept, zero-padded to `length`.
    hidden [B, T, D], attention_mask [B, T] -> (embeds [B, length, D], mask [B, length] long, 1 = a real token)."""
    real = attention_mask.bool()  # [B, T]
    # each row's real tokens first, in order (a stable sort moves the padding back, whichever side it was on)
    order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices  # [B, T]
    idx = order[:, drop:drop + length]  # [B, <= length]
    mask = real.gather(1, idx)  # [B, <= length]
    embeds = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, <= length, D]
    embeds = torch.where(mask[..., None], embeds, torch.zeros((), dtype=embeds.dtype, device=embeds.device))
    pad = length - idx.shape[1]  # every row padded to length: conditions of any prompts concatenate
    return F.pad(embeds, (0, 0, 0, pad)), F.pad(mask.long(), (0, pad))


class QwenImagePolicy(DiffusersFlowPolicy):
    """Qwen-Image (`QwenImagePipeline`): packed latents, Qwen2.5-VL embeddings with a mask, true CFG + norm rescale."""

    kind = "qwenimage"
    pipeline_class = "QwenImagePipeline"
    accepted_classes = ("QwenImagePipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Flow-GRPO's Qwen-Image LoRA (docs/reference/specs/flow-grpo-family.md §2.10): the attention projections of both
    # streams and both streams' MLPs
    lora_candidates = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                       "txt_mlp.net.0.proj", "txt_mlp.net.2")
    quant_preset = QUANT_PRESETS["qwenimage"]
    block_classes = ("QwenImageTransformerBlock",)  # the repeated transformer blocks (regional compile, sharding)

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 512, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        if self.transformer_config.guidance_embeds:
            raise ValueError("this Qwen-Image transformer has guidance_embeds=True (a guidance-distilled variant), which "
                             "difrl's qwenimage adapter does not support: it trains true-CFG Qwen-Image (Qwen/Qwen-Image)")
        if self.max_sequence_length > 1024:  # QwenImagePipeline.check_inputs refuses it too
            raise ValueError(f"max_sequence_length={self.max_sequence_length}: Qwen-Image takes at most 1024 prompt tokens")
        vsf = pipe.vae_scale_factor
        # the pipeline's prepare_latents: latent side 2 * (side // (2 vsf)), then 2x2 patches
        self.latent_h, self.latent_w = 2 * (self.height // (vsf * 2)), 2 * (self.width // (vsf * 2))
        self.img_shape = (1, self.latent_h // 2, self.latent_w // 2)  # one frame's patch grid (the pipeline's img_shapes)
        self.latent_shape = (self.img_shape[1] * self.img_shape[2], self.transformer_config.in_channels)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts: list[str]) -> Cond:
        """QwenImagePipeline.encode_prompt's embeddings (its template, tokenizer call, text encoder and dropped system
        part), gathered with static shapes: the pipeline's boolean indexing has a data-dependent shape, which difrl plan's
        fake tensors cannot run. The same hidden states are copied, so the result is the pipeline's bit for bit."""
        pipe, L = self.pipe, self.max_sequence_length
        drop = pipe.prompt_template_encode_start_idx  # the template's system part: 34 tokens
        tokens = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts],
                                max_length=pipe.tokenizer_max_length + drop, padding=True, truncation=True,
                                return_tensors="pt").to(self.device)
        hidden = pipe.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                   output_hidden_states=True).hidden_states[-1]  # [B, T, D]
        embeds, mask = real_tokens(hidden, tokens.attention_mask, drop, L)
        return {"prompt_embeds": embeds.to(pipe.text_encoder.dtype), "prompt_embeds_mask": mask}

    def _set_timesteps(self, sched, num_steps: int) -> None:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        c = sched.config  # QwenImagePipeline.__call__ step 5: linspace(1, 1/N, N), mu from the packed sequence length
        mu = calculate_shift(self.latent_shape[0], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def _guide(self, v_u: torch.Tensor, v_c: torch.Tensor, scale: float) -> torch.Tensor:
        """The pipeline's true CFG: the guided velocity [B, L, C] rescaled per token to the conditional one's norm."""
        guided = v_u + scale * (v_c - v_u)
        return guided * (v_c.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        return self.module(
            hidden_states=x.to(dt),
            timestep=(sigma * 1000).to(dt) / 1000,  # the pipeline's `t.to(latents.dtype) / 1000`
            encoder_hidden_states=cond["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[self.img_shape]] * x.shape[0],
            return_dict=False,
        )[0]

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> packed [B, (h/2)(w/2), 4C]."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed [B, L, 4C] -> [B, C, h, w]."""
        return self.pipe._unpack_latents(latents, self.height, self.width, self.pipe.vae_scale_factor)[:, :, 0]

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        z = self.unpack(latents)[:, :, None]  # [B, z_dim, 1, h, w]: one frame of the 3D VAE
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return z / inv_std + mean  # the pipeline's expression, to the last bit

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1], fp32 (the 3D VAE's one frame)."""
        return super().decode(latents)[:, 0]  # the base gives the video layout [B, 1, 3, H, W]

    @staticmethod
    def tiny_pipeline():
        """A 3-level Qwen-Image VAE (vae_scale_factor 4, z_dim 4), so 32x32 images have 8x8 latents packed to [16, 16];
        two transformer blocks of width 32; a 2-layer Qwen2.5-VL of width 32 (its 1-block vision tower unused) with the
        byte-level Qwen2 tokenizer of difrl/models/tiny.py, whose template prefix is the real 34 tokens; Qwen-Image's
        scheduler config (dynamic exponential shift, shift_terminal 0.02)."""
        import diffusers
        from transformers import Qwen2_5_VLForConditionalGeneration

        from difrl.models.tiny import tiny_qwen2_tokenizer, tiny_qwen25_vl_config

        tok = tiny_qwen2_tokenizer()
        text = tiny_qwen25_vl_config(tok)
        return diffusers.QwenImagePipeline(
            transformer=diffusers.QwenImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4)),
            vae=diffusers.AutoencoderKLQwenImage(
                base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
                latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0]),  # not 0 / 1: tested
            text_encoder=Qwen2_5_VLForConditionalGeneration(text),
            tokenizer=tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True),
        )
