"""Z-Image (`ZImagePipeline`): a single-stream DiT over [image; caption] tokens, Qwen3 text encoder, FLUX's VAE.

    policy = load_flow_policy("zimage", "/models/Z-Image", dtype="bf16", height=512, width=512)

Guidance follows the pipeline's `guidance_scale` (w): `w > 0` is classifier-free guidance written
`v = v_c + w (v_c - v_u)` (Z-Image's form, the usual `v_u + (1 + w)(v_c - v_u)`), one batched forward over
[uncond; cond]; `w = 0` is one conditional forward (Z-Image-Turbo, distilled, samples with 0). So guidance 1 here
is CFG, unlike SD3's `w > 1` test. The pipeline's `cfg_normalization` / `cfg_truncation` options are not
supported (their defaults, off, are what this adapter computes).

Latent shape (one sample; vsf = the VAE's spatial scale factor, 8 for the real model): `(C, 2 (H // (2 vsf)),
2 (W // (2 vsf)))`, e.g. (16, 64, 64) at 512x512; the transformer takes each sample as [C, 1, h, w] in a list.
Timesteps: the transformer's `t = (1000 - 1000 sigma) / 1000` (1 is clean: the reverse of the other families) in
fp32, and its output is `-v`: both as the pipeline passes them. Sigmas: linspace(1, 1/N, N) shifted with mu from the
image sequence length, as the pipeline sets them.

Prompt embeddings: the Qwen3 encoder's second-to-last hidden states of the chat-formatted prompt, padded to
`max_sequence_length` (`prompt_embeds` [B, L, D]) with the tokenizer's mask (`prompt_mask` [B, L]); the transformer
sees each prompt's unpadded rows, as the pipeline passes them (a list of [L_i, D]).
LoRA targets: Flow-Factory's Z-Image list (attention q/k/v/out and the SwiGLU feed-forward w1/w2/w3), which also
covers the two refiners' blocks.
"""

from __future__ import annotations

import torch

from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir, vae_scale
from difrl.quant.linear import QUANT_PRESETS


class ZImagePolicy(DiffusersFlowPolicy):
    """Z-Image (`ZImagePipeline`): Qwen3 prompt embeddings, CFG `v_c + w (v_c - v_u)` for w > 0, t = 1 - sigma."""

    kind = "zimage"
    pipeline_class = "ZImagePipeline"
    accepted_classes = ("ZImagePipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Flow-Factory's ZImageAdapter.default_target_modules
    lora_candidates = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                       "feed_forward.w2", "feed_forward.w3")
    quant_preset = QUANT_PRESETS["zimage"]
    # every repeated block: the noise and context refiners' and the main layers' (one class)
    block_classes = ("ZImageTransformerBlock",)
    fsdp_fp32_inputs = ("t",)  # 1 - sigma: the pipeline passes it in fp32 and the model embeds t * 1000 in fp32

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 512, cache_prompts: bool = False):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        vsf = vae_scale(pipe)
        # the pipeline's prepare_latents: latent side 2 * (side // (2 vsf)) (2x2 patches in the transformer)
        self.latent_shape = (self.transformer_config.in_channels, 2 * (self.height // (vsf * 2)),
                             2 * (self.width // (vsf * 2)))

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode_batch(self, prompts: list[str]) -> Cond:
        # ZImagePipeline._encode_prompt, kept padded: the chat template, max_length padding, hidden_states[-2]
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        tok = self.pipe.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=True) for p in prompts]
        # token ids and mask are host data made from the prompts: real tensors also under difrl plan's fake-tensor
        # simulation, where a fake mask could not say which rows each caption keeps (no-op otherwise)
        with unset_fake_temporarily():
            inputs = tok(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                         return_tensors="pt")
            mask = inputs.attention_mask.to(self.device).bool()
        embeds = self.pipe.text_encoder(input_ids=inputs.input_ids.to(self.device), attention_mask=mask,
                                        output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": embeds, "prompt_mask": mask}  # [B, L, D], [B, L]

    def _set_timesteps(self, sched, num_steps: int) -> None:
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        c = sched.config  # ZImagePipeline.__call__ step 5: torch.linspace(1, 1/N, N), mu from the image tokens
        mu = calculate_shift((self.latent_shape[1] // 2) * (self.latent_shape[2] // 2),
                             c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched.set_timesteps(sigmas=torch.linspace(1.0, 1 / num_steps, num_steps).tolist(), mu=mu)

    def _cfg_scale(self, guidance: float) -> float | None:
        # the pipeline's `pos + w (pos - neg)` = neg + (1 + w)(pos - neg), for w > 0
        return 1.0 + float(guidance) if guidance > 0.0 else None

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        embeds, mask = cond["prompt_embeds"].to(dt), cond["prompt_mask"].bool()
        t = sigma * 1000  # the scheduler's timestep, then the pipeline's (1000 - t) / 1000 in fp32
        out = self.module(x=list(x.to(dt).unsqueeze(2).unbind(0)), t=(1000 - t) / 1000,
                          cap_feats=[e.index_select(0, m.nonzero().squeeze(1)) for e, m in zip(embeds, mask)],
                          return_dict=False)[0]  # each caption's unpadded rows, e[m] (the mask's positions: host)
        return -torch.stack(out).squeeze(2)  # [B, C, h, w]; the model predicts x0 - eps

    def _vae_latents(self, latents):
        c = self.pipe.vae.config
        return latents / c.scaling_factor + c.shift_factor

    @staticmethod
    def tiny_pipeline():
        """A 2-level VAE (vae_scale_factor 2, 4 latent channels), so 32x32 images have 16x16 latents (8x8 tokens);
        one main layer and one block in each refiner (three ZImageTransformerBlocks), width 32 in 2 heads of 16
        (RoPE axes 4 + 6 + 6); a 2-layer Qwen3 encoder of width 32 (cap_feat_dim) with a byte-level tokenizer;
        the static shift 3 of Z-Image's scheduler."""
        import diffusers
        from transformers import Qwen3Config, Qwen3Model

        from difrl.models.tiny import tiny_image_vae, tiny_qwen_tokenizer_in_vocab

        tok = tiny_qwen_tokenizer_in_vocab()
        return diffusers.ZImagePipeline(
            transformer=diffusers.ZImageTransformer2DModel(
                all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1, n_refiner_layers=1,
                n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32]),
            vae=tiny_image_vae(),
            text_encoder=Qwen3Model(Qwen3Config(
                vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False)),
            tokenizer=tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        )
