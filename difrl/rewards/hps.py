"""HPSv2 / HPSv2.1 (Human Preference Score, Wu et al. 2023) on open_clip, from a local checkpoint file.

    fn = build_reward("hpsv2", checkpoint="/ckpt/HPS_v2.1_compressed.pt")                     # ViT-H-14
    fn = build_reward("hpsv2", checkpoint=ckpt, model_config="/cfg/my-tiny-clip.json")          # other architecture
    fn(images [B, 3, H, W] in [0, 1], prompts, metadata)["hpsv2"]                               # [B], ~0.2-0.35

Needs the `rewards` extra (open-clip-torch). The `hpsv2` package is not used: it fails to import from its
wheel, pins pytest and protobuf, and downloads the 3.9 GB laion ViT-H-14 before overwriting every weight with
the HPS checkpoint (docs/reference/specs/rewards-eval.md §1.1). Here the architecture is built with
`open_clip.create_model(arch, pretrained=None)` (random init, nothing downloaded) and the HPS file's state dict
is loaded strictly. The tokenizer is `open_clip.get_tokenizer(arch)`, whose BPE file ships in the wheel.

Preprocessing follows HPSv2's `image_transform(..., resize_longest_max=True)`: the longer side to the model's
image size (224), zero padding to a square, OpenAI mean/std; done on tensors with bicubic `F.interpolate`
(antialias) instead of PIL's bicubic on uint8 images, so scores differ slightly (third decimal) from
`hpsv2.score`. The score is the cosine of the normalised image and text features, as HPSv2's `img_score.py`
(no logit scale). Options: `checkpoint` (required), `architecture` (default "ViT-H-14", or the stem of
`model_config`), `model_config` (an open_clip model-config JSON, registered with `open_clip.add_model_config`),
`device`, `dtype`, `batch_size`, `text_cache_size`. HPSv2 and HPSv2.1 differ only in their weights (same
architecture, preprocessing and score), so the checkpoint file is the choice between them; the former `variant`
option changed nothing but a label and is refused with that explanation.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel, load_state_dict_file, local_file, optional_import
from difrl.rewards.vision import OPENAI_MEAN, OPENAI_STD, TextEmbeddingCache, normalize, resize_longest_pad_square

NAME = "hpsv2"


def _register_config(open_clip, path, architecture: str | None) -> str:
    """Register an open_clip model-config JSON under its file stem (open_clip's naming); returns that name.
    Refuses a stem that already names a different config, since registration is global to the process."""
    p = local_file(path, "the open_clip model config", "model_config", NAME)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RewardConfigError(f"reward {NAME!r}: cannot read the model config {str(p)!r} "
                                f"(reward.options.{NAME}.model_config): {e}") from e
    if not isinstance(cfg, dict) or not all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise RewardConfigError(f"reward {NAME!r}: {str(p)!r} (reward.options.{NAME}.model_config) is not an "
                                "open_clip model config (needs embed_dim, vision_cfg, text_cfg)")
    name = p.stem
    if architecture not in (None, "", name):
        raise RewardConfigError(f"reward {NAME!r}: open_clip names a config file by its stem, {name!r}; "
                                f"architecture={architecture!r} does not match (leave architecture unset)")
    known = open_clip.get_model_config(name)
    if known is None:
        open_clip.add_model_config(p)
    elif known != cfg:
        raise RewardConfigError(f"reward {NAME!r}: open_clip already has a different config named {name!r}; "
                                f"rename {str(p)!r} (reward.options.{NAME}.model_config)")
    return name


@contextmanager
def _quiet_random_init_warning():
    """Drop open_clip's root-logger warning 'No pretrained weights loaded ... initialized randomly' while the
    architecture is built (the HPS state dict is loaded right after, so the warning would mislead)."""
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No pretrained weights loaded")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def load_hps_state_dict(path) -> dict[str, torch.Tensor]:
    """The state dict of an HPS checkpoint ({"state_dict": ...} as HPS_v2(.1)_compressed.pt, or a bare one;
    `.safetensors` too), read with `weights_only=True` (no arbitrary unpickling); a DDP `module.` prefix is
    removed."""
    return load_state_dict_file(path, "the HPS checkpoint", "checkpoint", NAME)


@register_reward(NAME)
class HPSv2(RewardModel):
    """HPSv2 / v2.1 score: cos(image, prompt) under the HPS-fine-tuned open_clip model. See the module docstring."""

    modality = "image"
    differentiable = True  # tensor-side resize and pad, open_clip towers: a graph to the pixels
    local_paths = {"checkpoint": ("the HPS checkpoint (e.g. HPS_v2.1_compressed.pt)", None),
                   "model_config": ("the open_clip model config", None)}
    required, packages = ("checkpoint",), (("open_clip", "rewards"),)

    def __init__(self, checkpoint=None, architecture: str | None = None, model_config=None,
                 variant: str | None = None, device="cpu", dtype="float32", batch_size=32,
                 text_cache_size: int = 4096):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if variant is not None:  # named here so that the refusal can say why (it only ever set `version`)
            raise RewardConfigError(f"reward {NAME!r}: variant={variant!r} would change nothing but a label: HPSv2 and "
                                    "v2.1 differ only in their weights, so the checkpoint file decides which one "
                                    f"scores; remove reward.options.{NAME}.variant")
        ckpt = local_file(checkpoint, "the HPS checkpoint (e.g. HPS_v2.1_compressed.pt)", "checkpoint", NAME)
        open_clip = optional_import("open_clip", "rewards", NAME)
        sd = load_hps_state_dict(ckpt)  # before building the model: a bad file fails in milliseconds, not after a ViT-H init
        if model_config not in (None, ""):
            arch = _register_config(open_clip, model_config, architecture)
            cfg_file = [Path(model_config).expanduser()]
        else:
            arch = architecture or "ViT-H-14"
            cfg_file = []
            if open_clip.get_model_config(arch) is None:
                raise RewardConfigError(f"reward {NAME!r}: open_clip has no architecture {arch!r} "
                                        f"(reward.options.{NAME}.architecture); give model_config= a config JSON")
        # pretrained=None: random init, no download; pretrained_text/image=False: no tower weights from a hub either
        with _quiet_random_init_warning():  # open_clip warns "initialized randomly"; the HPS weights come next
            model = open_clip.create_model(arch, pretrained=None, pretrained_image=False, pretrained_text=False)
        if "logit_scale" in sd and sd["logit_scale"].shape != model.logit_scale.shape \
                and sd["logit_scale"].numel() == model.logit_scale.numel():
            sd["logit_scale"] = sd["logit_scale"].reshape(model.logit_scale.shape)  # [] vs [1] across open_clip versions
        want = set(model.state_dict())
        missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
        if missing or unexpected:
            raise RewardConfigError(
                f"reward {NAME!r}: the checkpoint {str(ckpt)!r} (reward.options.{NAME}.checkpoint) does not fit "
                f"open_clip {arch!r}: {len(missing)} missing keys {missing[:4]}, {len(unexpected)} unexpected "
                f"{unexpected[:4]} (wrong architecture/model_config?)")
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise RewardConfigError(f"reward {NAME!r}: the checkpoint {str(ckpt)!r} (reward.options.{NAME}.checkpoint) "
                                    f"has the keys of {arch!r} but not its shapes: {str(e)[:600]}") from e
        self.model = model.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        self.architecture = arch
        self.tokenizer = open_clip.get_tokenizer(arch)
        pp = open_clip.get_model_preprocess_cfg(model)
        size = pp.get("size", model.visual.image_size)
        size = tuple(size) if isinstance(size, (tuple, list)) else (int(size), int(size))
        if size[0] != size[1]:
            raise RewardConfigError(f"reward {NAME!r}: HPS preprocessing pads to a square, but {arch!r} takes "
                                    f"{size[0]}x{size[1]} images")
        self.image_size = int(size[0])
        self.mean, self.std = tuple(pp.get("mean", OPENAI_MEAN)), tuple(pp.get("std", OPENAI_STD))
        self.fill = float(pp.get("fill_color", 0)) / 255.0
        self.text_cache = TextEmbeddingCache(self.encode_text, max_size=max(int(text_cache_size), 1),
                                             enabled=int(text_cache_size) > 0)
        self.version = "hps-cos"
        self.weight_files = cfg_file + [ckpt]

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> [B, 3, S, S] normalised (S = the model's image size, 224 for ViT-H-14)."""
        x = resize_longest_pad_square(images, self.image_size, fill=self.fill)
        return normalize(x, self.mean, self.std)

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[N] prompts -> [N, D] L2-normalised float32 text features (77 tokens, truncated with a final EOT)."""
        tokens = self.tokenizer(list(prompts)).to(self.device)
        return F.normalize(self.model.encode_text(tokens).float(), dim=-1)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> [B, D] L2-normalised float32 image features."""
        return F.normalize(self.model.encode_image(self.preprocess(images).to(self.dtype)).float(), dim=-1)

    def score(self, images, prompts, metadata):
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {NAME!r}: {images.shape[0]} images but {len(prompts)} prompts")
        cos = (self.encode_image(images) * self.text_cache(prompts)).sum(-1)  # [B]
        return {NAME: cos}
