"""Tiny, randomly initialised CLIP-family backbones saved in the real file layouts, for tests and benchmarks.

    opts = tiny_reward_options(tmp_path)                 # {"clip_score": {...}, "pickscore": {...}, "aesthetic": ..., "hpsv2": ...}
    fn = build_reward("hpsv2", **opts["hpsv2"])          # scores [B, 3, H, W] in [0, 1] in milliseconds
    cfg_json, ckpt = save_tiny_open_clip(d, seed=0)      # open_clip model-config JSON + HPS-style {"state_dict": ...} file
    model_dir, proc_dir = save_tiny_hf_clip(d, seed=0)   # CLIPModel.save_pretrained + CLIPTokenizer/CLIPImageProcessor
    mlp = save_tiny_aesthetic(d, in_dim=16, seed=0)      # LAION-layout MLP state dict (layers.0/2/4/6/7)

Nothing is downloaded. The tokenizer is the real CLIP BPE (49408 ids): `vocab.json`/`merges.txt` are generated
from open_clip's bundled `bpe_simple_vocab_16e6.txt.gz`, so transformers' CLIPTokenizer and open_clip's
SimpleTokenizer give the same ids. The transformers model of a seed is the open_clip model of the same seed
converted by `open_clip_to_hf_state_dict`, so `clip_score` and `hpsv2` compute the same features (the
equivalence check of tests/test_rewards_clip.py). Every parameter is perturbed after the default init, so layer
norms and attention biases are not trivial and a wrong key mapping shows. Scores of these models mean nothing.
Sizes: ~0.85 M parameters (of which 0.79 M the 49408 x 16 token embedding), image size 32, patch 8.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import torch
from torch import nn

TINY_NAME = "difrl-tiny-clip"
SOT, EOT = "<|startoftext|>", "<|endoftext|>"  # the transformers names; open_clip calls them <start_of_text>...


def tiny_open_clip_config(image_size: int = 32, quick_gelu: bool = False) -> dict:
    """An open_clip model config (the schema of open_clip/model_configs/*.json) for a ~0.85 M parameter CLIP."""
    cfg = {"embed_dim": 16,
           "vision_cfg": {"image_size": image_size, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2}}
    if quick_gelu:
        cfg["quick_gelu"] = True
    return cfg


def _perturb_(model: nn.Module, seed: int, scale: float = 0.05) -> None:
    """Add N(0, scale^2) to every parameter but logit_scale (a deterministic function of the seed)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("logit_scale"):
                p.add_(torch.randn(p.shape, generator=g) * scale)


def build_tiny_open_clip(seed: int = 0, image_size: int = 32, quick_gelu: bool = False):
    """(open_clip CLIP model in eval mode, its config dict); the global RNG is left untouched."""
    import open_clip

    cfg = tiny_open_clip_config(image_size, quick_gelu)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.CLIP(**cfg)
    _perturb_(model, seed)
    return model.eval(), cfg


def tiny_arch_name(image_size: int = 32, quick_gelu: bool = False) -> str:
    """The open_clip architecture name of a tiny variant (configs are registered process-wide by name, so
    different variants need different names)."""
    return TINY_NAME + ("-quickgelu" if quick_gelu else "") + ("" if image_size == 32 else f"-{image_size}")


def save_tiny_open_clip(directory, seed: int = 0, *, image_size: int = 32, quick_gelu: bool = False,
                        name: str | None = None) -> tuple[Path, Path]:
    """Write `<directory>/<name>.json` (open_clip model config; its stem is the architecture name, default
    `tiny_arch_name(...)`) and `<directory>/<name>-hps.pt` ({"state_dict": ...}, the layout of
    HPS_v2(.1)_compressed.pt). Returns (config path, checkpoint path)."""
    name = name or tiny_arch_name(image_size, quick_gelu)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model, cfg = build_tiny_open_clip(seed, image_size, quick_gelu)
    cfg_path, ckpt_path = d / f"{name}.json", d / f"{name}-hps.pt"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    torch.save({"state_dict": model.state_dict()}, ckpt_path)
    return cfg_path, ckpt_path


# --- open_clip -> transformers CLIPModel -------------------------------------------------------------------

_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_PARTS = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                "attn.out_proj": "self_attn.out_proj"}
_FLAT = {  # open_clip key -> (transformers key, transpose)
    "token_embedding.weight": ("text_model.embeddings.token_embedding.weight", False),
    "positional_embedding": ("text_model.embeddings.position_embedding.weight", False),
    "ln_final.weight": ("text_model.final_layer_norm.weight", False),
    "ln_final.bias": ("text_model.final_layer_norm.bias", False),
    "text_projection": ("text_projection.weight", True),  # open_clip x @ P [width, embed]; HF Linear W = P^T
    "logit_scale": ("logit_scale", False),
    "visual.class_embedding": ("vision_model.embeddings.class_embedding", False),
    "visual.positional_embedding": ("vision_model.embeddings.position_embedding.weight", False),
    "visual.conv1.weight": ("vision_model.embeddings.patch_embedding.weight", False),
    "visual.ln_pre.weight": ("vision_model.pre_layrnorm.weight", False),  # sic: transformers' spelling
    "visual.ln_pre.bias": ("vision_model.pre_layrnorm.bias", False),
    "visual.ln_post.weight": ("vision_model.post_layernorm.weight", False),
    "visual.ln_post.bias": ("vision_model.post_layernorm.bias", False),
    "visual.proj": ("visual_projection.weight", True),
}


def open_clip_to_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an open_clip ViT CLIP state dict (the standard `CLIP` class: OpenAI-style text tower, `tok` pooling,
    no layer scale) to transformers' `CLIPModel` keys. nn.MultiheadAttention's packed `in_proj_weight` [3w, w]
    is split into q/k/v in that order; projections are transposed. Raises KeyError on a key it does not know."""
    out = {}
    for k, v in state_dict.items():
        if k == "attn_mask" or k.endswith(".attn_mask"):
            continue  # the causal mask buffer (non-persistent in open_clip 3, present in older checkpoints)
        if k in _FLAT:
            name, transpose = _FLAT[k]
            out[name] = v.t().contiguous() if transpose else v
            continue
        m = _BLOCK.match(k)
        if m is None:
            raise KeyError(f"open_clip key {k!r} has no transformers CLIPModel counterpart")
        tower = "vision_model" if m.group(1) else "text_model"
        prefix, rest = f"{tower}.encoder.layers.{m.group(2)}.", m.group(3)
        if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
            kind = rest.rsplit("_", 1)[1]  # weight | bias
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[f"{prefix}self_attn.{part}.{kind}"] = chunk.contiguous()
            continue
        base, _, kind = rest.rpartition(".")
        if base not in _BLOCK_PARTS:
            raise KeyError(f"open_clip key {k!r} has no transformers CLIPModel counterpart")
        out[f"{prefix}{_BLOCK_PARTS[base]}.{kind}"] = v
    return out


def hf_clip_config(cfg: dict):
    """transformers `CLIPConfig` of the same architecture as an open_clip model config (standard ViT CLIP)."""
    from transformers import CLIPConfig

    act = "quick_gelu" if cfg.get("quick_gelu") else "gelu"  # open_clip's default is exact GELU (nn.GELU)
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    text = dict(vocab_size=t.get("vocab_size", 49408), hidden_size=t.get("width", 512),
                intermediate_size=int(t.get("width", 512) * t.get("mlp_ratio", 4.0)),
                num_hidden_layers=t.get("layers", 12), num_attention_heads=t.get("heads", 8),
                max_position_embeddings=t.get("context_length", 77), hidden_act=act, layer_norm_eps=1e-5,
                # eos 49407 (not the legacy 2) makes transformers pool at the first EOT, like open_clip's argmax
                bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    width = v.get("width", 768)
    vision = dict(hidden_size=width, intermediate_size=int(width * v.get("mlp_ratio", 4.0)),
                  num_hidden_layers=v.get("layers", 12), num_attention_heads=width // v.get("head_width", 64),
                  image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16), hidden_act=act,
                  layer_norm_eps=1e-5)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=cfg["embed_dim"])


def open_clip_to_hf(model, cfg: dict):
    """A transformers `CLIPModel` computing the same features as the open_clip `model` (strict load)."""
    from transformers import CLIPModel

    hf = CLIPModel(hf_clip_config(cfg))
    hf.load_state_dict(open_clip_to_hf_state_dict(model.state_dict()), strict=True)
    return hf.eval()


# --- tokenizer / processor / MLP ---------------------------------------------------------------------------

def clip_bpe_vocab() -> tuple[dict[str, int], list[str]]:
    """The CLIP BPE vocabulary (49408 ids) and its 48894 merges, rebuilt from open_clip's bundled
    `bpe_simple_vocab_16e6.txt.gz` the way openai/CLIP `simple_tokenizer.py` builds its encoder: the 256 byte
    symbols, the same with `</w>`, one entry per merge, then the two special tokens (ids 49406, 49407)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = lines[1:49152 - 256 - 2 + 1]  # the first line is a version header
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges] + [SOT, EOT]
    return {t: i for i, t in enumerate(tokens)}, merges


def save_clip_tokenizer(directory) -> Path:
    """Write vocab.json + merges.txt (the files of openai/clip-vit-*) and the transformers tokenizer files."""
    from transformers import CLIPTokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_bpe_vocab()
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    CLIPTokenizer.from_pretrained(str(d), local_files_only=True).save_pretrained(str(d))
    return d


def save_tiny_hf_clip(directory, seed: int = 0, *, image_size: int = 32, quick_gelu: bool = False,
                      processor_size: int | None = None) -> tuple[Path, Path]:
    """Write `<directory>/model` (CLIPModel.save_pretrained of the tiny open_clip model of `seed`, converted)
    and `<directory>/processor` (CLIPTokenizer + CLIPImageProcessor: shortest edge and crop = `processor_size`,
    default the model's image size, OpenAI mean/std). Returns (model dir, processor dir)."""
    from transformers import CLIPImageProcessor

    d = Path(directory)
    model, cfg = build_tiny_open_clip(seed, image_size, quick_gelu)
    model_dir, proc_dir = d / "model", d / "processor"
    open_clip_to_hf(model, cfg).save_pretrained(str(model_dir))
    save_clip_tokenizer(proc_dir)
    s = processor_size or image_size
    CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s}).save_pretrained(str(proc_dir))
    return model_dir, proc_dir


def save_tiny_aesthetic(directory, in_dim: int = 16, seed: int = 0) -> Path:
    """Write `<directory>/aesthetic_mlp.pth`: a random state dict in the LAION improved-aesthetic-predictor
    layout (`layers.{0,2,4,6,7}.{weight,bias}`, in_dim -> 1024 -> 128 -> 64 -> 16 -> 1). Returns its path."""
    from difrl.rewards.clip import AestheticMLP

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = AestheticMLP(in_dim)
    path = d / "aesthetic_mlp.pth"
    torch.save(mlp.state_dict(), path)
    return path


def tiny_reward_options(root, seed: int = 0) -> dict[str, dict]:
    """Build (once; reused when `<root>/.complete` exists) the tiny assets under `root` and return, per reward
    name, the options that build it on them: `build_reward(name, **tiny_reward_options(root)[name])`."""
    root = Path(root)
    oc_dir, hf_dir, mlp_dir = root / "open_clip", root / "hf_clip", root / "aesthetic"
    cfg_path, ckpt = oc_dir / f"{TINY_NAME}.json", oc_dir / f"{TINY_NAME}-hps.pt"
    model_dir, proc_dir = hf_dir / "model", hf_dir / "processor"
    mlp = mlp_dir / "aesthetic_mlp.pth"
    done = root / ".complete"
    if not done.exists() or done.read_text().strip() != str(seed):
        save_tiny_open_clip(oc_dir, seed)
        save_tiny_hf_clip(hf_dir, seed)
        save_tiny_aesthetic(mlp_dir, in_dim=tiny_open_clip_config()["embed_dim"], seed=seed)
        done.write_text(str(seed))
    return {
        "clip_score": {"model_dir": str(model_dir), "processor_dir": str(proc_dir)},
        "pickscore": {"model_dir": str(model_dir), "processor_dir": str(proc_dir)},
        "aesthetic": {"clip_dir": str(model_dir), "processor_dir": str(proc_dir), "mlp_path": str(mlp)},
        "hpsv2": {"checkpoint": str(ckpt), "model_config": str(cfg_path)},
    }
