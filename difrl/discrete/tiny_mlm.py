"""A tiny masked LM built in code: a standard transformers BertForMaskedLM (bidirectional attention) and a
character-level tokenizer, saved with save_pretrained so it loads through ``HFMaskedLM.from_pretrained``
exactly as a user's LLaDA / Dream / ModernBERT directory does.

    tok = build_char_tokenizer()                      # PreTrainedTokenizerFast, chat template set
    model = build_tiny_mlm(tok, seed=0)               # BertForMaskedLM, ~0.4M parameters, no dropout
    path = save_tiny_mlm(model, tok, Path("runs") / "tiny_mlm")   # a local directory: config.json, model.safetensors, ...
    policy = HFMaskedLM.from_pretrained(path)            # local paths only, never a hub id

The bundled weak base (``BUNDLED_DIR``) is this model after ``scripts/pretrain_text_mlm.py``'s short
LLaDA-style SFT on the bundled arithmetic problems.

Tokenizer: one token per character over ``CHARS`` (digits, + - * / ( ) = . , : > space and a-z), with
the specials [PAD] [MASK] [BOS] [EOS] [UNK] and the chat markers <|user|> <|assistant|>. Its chat
template renders a user turn as "[BOS]<|user|>{content}<|assistant|>" (the model's answer follows),
the same role LLaDA's "<|start_header_id|>user..." template plays. Dropout is 0 so that the masked
trainer's on-policy ratio check (train mode vs eval mode) holds.
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_DIR = ASSETS / "text_mlm_base"
SPECIALS = ["[PAD]", "[MASK]", "[BOS]", "[EOS]", "[UNK]", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789+-*/()=.,:> ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character of CHARS plus SPECIALS (ids in that order:
    [PAD] = 0, [MASK] = 1, [BOS] = 2, [EOS] = 3), decoding by plain concatenation, chat template set."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a word
    tk.decoder = decoders.Fuse()  # join without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", mask_token="[MASK]", bos_token="[BOS]",
                                  eos_token="[EOS]", unk_token="[UNK]", additional_special_tokens=SPECIALS[5:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_mlm(tokenizer, seed: int = 0, hidden: int = 96, layers: int = 3, heads: int = 4,
                   max_positions: int = 64):
    """A freshly initialised BertForMaskedLM over the tokenizer's vocabulary (weights a function of `seed`)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=max_positions,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=1,
                     pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.mask_token_id,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return BertForMaskedLM(cfg).eval()


def save_tiny_mlm(model, tokenizer, out_dir: str | Path) -> Path:
    """save_pretrained of both (safetensors weights): a directory HFMaskedLM.from_pretrained loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


__all__ = ["BUNDLED_DIR", "CHARS", "CHAT_TEMPLATE", "SPECIALS", "build_char_tokenizer", "build_tiny_mlm",
           "save_tiny_mlm"]
