"""The parts of tiny random-initialised diffusers pipelines, built in code with no hub access.

    from difrl.models.adapters import make_tiny_pipeline      # one per kind of ADAPTERS, from these parts
    path = make_tiny_pipeline("flux", tmp_dir / "flux")        # saves a pipeline directory, returns its path
    policy = load_flow_policy("flux", path, height=32, width=32)

They stand in for a real checkpoint directory in tests: every component (transformer, VAE, text
encoders, tokenizers, scheduler) has the real class and the real on-disk layout, so the adapter's
loading, encoding, timestep scaling, packing and decoding run exactly as on the real model; only
the sizes are tiny (1-2 layers, hidden size 16-32). Tokenizers are built from in-memory
vocabularies (ecosystem.md §1.2): a character-level CLIP BPE (the 256 byte-level symbols, each also
with the end-of-word marker, and no merges) and a character-level T5 unigram vocabulary, so any
prompt tokenizes and nothing is read from a hub.

Each family's sizes and scheduler are in its `tiny_pipeline` (difrl/models/flux.py, sd3.py, wan.py):
a new model kind in difrl/models/adapters.py gets a tiny pipeline by defining that method (the family files
import these parts; this file imports none of them).
"""

from __future__ import annotations

import string

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


def tiny_clip_config(vocab_size: int, hidden: int, projection_dim: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
                          num_hidden_layers=2, max_position_embeddings=TEXT_LEN, projection_dim=projection_dim,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu", layer_norm_eps=1e-5)


def tiny_t5_kwargs(vocab_size: int, d_model: int) -> dict:
    return dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                dropout_rate=0.0)


def tiny_image_vae():
    from diffusers import AutoencoderKL

    # two levels -> vae_scale_factor 2; scaling/shift factors as in diffusers' Flux/SD3 test configs.
    # One GroupNorm group: with one group per channel (4 groups of the 4-channel last level) the decoder's output
    # norm removes every channel's spatial mean, so no latent change moves a random tiny decoder's colour or
    # brightness (a latent offset that is constant over the image moved the colour reward by 0.006, 1.6 sample
    # std; with one group 0.03, 10 std): the tiny configs' rewards could not be learned (configs/*_tiny.yaml).
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
                         latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)


# the words of the Qwen-Image prompt template (diffusers' QwenImagePipeline.prompt_template_encode), merged to one token
# each as the real Qwen2 BPE does, so the template's system part is 34 tokens here too: the pipeline drops exactly
# prompt_template_encode_start_idx = 34 leading hidden states, which then leave the prompt's own tokens, not template text
QWEN_TEMPLATE_WORDS = ("system", "Describe", " the", " image", " by", " detailing", " color", " shape", " size",
                       " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
                       " background", "user", "assistant")


def tiny_qwen2_tokenizer(words: tuple[str, ...] = QWEN_TEMPLATE_WORDS):
    """Byte-level Qwen2Tokenizer (BPE over the 256 byte symbols, GPT-2 convention): any text tokenizes, a byte a token,
    except `words`, which merges make single tokens (left to right: "sy"+"s", ...). Special tokens as Qwen2.5's:
    <|endoftext|> (pad / eos), <|im_start|>, <|im_end|>, and the vision markers Qwen2.5-VL's config names."""
    from transformers import Qwen2Tokenizer

    sym = _byte_symbols()
    vocab = {s: i for i, s in enumerate(sym)}
    merges = []
    for word in words:
        pieces = [sym[b] for b in word.encode("utf-8")]
        left = pieces[0]
        for right in pieces[1:]:
            merges.append((left, right))
            left = left + right
            vocab.setdefault(left, len(vocab))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials[1:])
    return tok
