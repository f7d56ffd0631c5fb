"""Tiny random-initialised diffusers pipelines (FLUX.1, SD3, Wan 2.1), built in code with no hub access.

    from difrl.models.tiny import make_tiny_pipeline
    path = make_tiny_pipeline("flux", tmp_dir / "flux")        # saves a pipeline directory, returns its path
    policy = load_flow_policy("flux", path, height=32, width=32)

They stand in for a real checkpoint directory in tests: every component (transformer, VAE, text
encoders, tokenizers, scheduler) has the real class and the real on-disk layout, so the adapter's
loading, encoding, timestep scaling, packing and decoding run exactly as on the real model; only
the sizes are tiny (1-2 layers, hidden size 16-32). Tokenizers are built from in-memory
vocabularies (ecosystem.md §1.2): a character-level CLIP BPE (the 256 byte-level symbols, each also
with the end-of-word marker, and no merges) and a character-level T5 unigram vocabulary, so any
prompt tokenizes and nothing is read from a hub.

Sizes: Flux and SD3 use a 2-level VAE (vae_scale_factor 2, 4 latent channels) so a 32x32 image
has 16x16 latents (Flux: packed to [64, 16]); Wan uses its usual 8x spatial / 4x temporal VAE,
so 32x32 and 5 frames give latents [16, 2, 4, 4]. Schedulers follow the real configs' kind:
Flux dynamic shifting (mu from the image sequence length), SD3 static shift 3, Wan shift 3
(with the flow-matching Euler scheduler, so a pipeline call is the same ODE as difrl's sampler).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

KINDS = ("flux", "sd3", "wan")
TEXT_LEN = 16  # CLIP context of the tiny tokenizers / encoders (the real ones use 77)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE (GPT-2 / CLIP convention)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_clip_tokenizer(max_length: int = TEXT_LEN):
    """Character-level CLIPTokenizer: ids 0 = <|startoftext|>, 1 = <|endoftext|> (also pad and unk)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for sym in _byte_symbols():
            vocab.setdefault(sym + suffix, len(vocab))
    # model_max_length must be set: the pipelines pad CLIP prompts to it (ecosystem.md §1.2)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length, bos_token="<|startoftext|>",
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def tiny_t5_tokenizer():
    """Character-level T5Tokenizer (unigram): pad 0, eos 1, unk 2, as T5 / UMT5 expect."""
    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _clip_config(vocab_size: int, hidden: int, projection_dim: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
                          num_hidden_layers=2, max_position_embeddings=TEXT_LEN, projection_dim=projection_dim,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu", layer_norm_eps=1e-5)


def _t5_kwargs(vocab_size: int, d_model: int) -> dict:
    return dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                dropout_rate=0.0)


def _image_vae():
    from diffusers import AutoencoderKL

    # two levels -> vae_scale_factor 2; scaling/shift factors as in diffusers' Flux/SD3 test configs
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)


def build_tiny_pipeline(kind: str, seed: int = 0):
    """The tiny pipeline object for `kind` ('flux', 'sd3', 'wan'), in memory, eval mode, fp32."""
    import diffusers
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    if kind not in KINDS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {KINDS}")
    torch.manual_seed(seed)
    if kind == "flux":
        clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        parts = dict(
            transformer=diffusers.FluxTransformer2DModel(
                patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                axes_dims_rope=(4, 4, 8)),
            vae=_image_vae(),
            text_encoder=CLIPTextModel(_clip_config(len(clip_tok), 32, 32)),
            tokenizer=clip_tok,
            text_encoder_2=T5EncoderModel(T5Config(**_t5_kwargs(len(t5_tok), 32))),
            tokenizer_2=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                max_image_seq_len=4096),
        )
        pipe = diffusers.FluxPipeline(**parts)
    elif kind == "sd3":
        clip_tok, clip_tok2, t5_tok = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
        # two layers: the last one is context-pre-only (no to_add_out), the first has every LoRA target.
        # CLIP hidden states (16 + 16) are zero-padded up to the T5 width (32) = joint_attention_dim;
        # pooled projections (32 + 32) = pooled_projection_dim, as in SD3 (768 + 1280 -> 4096; 2048)
        parts = dict(
            transformer=diffusers.SD3Transformer2DModel(
                sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
                pos_embed_max_size=16),
            vae=_image_vae(),
            text_encoder=CLIPTextModelWithProjection(_clip_config(len(clip_tok), 16, 32)),
            tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(_clip_config(len(clip_tok2), 16, 32)),
            tokenizer_2=clip_tok2,
            text_encoder_3=T5EncoderModel(T5Config(**_t5_kwargs(len(t5_tok), 32))),
            tokenizer_3=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
        pipe = diffusers.StableDiffusion3Pipeline(**parts)
    else:
        t5_tok = tiny_t5_tokenizer()
        parts = dict(
            transformer=diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
            vae=diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           temperal_downsample=[False, True, True]),
            text_encoder=UMT5EncoderModel(UMT5Config(**_t5_kwargs(len(t5_tok), 32))),
            tokenizer=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
        pipe = diffusers.WanPipeline(**parts)
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            comp.eval()  # models built directly are in train mode (T5 dropout: ecosystem.md §1.1)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_tiny_pipeline(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny `kind` pipeline with weights drawn from `seed` and save it to `out_dir` (a
    diffusers pipeline directory: model_index.json plus one folder per component). Returns the path."""
    out_dir = Path(out_dir)
    pipe = build_tiny_pipeline(kind, seed)
    pipe.save_pretrained(out_dir)
    return out_dir
