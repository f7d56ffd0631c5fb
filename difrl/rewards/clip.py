"""CLIP-family rewards on transformers' CLIPModel, from local `save_pretrained` directories (nothing is downloaded).

    fn = build_reward("clip_score", model_dir="/ckpt/clip-vit-large-patch14")             # plain cosine
    fn = build_reward("clip_score", model_dir=..., scale="clipscore")                      # 2.5 * max(cos, 0)
    fn = build_reward("clip_score", model_dir=..., scale="flow_grpo")                      # exp(logit_scale) * cos / 30
    fn = build_reward("pickscore", model_dir="/ckpt/PickScore_v1",
                      processor_dir="/ckpt/CLIP-ViT-H-14-laion2B-s32B-b79K")                # logit_scale.exp() * cos / 26
    fn = build_reward("aesthetic", clip_dir="/ckpt/clip-vit-large-patch14", mlp_path="/ckpt/sac+logos+ava1-l14-linearMSE.pth")
    fn(images [B, 3, H, W] in [0, 1], prompts, metadata)   # {"clip_score": [B], "cos": [B]} (logged as clip_score/cos)

Every reward takes `device` ("cpu" default, "auto" = first GPU), `dtype` ("float32" default; "bfloat16"/"float16"
on a GPU), `batch_size` (images per forward, default 32). The text rewards take `text_cache_size` (prompts whose
embedding is kept, default 4096; 0 disables): a GRPO group repeats its prompt G times.

Images are preprocessed on tensors with the processor's own settings (shortest side to `size`, centre crop,
normalise with its mean/std; see difrl.rewards.vision): bicubic `F.interpolate` with antialias instead of PIL's
bicubic on uint8 images, so scores differ slightly (third decimal of a cosine) from the reference scorers that
go through PIL. The processor's `resample` (bicubic for every CLIP processor we know; bilinear or nearest
also honoured) picks the interpolation. Score conventions (docs/reference/specs/rewards-eval.md §1.2, §1.3, §1.5, §3.3)
are options, and `version` names the one in use, since the "same" reward means different numbers in different
repos. `logit_scale.exp()` is read in float32 when the model loads, before it is cast to `dtype`: in bf16,
ln(100) rounds to 4.59375 and exp gives 98.86, 1.1% below the checkpoint's 100.

Weights load strictly: a directory whose weights miss a parameter of its config's architecture, or carry one it
does not have, is a RewardConfigError (transformers would initialise the missing ones at random and warn).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from difrl.rewards import register_reward
from difrl.rewards.base import (RewardConfigError, RewardModel, load_state_dict_file, local_dir, local_file,
                                option_names)
from difrl.rewards.vision import (TextEmbeddingCache, clip_config, clip_image_settings, feature_tensor,
                                  load_clip_model, preprocess_clip)


def _check_processor_dir(path, reward: str, option: str, text: bool, note: str = "") -> Path:
    """A CLIP processor directory: preprocessor_config.json, and a tokenizer when the reward reads prompts."""
    try:
        p = local_dir(path, "the CLIP processor (image processor" + (" + tokenizer)" if text else ")"), option, reward,
                      needs=("preprocessor_config.json",))
    except RewardConfigError as e:
        if not note:
            raise
        raise RewardConfigError(f"{e}; {note}") from e
    if text and not ((p / "tokenizer.json").is_file() or ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())):
        raise RewardConfigError(f"reward {reward!r}: the processor directory {str(p)!r} (reward.options.{reward}.{option}) "
                                "has no tokenizer (tokenizer.json, or vocab.json + merges.txt)" + (f"; {note}" if note else ""))
    return p


class _HFClipReward(RewardModel):
    """Shared loading and scoring of the transformers-CLIP rewards: image and text embeddings, L2-normalised,
    and their cosine. Subclasses turn the cosine into their score."""

    modality = "image"
    name = "clip"
    differentiable = True  # tensor-side preprocessing (difrl.rewards.vision): the cosine has a graph to the pixels

    # scale option -> the `version` string that names its score convention (each subclass has its own table)
    SCALES: dict[str, str] = {"cos": "cos"}
    local_paths = {"model_dir": ("the CLIP model", ("config.json",)),
                   "processor_dir": ("the CLIP processor (image processor + tokenizer)", ("preprocessor_config.json",))}
    required = ("model_dir",)

    def __init__(self, model_dir, processor_dir=None, scale: str = "cos", *, device="cpu", dtype="float32",
                 batch_size=32, text_cache_size: int = 4096, processor_note: str = ""):
        if scale not in self.SCALES:
            raise RewardConfigError(f"reward {self.name!r}: scale must be one of {tuple(self.SCALES)}, got {scale!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from transformers import AutoTokenizer

        self.scale, self.version = scale, self.SCALES[scale]
        mdir = local_dir(model_dir, "the CLIP model", "model_dir", self.name)
        popt = "processor_dir" if processor_dir not in (None, "") else "model_dir"
        pdir = _check_processor_dir(processor_dir if processor_dir not in (None, "") else mdir, self.name, popt,
                                    text=True, note=processor_note)  # before the (GBs) model loads
        self.model, _ = load_clip_model(mdir, **option_names("model_dir", self.name))
        self.tokenizer = AutoTokenizer.from_pretrained(str(pdir), local_files_only=True)
        self.image_settings = clip_image_settings(pdir, **option_names(popt, self.name))
        # exp(logit_scale) in float32 before the cast (a bf16 logit_scale = ln 100 would give 98.86)
        self.logit_scale_exp = float(self.model.logit_scale.detach().float().exp())
        self.model.to(device=self.device, dtype=self.dtype)
        self.max_length = int(self.model.config.text_config.max_position_embeddings)  # 77 for every CLIP
        self.text_cache = TextEmbeddingCache(self.encode_text, max_size=max(int(text_cache_size), 1),
                                             enabled=int(text_cache_size) > 0)
        self.weight_files = list(dict.fromkeys([mdir, pdir]))  # hashed with difrl.utils.io.weights_sha256

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[N] prompts -> [N, D] L2-normalised float32 text embeddings (truncated to 77 tokens, as peers do)."""
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        out = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok.get("attention_mask"))
        return F.normalize(feature_tensor(out).float(), dim=-1)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> [B, D] L2-normalised float32 image embeddings."""
        x = preprocess_clip(images, self.image_settings).to(self.dtype)
        return F.normalize(feature_tensor(self.model.get_image_features(pixel_values=x)).float(), dim=-1)

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """[B] cosine between each image and its own prompt."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name!r}: {images.shape[0]} images but {len(prompts)} prompts")
        return (self.encode_image(images) * self.text_cache(prompts)).sum(-1)


@register_reward("clip_score")
class ClipScore(_HFClipReward):
    """Image-prompt agreement under a CLIP model (e.g. openai/clip-vit-large-patch14 saved locally).

    Options: `model_dir` (CLIPModel save_pretrained directory), `processor_dir` (tokenizer + image processor;
    default `model_dir`), `scale`:
      - "cos" (default): the plain cosine, as Pref-GRPO and Flow-Factory `rewards/clip.py`; DiffusionNFT's
        `clip_scorer.py` divides logits_per_image by 100, the same with OpenAI's exp(logit_scale) = 100
        (docs/reference/specs/rewards-eval.md §1.2);
      - "flow_grpo": exp(logit_scale) * cos / 30, flow_grpo's `clip_scorer.py` (logits_per_image.diagonal() / 30,
        about 3.33 * cos for OpenAI CLIP; from the issue 32 review of its source, not re-read here): use it with
        reward weights copied from flow_grpo's configs;
      - "clipscore": 2.5 * max(cos, 0), Hessel et al. 2021 "CLIPScore" (with ViT-B/32 in the paper);
      - "x100": 100 * max(cos, 0), torchmetrics `CLIPScore`.
    exp(logit_scale) is the checkpoint's, in float32 whatever `dtype`.
    Returns {"clip_score": [B], "cos": [B]} (the raw cosine is always logged)."""

    name = "clip_score"
    SCALES = {"cos": "cos", "clipscore": "2.5*max(cos,0)", "x100": "100*max(cos,0)",
              "flow_grpo": "exp(logit_scale)*cos/30"}

    def __init__(self, model_dir=None, processor_dir=None, scale: str = "cos", device="cpu", dtype="float32",
                 batch_size=32, text_cache_size: int = 4096):
        super().__init__(model_dir, processor_dir, scale, device=device, dtype=dtype, batch_size=batch_size,
                         text_cache_size=text_cache_size)

    def score(self, images, prompts, metadata):
        cos = self.cosine(images, prompts)  # float32
        if self.scale == "cos":
            s = cos
        elif self.scale == "flow_grpo":
            s = self.logit_scale_exp * cos / 30.0
        else:
            s = (2.5 if self.scale == "clipscore" else 100.0) * cos.clamp(min=0)
        return {"clip_score": s, "cos": cos}


@register_reward("pickscore")
class PickScore(_HFClipReward):
    """PickScore (Kirstain et al. 2023): a CLIP ViT-H-14 fine-tuned on Pick-a-Pic preferences.

    Options: `model_dir` (yuvalkirstain/PickScore_v1 saved locally), `processor_dir` (PickScore has no processor
    of its own: the laion/CLIP-ViT-H-14-laion2B-s32B-b79K tokenizer + image processor, saved locally), `scale`:
      - "div26" (default): logit_scale.exp() * cos / 26, as flow_grpo `pickscore_scorer.py`, Flow-Factory
        `rewards/pick_score.py` and verl-omni `pickscore_reward.py` ("normalise to about 0-1");
      - "logit": logit_scale.exp() * cos, the paper's score (typically 18-24 for PickScore_v1, whose
        logit_scale.exp() is ~100).
    Returns {"pickscore": [B], "cos": [B], "logit": [B]}."""

    name = "pickscore"
    SCALES = {"div26": "exp(logit_scale)*cos/26", "logit": "exp(logit_scale)*cos"}

    def __init__(self, model_dir=None, processor_dir=None, scale: str = "div26", device="cpu", dtype="float32",
                 batch_size=32, text_cache_size: int = 4096):
        super().__init__(model_dir, processor_dir, scale, device=device, dtype=dtype, batch_size=batch_size,
                         text_cache_size=text_cache_size,
                         processor_note="PickScore uses the laion/CLIP-ViT-H-14-laion2B-s32B-b79K processor: "
                                        "save it locally and set processor_dir")

    def score(self, images, prompts, metadata):
        cos = self.cosine(images, prompts)
        logit = self.logit_scale_exp * cos  # float32 scale (read before the cast to dtype) times float32 cos
        return {"pickscore": logit / 26.0 if self.scale == "div26" else logit, "cos": cos, "logit": logit}


CLIP_SCALES, PICK_SCALES = tuple(ClipScore.SCALES), tuple(PickScore.SCALES)  # the accepted `scale` values


class AestheticMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head (christophschuhmann/improved-aesthetic-predictor
    `simple_inference.py`): in_dim -> 1024 -> 128 -> 64 -> 16 -> 1 with dropouts in between, and no
    activations (so it is affine in eval mode). The module layout matches the released `.pth` state dicts:
    `layers.{0,2,4,6,7}.{weight,bias}`. Input: [B, in_dim] L2-normalised CLIP image embeddings."""

    def __init__(self, in_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, in_dim] -> [B, 1]
        return self.layers(x)


def load_aesthetic_mlp(path, reward: str = "aesthetic", option: str = "mlp_path") -> AestheticMLP:
    """Our AestheticMLP with the weights of a LAION-layout `.pth` (or `.safetensors`) file, strictly; the input
    width is read from the file (768 for ViT-L/14). A {"state_dict": ...} wrapper and a DDP `module.` prefix are
    accepted; any other key mismatch is a RewardConfigError naming the option and the path."""
    sd = load_state_dict_file(path, "the aesthetic MLP weights", option, reward)
    p = Path(path)
    expected = {f"layers.{i}.{w}" for i in (0, 2, 4, 6, 7) for w in ("weight", "bias")}
    if set(sd) != expected:
        raise RewardConfigError(
            f"reward {reward!r}: {str(p)!r} (reward.options.{reward}.{option}) is not a LAION aesthetic MLP state "
            f"dict: missing {sorted(expected - set(sd))[:6]}, unexpected {sorted(set(sd) - expected)[:6]} "
            "(expected layers.0/2/4/6/7.weight/bias)")
    mlp = AestheticMLP(int(sd["layers.0.weight"].shape[1]))
    try:
        mlp.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise RewardConfigError(f"reward {reward!r}: {str(p)!r} (reward.options.{reward}.{option}) has the LAION "
                                f"key layout but wrong shapes: {e}") from e
    return mlp.eval().requires_grad_(False)


@register_reward("aesthetic")
class Aesthetic(RewardModel):
    """LAION improved aesthetic predictor (the reward of DDPO, flow_grpo, DiffusionNFT): an MLP on the
    L2-normalised CLIP ViT-L/14 image embedding, scores typically 4-7 (a 1-10 rating scale). Prompts are ignored.

    Options: `clip_dir` (openai/clip-vit-large-patch14 saved locally; the text tower is dropped after loading),
    `processor_dir` (its image processor; default `clip_dir`), `mlp_path` (e.g. `sac+logos+ava1-l14-linearMSE.pth`,
    the file ddpo-pytorch and flow_grpo ship in their assets).
    Returns {"aesthetic": [B]}; the embedding is computed in the CLIP's dtype, the MLP runs in float32."""

    modality = "image"
    version = "laion-v2-mlp(l2norm clip)"
    differentiable = True
    local_paths = {"clip_dir": ("the CLIP model", ("config.json",)), "mlp_path": ("the aesthetic MLP weights", None),
                   "processor_dir": ("the CLIP processor (image processor)", ("preprocessor_config.json",))}
    required = ("clip_dir", "mlp_path")

    def __init__(self, clip_dir=None, mlp_path=None, processor_dir=None, device="cpu", dtype="float32",
                 batch_size=32):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        mlp_file = local_file(mlp_path, "the aesthetic MLP weights", "mlp_path", "aesthetic")
        self.mlp = load_aesthetic_mlp(mlp_file)  # first: a wrong file fails before the CLIP loads
        cdir = local_dir(clip_dir, "the CLIP model", "clip_dir", "aesthetic")
        popt = "processor_dir" if processor_dir not in (None, "") else "clip_dir"
        pdir = _check_processor_dir(processor_dir if processor_dir not in (None, "") else cdir, "aesthetic", popt,
                                    text=False)
        cfg = clip_config(cdir, **option_names("clip_dir", "aesthetic"))
        dim = int(cfg.get("projection_dim", 512))  # CLIPConfig's default
        in_dim = self.mlp.layers[0].in_features
        if in_dim != dim:
            raise RewardConfigError(f"reward 'aesthetic': the MLP {str(mlp_file)!r} (reward.options.aesthetic.mlp_path) "
                                    f"takes {in_dim}-d embeddings but the CLIP in {str(cdir)!r} (clip_dir) makes "
                                    f"{dim}-d ones (the LAION MLP goes with CLIP ViT-L/14: 768-d)")
        self.clip, _ = load_clip_model(cdir, **option_names("clip_dir", "aesthetic"), vision_only=True)
        assert int(self.clip.config.projection_dim) == dim
        self.image_settings = clip_image_settings(pdir, **option_names(popt, "aesthetic"))
        self.clip.to(device=self.device, dtype=self.dtype)
        self.mlp.to(device=self.device)
        self.weight_files = list(dict.fromkeys([cdir, pdir, mlp_file]))  # hashed with difrl.utils.io.weights_sha256

    def score(self, images, prompts, metadata):
        x = preprocess_clip(images, self.image_settings).to(self.dtype)
        emb = F.normalize(feature_tensor(self.clip.get_image_features(pixel_values=x)).float(), dim=-1)  # [B, D]
        return {"aesthetic": self.mlp(emb).squeeze(-1)}
