"""The parts of tiny random-initialised diffusers pipelines, built in code with no hub access.

    from difrl.models.adapters import make_tiny_pipeline      # one per kind of ADAPTERS, from these parts
    path = make_tiny_pipeline("flux", tmp_dir / "flux")        # saves a pipeline directory, returns its path
    policy = load_flow_policy("flux", path, height=32, width=32)

They stand in for a real checkpoint directory in tests: every component (transformer, VAE, text
encoders, tokenizers, scheduler) has the real class and the real on-disk layout, so the adapter's
loading, encoding, timestep scaling, packing and decoding run exactly as on the real model; only
the sizes are tiny (1-2 layers, hidden size 16-32). Tokenizers are built from in-memory
vocabularies (docs/reference/specs/ecosystem.md §1.2): a character-level CLIP BPE (the 256 byte-level symbols, each also
with the end-of-word marker, and no merges) and a character-level T5 unigram vocabulary, so any
prompt tokenizes and nothing is read from a hub. The chat-template encoders of FLUX.2 (Qwen3, Mistral3) get
byte-level BPE tokenizers with their templates' markers as single tokens, and 28 / 31 layers of width 16 (the
pipelines read hidden states 9, 18, 27 / 10, 20, 30).

Each family's sizes and scheduler are in its `tiny_pipeline` (difrl/models/flux.py, sd3.py, wan.py, flux2.py):
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
    # model_max_length must be set: the pipelines pad CLIP prompts to it (docs/reference/specs/ecosystem.md §1.2)
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


def tiny_gemma_tokenizer():
    """Character-level GemmaTokenizer (BPE with no merges, byte fallback): pad 0, eos 1, bos 2, unk 3, mask 4, the 256
    byte tokens <0x00>..<0xFF>, then the word marker and the printable ASCII characters, so any prompt tokenizes."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for sym in ["\u2581"] + [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]:
        vocab.setdefault(sym, len(vocab))
    # <bos> first and right padding, as the real Gemma-2 tokenizer (SanaPipeline sets padding_side = "right" itself)
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True, add_eos_token=False, padding_side="right")


# the markers of the Qwen chat template: each one token, as in the real vocabulary
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's chat template, reduced to what text-only prompts use: one turn per message, then the generation prompt with
# an empty think block when enable_thinking is false (as Flux2KleinPipeline asks for it)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def tiny_byte_bpe_tokenizer(specials: tuple[str, ...], chat_template: str, in_vocab: bool = False, **tokens):
    """Byte-level BPE tokenizer (the Qwen2Tokenizer class) with no merges, so every byte is one token and any prompt
    tokenizes, and `specials` (the chat template's markers) one token each; `tokens`: pad_token=, eos_token=, ...
    in_vocab: the specials take ids 256, 257, ... in order inside the vocabulary (else they are added after it)."""
    from transformers import Qwen2Tokenizer

    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    if in_vocab:
        for sym in specials:
            vocab[sym] = len(vocab)
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, **tokens,
                             additional_special_tokens=[s for s in specials if s != tokens.get("pad_token")])
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, model_max_length=4096, **tokens)
        tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in tokens.values()]})
    tok.chat_template = chat_template
    return tok


def tiny_qwen_tokenizer():
    """Qwen3's chat template with its markers as single tokens, bytes otherwise (FLUX.2 [klein])."""
    return tiny_byte_bpe_tokenizer(QWEN_SPECIALS, QWEN3_CHAT_TEMPLATE, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>")


def tiny_qwen_tokenizer_in_vocab():
    """Z-Image's: the same template, its three markers <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos) at ids
    256-258 inside the vocabulary (the tiny Z-Image's FSDP check was validated with these ids; with the FLUX.2
    [klein] layout its 2-process full fine-tune drifted from 1 process by 7e-5 relative at the third iteration,
    unexplained: docs/guides/adding-a-model.md)."""
    return tiny_byte_bpe_tokenizer(QWEN_SPECIALS[:3], QWEN3_CHAT_TEMPLATE, in_vocab=True, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


# Mistral Small 3.x's (tekken) control tokens and its chat template reduced to text turns: [SYSTEM_PROMPT] ...
# [/SYSTEM_PROMPT] [INST] ... [/INST]; message contents are lists of {"type": "text", "text": ...} parts
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}")


def tiny_pixtral_processor(system_message: str = ""):
    """A PixtralProcessor (what FLUX.2 [dev] loads as its `tokenizer`: Mistral3's AutoProcessor) over a byte-level
    stand-in for the tekken tokenizer with Mistral's control tokens and chat template. `system_message` (the
    pipeline's fixed one) is one added token, so that a short max_sequence_length still reaches the prompt."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    tok = tiny_byte_bpe_tokenizer(MISTRAL_SPECIALS, MISTRAL3_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    if system_message:
        tok.add_tokens([system_message])
    images = PixtralImageProcessor(patch_size=16, size={"longest_edge": 32})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=16, spatial_merge_size=1,
                            chat_template=MISTRAL3_CHAT_TEMPLATE)


def tiny_flux2_processor():
    """FLUX.2 [dev]'s: the Pixtral processor with the pipeline's fixed system message as one token."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return tiny_pixtral_processor(SYSTEM_MESSAGE)


def tiny_mistral3_kwargs(vocab_size: int, image_token_index: int, layers: int = 31) -> dict:
    """Mistral3Config fields: a text model of width 16 with 31 layers by default, so FLUX.2 [dev]'s hidden-state
    layers 10, 20, 30 exist; a 1-layer Pixtral vision tower (text-only prompts never run it)."""
    from transformers import MistralConfig, PixtralVisionConfig

    text = MistralConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                         attention_dropout=0.0)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=32, patch_size=16)
    return dict(text_config=text, vision_config=vision, image_token_index=image_token_index, spatial_merge_size=1)


def tiny_qwen3_kwargs(vocab_size: int, layers: int = 28) -> dict:
    """Qwen3Config fields: width 16; 28 layers by default, so FLUX.2 [klein]'s hidden-state layers 9, 18, 27 exist
    (each layer is ~2k parameters)."""
    return dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                tie_word_embeddings=True, attention_dropout=0.0)


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


# the words of the Qwen-Image-Edit prompt template's system part (diffusers' QwenImageEditPipeline.prompt_template_encode)
# and the "assistant" of its end, one token each as the real Qwen2 BPE makes them (longest first, so no merge of a
# shorter word splits a longer one): the part up to the image is 64 tokens here too, the pipeline's
# prompt_template_encode_start_idx, so what it keeps starts at the vision tokens
QWEN_EDIT_TEMPLATE_WORDS = (" requirements", " instruction", " maintaining", " consistency", " appropriate",
                            " background", " features", " Generate", " original", "assistant", "Describe", " texture",
                            " objects", " explain", " should", " modify", "system", " input", " image", " shape",
                            " alter", " meets", " while", " where", "color", " size", " then", " user", " text",
                            " that", " with", " the", " key", " how", " new", "user", " of", " or", " (", "),", "'s", " a")


def tiny_qwen2vl_processor(tokenizer, pixels: int | tuple[int, int] = 56 * 56):
    """A Qwen2VLProcessor (Qwen-Image-Edit's `processor`) over `tokenizer`: its image processor resizes every image to
    about `pixels` pixels (min = max: 56 x 56, a 4 x 4 grid of 14-pixel patches merged 2 x 2 into 4 image tokens; the
    real one keeps up to 12.8M pixels); `pixels` a (min, max) pair: images between the two keep their size."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    low, high = pixels if isinstance(pixels, tuple) else (pixels, pixels)
    images = Qwen2VLImageProcessor(min_pixels=low, max_pixels=high)
    return Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())


def qwen_image_edit_tokenizer():
    """Qwen-Image-Edit's code-built tokenizer (difrl plan's real-size pipeline): the byte-level Qwen2 tokenizer with
    the edit template's words, so the dropped system part is the real 64 tokens; its vision markers are ids 461-464
    (difrl/assets/arch/qwen-image-edit/text_encoder/config.json names these ids)."""
    return tiny_qwen2_tokenizer(QWEN_EDIT_TEMPLATE_WORDS)


def qwen_image_edit_processor():
    """Qwen-Image-Edit's processor at real size: Qwen2.5-VL's published image processor limits (3,136 to 12,845,056
    pixels: a source keeps its pipeline-resized size, rounded to 28-pixel multiples, 14-pixel patches merged 2 x 2)
    over qwen_image_edit_tokenizer."""
    return tiny_qwen2vl_processor(qwen_image_edit_tokenizer(), pixels=(56 * 56, 28 * 28 * 16384))


def tiny_qwen25_vl_config(tok):
    """A 2-layer Qwen2.5-VL of width 32 with a 1-block vision tower (Qwen-Image's and Qwen-Image-Edit's text encoder),
    its special token ids those of `tok` (tiny_qwen2_tokenizer)."""
    from transformers import Qwen2_5_VLConfig

    ids = tok.convert_tokens_to_ids
    pad = ids("<|endoftext|>")
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_theta=1e6, rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default",
                                                       "type": "default"},
                         bos_token_id=pad, eos_token_id=pad, pad_token_id=pad),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
