"""The masked-diffusion policy adapter protocol (docs/architecture.md seam 1, discrete half) and two adapters.

    policy = TinyMaskedPolicy.from_checkpoint(path)        # difrl's own bidirectional transformer
    policy = HFMaskedLM.from_pretrained("/models/llada")    # any local transformers masked LM (logits out)
    logits = policy.logits(tokens, cond)                    # tokens [B, L] long -> [B, L, V] fp32 on policy.device
    prompt = policy.prompt_mask(tokens, cond)               # [B, L] bool: positions that are never masked
    policy.mask_id, policy.vocab_size, policy.device

Conventions shared by every masked adapter:

- ``logits`` returns fp32 ``[B, L, V]`` with the mask token's logit set to ``NEG`` (the SUBS rule of
  MDLM: the denoiser never predicts the mask), on the policy's compute device (``policy.device``,
  difrl.models.base.ComputeDevice) whatever device the tokens come from: at V = 126,464 (LLaDA) the logits
  are 0.5 MB per position, so samplers and log-prob estimators read them there and bring back per-position
  values only (tokens, log-probs, confidences). Other positions' logits are left as the network
  made them (no carry-over point mass), so a corrector can still read a visible token's confidence;
  samplers and losses only ever read masked positions.
- "Prompt" positions are the ones a rollout starts with visible and a loss never masks. They are
  carried in ``cond["prompt_mask"]`` when the caller knows them (text prompts, left padding); without
  it, every position that is not the mask token in the rollout's *initial* tokens is prompt.
- ``NEG`` is a large finite negative instead of -inf so that softmax, entropy and temperature
  division never produce NaN (exp(NEG) is exactly 0 in fp32 and fp64).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from difrl.models.base import ComputeDevice, Cond, HoldsNet, autocast_to
from difrl.utils.modules import peft_base

NEG = -1e9  # "minus infinity" for logits (finite: no NaN in entropies or under temperature)


@runtime_checkable
class MaskedPolicy(Protocol):
    """What a masked (absorbing-state) diffusion model must provide to be sampled and trained by difrl."""

    mask_id: int
    vocab_size: int  # V: the logits' last dimension (mask token included)
    lora_target_modules: list[str]

    @property
    def module(self) -> nn.Module:
        """The trainable network."""

    def logits(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        """tokens [B, L] long (mask_id where masked; any device) -> fp32 [B, L, V] on the policy's device, mask
        logit = NEG."""

    def prompt_mask(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        """[B, L] bool: prompt positions (never masked by a loss, never changed by a sampler)."""


def mask_logit(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """logits [..., V] with the mask token's logit set to NEG, out of place: the network's output is not modified
    (under FSDP2 an in-place write to it would drop the hook that gathers the weights again for the backward)."""
    return logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), NEG)


def prompt_mask_of(tokens: torch.Tensor, mask_id: int, cond: Cond | None = None) -> torch.Tensor:
    """cond["prompt_mask"] if given, else the positions of `tokens` (a rollout's start) that are not masked."""
    if cond is not None and "prompt_mask" in cond:
        pm = cond["prompt_mask"].bool()
        if pm.shape != tokens.shape:
            raise ValueError(f"cond['prompt_mask'] has shape {tuple(pm.shape)}, tokens have {tuple(tokens.shape)}")
        return pm
    return tokens != mask_id


def _check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    if tokens.dtype not in (torch.int64, torch.int32) or tokens.ndim != 2:
        raise ValueError(f"tokens must be a [B, L] integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")


# ----------------------------------------------------------------------------- difrl's tiny transformer
@dataclass
class MaskedNetConfig:
    vocab_size: int = 5  # including the mask token
    mask_id: int = 4
    seq_len: int = 16
    dim: int = 128
    layers: int = 3
    heads: int = 4
    mlp_ratio: int = 4
    num_labels: int = 0  # > 0: a class label (cond["label"]) is added to every position (digit tokens)


class Block(nn.Module):
    """Pre-LN bidirectional (no causal mask) self-attention + MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, l, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # is_causal=False: bidirectional
        h = h + self.proj(a.transpose(1, 2).reshape(b, l, d))
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(h))))


class MaskedTransformer(nn.Module):
    """tokens [B, L] (+ label [B]) -> logits [B, L, V]; learned absolute positions."""

    def __init__(self, cfg: MaskedNetConfig = MaskedNetConfig()):
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim {cfg.dim} is not divisible by heads {cfg.heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.label = nn.Embedding(cfg.num_labels, cfg.dim) if cfg.num_labels else None
        self.blocks = nn.ModuleList([Block(cfg.dim, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)
        for emb in (self.tok, self.label):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, label: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        if self.label is not None:
            if label is None:
                raise ValueError("this masked transformer is label-conditioned: pass cond={'label': [B] long}")
            h = h + self.label(label)[:, None]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class TinyMaskedPolicy(HoldsNet):
    """MaskedPolicy adapter for MaskedTransformer (the bundled discrete worlds' generator)."""

    lora_target_modules = ["qkv", "proj", "fc1", "fc2", "head"]
    block_classes = ("Block",)  # the repeated blocks: FSDP units (difrl.train.dist.sharding)

    def __init__(self, net: MaskedTransformer):
        self.net = net
        self.mask_id = net.cfg.mask_id
        self.vocab_size = net.cfg.vocab_size

    def logits(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        _check_tokens(tokens, self.vocab_size)
        label = (cond or {}).get("label")
        out = self.net(tokens.to(self.device), None if label is None else label.to(self.device)).float()
        return mask_logit(out, self.mask_id)  # [B, L, V] on the compute device

    def prompt_mask(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        return prompt_mask_of(tokens, self.mask_id, cond)

    def state_dict_and_meta(self, **extra) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The plain network's weights and its config as safetensors metadata (merge LoRA first)."""
        net = peft_base(self.net)
        meta = {k: str(v) for k, v in asdict(net.cfg).items()} | {k: str(v) for k, v in extra.items()}
        return dict(net.state_dict()), meta

    @classmethod
    def from_checkpoint(cls, path: str | Path, what: str = "masked transformer checkpoint",
                        expect: dict[str, int] | None = None) -> "TinyMaskedPolicy":
        """The policy of a checkpoint; `expect` (config field -> value, e.g. a world's vocabulary and length) refuses
        a checkpoint of another world by name, before any sampler meets the wrong shapes."""
        from difrl.utils.io import load_safetensors_checked

        tensors, meta = load_safetensors_checked(path, what=what)
        fields = {k: int(meta[k]) for k in asdict(MaskedNetConfig()) if k in meta}
        if "vocab_size" not in fields or "seq_len" not in fields:
            raise ValueError(f"{path} is not a {what}: its metadata has no vocab_size / seq_len")
        config = MaskedNetConfig(**fields)
        wrong = {k: v for k, v in (expect or {}).items() if getattr(config, k) != v}
        if wrong:
            raise ValueError(f"{path} is not a {what}: it has " + ", ".join(f"{k} {getattr(config, k)}" for k in wrong)
                             + " (expected " + ", ".join(f"{k} {v}" for k, v in wrong.items()) + ")")
        net = MaskedTransformer(config)
        missing, unexpected = net.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path} is not a {what}: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return cls(net.eval())


# ----------------------------------------------------------------------------- transformers masked LMs
class HFMaskedLM(ComputeDevice):
    """MaskedPolicy adapter for a masked LM in a local transformers directory (BERT-like, ModernBERT,
    LLaDA with ``trust_remote_code=True``): anything whose forward(input_ids, attention_mask) returns
    ``.logits`` of shape [B, L, V].

        policy = HFMaskedLM.from_pretrained("/models/LLaDA-8B-Instruct", trust_remote_code=True, dtype="bf16")
        tokens, cond = policy.encode(["What is 2 + 3?"], gen_length=64)   # left-padded prompt + 64 masks
        texts = policy.decode(tokens, cond)                                # the generated part only
    """

    def __init__(self, model: nn.Module, mask_id: int, vocab_size: int, tokenizer=None):
        self.model = model
        self.mask_id = int(mask_id)
        self.vocab_size = int(vocab_size)
        self.tokenizer = tokenizer
        # the half dtype the forward autocasts to when the trained parameters are fp32 master weights
        # (difrl.train.precision: full fine-tuning of a model loaded in bf16); None: the parameters' own dtype
        self.autocast_dtype: torch.dtype | None = None
        self.lora_target_modules = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                           if isinstance(m, nn.Linear) and "embed" not in n and "head" not in n
                                           and "decoder" not in n.rsplit(".", 1)[-1]})

    @property
    def module(self) -> nn.Module:
        return self.model

    @module.setter
    def module(self, m: nn.Module) -> None:
        self.model = m

    @property
    def block_classes(self) -> tuple[str, ...]:
        """The transformer layer classes FSDP wraps one by one (difrl.train.dist.sharding): the model's own
        `_no_split_modules` when it names any, else the class of the longest ModuleList of one class (BERT's
        `encoder.layer`: BertLayer; LLaDA's blocks)."""
        named = tuple(getattr(self.model, "_no_split_modules", None) or ())
        if named:
            return named
        lists = [m for m in self.model.modules() if isinstance(m, nn.ModuleList) and len(m)
                 and len({type(x) for x in m}) == 1]
        return (type(max(lists, key=len)[0]).__name__,) if lists else ()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mask_id: int | None = None, trust_remote_code: bool = False,
                        dtype: str | torch.dtype = "fp32", device=None) -> "HFMaskedLM":
        """Load from a local directory only (nothing is fetched). Remote code runs only when
        `trust_remote_code` is True *and* `path` is a local directory the user chose."""
        import transformers

        from difrl.models.diffusers_base import as_dtype

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory (expected a local transformers model directory with "
                                    "config.json; models are never downloaded)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a transformers model directory")
        kw = dict(local_files_only=True, trust_remote_code=bool(trust_remote_code), dtype=as_dtype(dtype))
        try:
            model = transformers.AutoModelForMaskedLM.from_pretrained(str(path), **kw)
        except ValueError as first:  # e.g. LLaDA registers only AutoModel in its remote code
            if not trust_remote_code:
                raise ValueError(f"{path}: not loadable as AutoModelForMaskedLM ({first}); if it is a remote-code model "
                                 "such as LLaDA, pass trust_remote_code=True (only for a directory you trust)") from first
            model = transformers.AutoModel.from_pretrained(str(path), **kw)
        tokenizer = None
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                                   trust_remote_code=bool(trust_remote_code))
        cfg = model.config
        if mask_id is None:
            mask_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        if mask_id is None:
            mask_id = getattr(cfg, "mask_token_id", None)
        if mask_id is None:
            raise ValueError(f"{path}: no mask token id in the tokenizer or config; pass mask_id= (LLaDA: 126336)")
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        vocab = out_emb.weight.shape[0] if out_emb is not None and hasattr(out_emb, "weight") else cfg.vocab_size
        if device is not None:
            model = model.to(device)
        return cls(model.eval(), int(mask_id), int(vocab), tokenizer)

    def logits(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        _check_tokens(tokens, self.vocab_size)
        att = (cond or {}).get("attention_mask")
        with autocast_to(self.autocast_dtype, self.device):
            out = self.model(input_ids=tokens.to(self.device), attention_mask=None if att is None else att.to(self.device))
        logits = out.logits.float()
        if logits.shape[:2] != tokens.shape or logits.shape[-1] != self.vocab_size:
            raise ValueError(f"the model returned logits {tuple(logits.shape)} for tokens {tuple(tokens.shape)}; "
                             f"expected [B, L, {self.vocab_size}]")
        return mask_logit(logits, self.mask_id)  # [B, L, V] on the compute device: never the host's (0.5 MB a position for LLaDA)

    def prompt_mask(self, tokens: torch.Tensor, cond: Cond | None = None) -> torch.Tensor:
        return prompt_mask_of(tokens, self.mask_id, cond)

    def chat_prompts(self, prompts: list[str]) -> list[str]:
        """Each prompt as one user turn of the tokenizer's chat template plus the assistant's generation
        prompt (LLaDA-Instruct's layout); the prompts unchanged when the tokenizer has no template."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return list(prompts)
        return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts]

    def encode(self, prompts: list[str], gen_length: int, *, chat: bool = True,
               width: int | None = None) -> tuple[torch.Tensor, Cond]:
        """Left-padded prompt ids followed by `gen_length` mask tokens, and cond with the attention mask
        (padding excluded) and the prompt mask (prompt and padding: never generated). chat: wrap each
        prompt in the tokenizer's chat template when it has one; width: the prompt region's fixed width
        (None = the longest prompt), so that every batch of a task has the same layout."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; build token ids yourself")
        tok = self.tokenizer
        texts = self.chat_prompts(prompts) if chat else prompts
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in texts]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        longest = max(len(x) for x in ids)
        if width is not None and longest > width:
            raise ValueError(f"a prompt has {longest} tokens, more than the prompt width {width}")
        width = longest if width is None else int(width)
        body = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
        att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
        tokens = torch.cat([body, torch.full((len(prompts), gen_length), self.mask_id, dtype=torch.long)], dim=1)
        att = torch.cat([att, torch.ones(len(prompts), gen_length, dtype=torch.long)], dim=1)
        prompt = torch.zeros_like(tokens, dtype=torch.bool)
        prompt[:, :width] = True
        return tokens, {"attention_mask": att, "prompt_mask": prompt}

    def decode(self, tokens: torch.Tensor, cond: Cond) -> list[str]:
        """The generated part of each row as text, cut at its first EOS (what follows EOS is padding, as in
        LLaDA's generations), special tokens dropped."""
        gen = ~cond["prompt_mask"].bool()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        out = []
        for row, g in zip(tokens, gen):
            ids = row[g].tolist()
            if eos is not None and eos in ids:
                ids = ids[:ids.index(eos)]
            out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return out

    def state_dict_and_meta(self, **extra) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The plain model's weights (merge LoRA first) and its transformers config as JSON metadata: what
        the masked trainer's policy.safetensors holds; ``load_weights`` puts it back on the base directory."""
        model = peft_base(self.model)
        meta = {"hf_config": model.config.to_json_string()} | {k: str(v) for k, v in extra.items()}
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, meta  # clone: tied weights share memory

    def load_weights(self, path: str | Path) -> "HFMaskedLM":
        """Load a ``state_dict_and_meta`` safetensors file (a trained run's policy.safetensors) into this model;
        a file for another architecture raises, naming it."""
        from difrl.utils.io import load_safetensors_checked

        tensors, _ = load_safetensors_checked(path, what="masked LM weights")
        try:
            missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise ValueError(f"{path} does not fit the model at hand: {str(e)[:300]}") from e
        if unexpected or [k for k in missing if k in dict(self.model.named_parameters())]:
            raise ValueError(f"{path} does not fit the model at hand: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return self


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["NEG", "MaskedPolicy", "MaskedNetConfig", "MaskedTransformer", "TinyMaskedPolicy", "HFMaskedLM",
           "prompt_mask_of", "count_parameters"]
