"""Tensor-side image preprocessing, feature helpers and CLIP loading shared by the CLIP-family rewards (clip.py,
hps.py) and the FD_CLIP extractor (difrl.eval.extractors).

    x = resize_shortest_center_crop(images, 224, (224, 224))   # CLIP / PickScore / aesthetic: [B, 3, 224, 224]
    x = resize_longest_pad_square(images, 224)                 # HPSv2: longest side to 224, zero pad to a square
    x = normalize(x, OPENAI_MEAN, OPENAI_STD)
    feats = feature_tensor(model.get_image_features(pixel_values=x))   # a [B, D] tensor on any transformers
    cache = TextEmbeddingCache(encode)                          # prompts repeat within a GRPO group: encode once
    model, d = load_clip_model(path, "reward.options.clip_score.model_dir", "reward 'clip_score'", vision_only=True)
    settings = clip_image_settings(processor_dir, option, who)  # hf_image_settings of the saved CLIPImageProcessor

Images are [B, 3, H, W] float in [0, 1], on the reward's device: they are never turned into PIL images. The
resize is `F.interpolate(mode="bicubic", antialias=True)` on float pixels. The reference scorers (HPSv2's
`img_score.py`, flow_grpo's PickScore/CLIP scorers, the LAION aesthetic notebook) resize uint8 PIL images with
PIL's bicubic filter, so a score here differs from theirs by a small amount (typically in the third decimal of
a cosine; pixels differ by ~1e-3 on average, up to a few 1e-3 at edges). transformers 5's default
`CLIPImageProcessor` (torchvision backend) computes exactly this on float input (checked in
tests/test_rewards_clip.py).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from difrl.rewards.base import RewardConfigError
from difrl.utils.local import local_dir, model_config

# OpenAI CLIP's normalisation (openai/CLIP clip/clip.py `_transform`; open_clip constants.py OPENAI_DATASET_MEAN/STD).
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


# PIL resample codes (what a processor's `resample` holds) -> F.interpolate modes, as transformers' torchvision
# backend maps them (`pil_torch_interpolation_mapping`: NEAREST -> NEAREST_EXACT); antialias applies to the
# (bi)linear and bicubic ones. BOX, HAMMING and LANCZOS have no F.interpolate counterpart.
RESAMPLE_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


def _resize(images: torch.Tensor, size: tuple[int, int], mode: str = "bicubic") -> torch.Tensor:
    """[B, C, H, W] -> [B, C, *size] with `mode` (antialiased for bilinear / bicubic), computed in float32 (the
    CPU kernels lack half precision). Not clamped: bicubic overshoots [0, 1] slightly at sharp edges, as in
    transformers' torchvision backend (which this equals on float input); PIL would clip to uint8 there."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    smooth = mode in ("bilinear", "bicubic")
    out = F.interpolate(images.float(), size=size, mode=mode, antialias=smooth,
                        **({"align_corners": False} if smooth else {}))
    return out.to(images.dtype)


def shortest_side_size(h: int, w: int, size: int) -> tuple[int, int]:
    """The (h, w) that brings the shorter side to `size`, keeping the aspect ratio; the longer side is truncated
    like torchvision's Resize(int) and transformers' `get_resize_output_image_size(default_to_square=False)`."""
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def center_crop(images: torch.Tensor, crop: tuple[int, int]) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, ch, cw], offsets int((H - ch) / 2) as transformers' torchvision backend does; an
    image smaller than the crop is zero padded first (same convention)."""
    ch, cw = crop
    h, w = images.shape[-2:]
    if ch > h or cw > w:
        pad_h, pad_w = max(ch - h, 0), max(cw - w, 0)
        images = F.pad(images, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        h, w = images.shape[-2:]
    top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
    return images[..., top:top + ch, left:left + cw]


def resize_shortest_center_crop(images: torch.Tensor, size: int | tuple[int, int],
                                crop: tuple[int, int] | None, mode: str = "bicubic") -> torch.Tensor:
    """CLIP's preprocessing: shorter side to `size` (an int), or to exactly (h, w) for a pair, with the
    F.interpolate `mode` (RESAMPLE_MODES), then a centre crop.

    images: [B, 3, H, W] in [0, 1] -> [B, 3, crop_h, crop_w] (or the resized size when `crop` is None)."""
    h, w = images.shape[-2:]
    target = shortest_side_size(h, w, size) if isinstance(size, int) else tuple(size)
    out = _resize(images, target, mode)
    return center_crop(out, crop) if crop is not None else out


def resize_longest_pad_square(images: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """HPSv2's preprocessing (tgxs002/HPSv2 `hpsv2/src/open_clip/transform.py` ResizeMaxSize): the longer side to
    `size`, keeping the aspect ratio (rounded), then pad the shorter side, centred (the extra pixel at the end),
    with `fill` in pixel space (0 = black, before normalisation). Square images: just a resize.

    As upstream, an image whose longer side is already `size` is neither resized nor padded (ResizeMaxSize does
    both only when the scale is not 1). A square one is then passed through untouched; a non-square one
    (e.g. 224 x 160) would reach the model unpadded, which a fixed-size ViT cannot take (upstream fails on it
    inside the model), so it is a ValueError here rather than a score upstream never gives.
    images: [B, 3, H, W] in [0, 1] -> [B, 3, size, size]."""
    h, w = images.shape[-2:]
    if max(h, w) == size:
        if h != w:
            raise ValueError(f"HPSv2 preprocessing: a {h}x{w} image has its longer side at {size} already, so "
                             f"HPSv2's ResizeMaxSize leaves it unpadded and the {size}x{size} model cannot take it; "
                             "resize the images (e.g. to a longer side other than " f"{size}) before scoring")
        return images
    scale = size / max(h, w)
    nh, nw = (size, size) if h == w else (round(h * scale), round(w * scale))
    out = _resize(images, (nh, nw))
    pad_h, pad_w = size - nh, size - nw
    if pad_h or pad_w:
        out = F.pad(out, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)
    return out


def normalize(images: torch.Tensor, mean, std) -> torch.Tensor:
    """(x - mean) / std per channel; images [B, 3, H, W], mean and std 3 floats."""
    m = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def feature_tensor(out) -> torch.Tensor:
    """The [B, D] embedding from `get_image_features` / `get_text_features` on any transformers version: a tensor
    up to 4.x, a `BaseModelOutputWithPooling` whose `pooler_output` is the projected embedding from 5.0
    (transformers PR #42564; Flow-Factory `_extract_feature_tensor` and verl-omni `_feature_tensor` unwrap alike)."""
    if torch.is_tensor(out):
        return out
    # a *WithProjection model's output carries the projected embedding as image_embeds / text_embeds next to an
    # unprojected pooler_output, so those names come first
    for name in ("image_embeds", "text_embeds", "pooler_output"):
        t = getattr(out, name, None)
        if torch.is_tensor(t):
            return t
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"cannot find a feature tensor in {type(out).__name__}")


def hf_image_settings(processor) -> dict:
    """What a transformers `CLIPImageProcessor` (any backend) would do, as plain values: {"size": int (shortest
    edge) or (h, w) or None (no resize), "resample": an F.interpolate mode (from the processor's PIL `resample`
    code, RESAMPLE_MODES), "crop": (h, w) or None, "mean": 3 floats, "std": 3 floats}. A resample mode with no
    F.interpolate counterpart (box, hamming, lanczos) is a ValueError."""
    def get(d, key):
        if d is None:
            return None
        return d.get(key) if hasattr(d, "get") else getattr(d, key, None)

    size = getattr(processor, "size", None)
    if not getattr(processor, "do_resize", True) or size is None:
        resize = None
    elif isinstance(size, int):
        resize = size
    elif get(size, "shortest_edge"):
        resize = int(get(size, "shortest_edge"))
    elif get(size, "height") and get(size, "width"):
        resize = (int(get(size, "height")), int(get(size, "width")))
    else:
        raise ValueError(f"unsupported image processor size {size!r} (expected shortest_edge or height/width)")
    code = getattr(processor, "resample", 3)
    code = 3 if code is None else int(getattr(code, "value", code))  # PILImageResampling or int; None: bicubic
    if resize is not None and code not in RESAMPLE_MODES:
        raise ValueError(f"unsupported image processor resample {code} (supported PIL codes: {RESAMPLE_MODES})")
    crop = getattr(processor, "crop_size", None)
    if not getattr(processor, "do_center_crop", True) or crop is None:
        crop = None
    elif isinstance(crop, int):
        crop = (crop, crop)
    else:
        crop = (int(get(crop, "height")), int(get(crop, "width")))
    if getattr(processor, "do_normalize", True):
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return {"size": resize, "resample": RESAMPLE_MODES.get(code, "bicubic"), "crop": crop, "mean": mean, "std": std}


def preprocess_clip(images: torch.Tensor, settings: dict) -> torch.Tensor:
    """`hf_image_settings`' recipe on a tensor batch: [B, 3, H, W] in [0, 1] -> normalised [B, 3, h, w]."""
    x = images
    if settings["size"] is not None:
        x = resize_shortest_center_crop(x, settings["size"], settings["crop"], settings.get("resample", "bicubic"))
    elif settings["crop"] is not None:
        x = center_crop(x, settings["crop"])
    return normalize(x, settings["mean"], settings["std"])


class TextEmbeddingCache:
    """Prompt -> normalised text embedding [D], computed in one batch for the prompts not seen yet.

    GRPO scores G images per prompt, so most prompts in a batch repeat; a training run revisits its prompt set.
    `encode(list[str]) -> [N, D]` runs without gradients (text embeddings are constants of the reward). The
    cache keeps the `max_size` most recently used prompts. The returned [B, D] is a fresh `torch.stack` (a normal
    tensor even outside the `torch.inference_mode()` the embeddings were made under), so a differentiable caller
    can multiply it with image features that require grad."""

    def __init__(self, encode: Callable[[list[str]], torch.Tensor], max_size: int = 4096, enabled: bool = True):
        self.encode, self.max_size, self.enabled = encode, int(max_size), bool(enabled)
        self._store: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        self._store.clear()

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        """[B] prompts -> [B, D] embeddings (rows in prompt order)."""
        if not self.enabled:
            with torch.no_grad():
                return self.encode(list(prompts))
        missing = list(dict.fromkeys(p for p in prompts if p not in self._store))
        if missing:
            with torch.no_grad():
                new = self.encode(missing)
            for p, e in zip(missing, new):
                self._store[p] = e
        rows = []
        for p in prompts:
            self._store.move_to_end(p)
            rows.append(self._store[p])
        while len(self._store) > self.max_size:
            self._store.popitem(last=False)
        return torch.stack(rows)


# --- CLIP from a save_pretrained directory ------------------------------------------------------------------------

# parameters transformers recomputes (CLIP's position_ids buffers, saved by older transformers): not weights
_IGNORED_KEYS = ("position_ids",)


def clip_config(d: Path, option: str, who: str, error: type[Exception] = RewardConfigError) -> dict:
    """The config.json of a CLIPModel directory, checked to be one (read before the weights load)."""
    return model_config(d, option, who, error, model_type="clip", kind="a transformers CLIPModel")


def load_clip_model(model_dir, option: str, who: str, error: type[Exception] = RewardConfigError,
                    vision_only: bool = False):
    """(transformers CLIPModel, its directory) from a local save_pretrained directory, in eval mode without grads,
    every parameter from the file (strict: transformers would initialise a missing one at random and only warn);
    errors are `error`s naming `who`, the full `option` and the path. `vision_only` drops the text tower after
    loading (`get_image_features` reads vision_model + visual_projection only; CLIPVisionModelWithProjection
    would read projection_dim from the vision sub-config, which a CLIPModel config need not set, and report
    every text key as unexpected)."""
    from transformers import CLIPModel

    d = local_dir(model_dir, "the CLIP model", option, who, error)
    clip_config(d, option, who, error)
    model, info = CLIPModel.from_pretrained(str(d), local_files_only=True, output_loading_info=True)
    bad = {kind: sorted(k for k in info.get(kind, ()) if not str(k).endswith(_IGNORED_KEYS))
           for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        raise error(f"{who}: the weights in {str(d)!r} ({option}) do not fit its config.json's CLIPModel: "
                    + "; ".join(f"{len(v)} {k.replace('_', ' ')} {v[:4]}" for k, v in bad.items() if v)
                    + " (not a transformers CLIPModel save_pretrained directory? an open_clip / OpenAI file needs "
                    "converting)")
    if vision_only:
        model.text_model = model.text_projection = None
    return model.eval().requires_grad_(False), d


def clip_image_settings(pdir: Path, option: str, who: str, error: type[Exception] = RewardConfigError) -> dict:
    """`hf_image_settings` of the CLIPImageProcessor saved in `pdir`; an unsupported setting names the option."""
    from transformers import CLIPImageProcessor

    try:
        return hf_image_settings(CLIPImageProcessor.from_pretrained(str(pdir), local_files_only=True))
    except ValueError as e:
        raise error(f"{who}: the processor in {str(pdir)!r} ({option}): {e}") from e
