"""JPEG (in)compressibility rewards: the size of each image saved as a JPEG, in kB (DDPO's toy tasks).

    fn = build_reward("jpeg_compressibility")              # -kB at quality 95 (DDPO, ddpo-pytorch rewards.py)
    fn = build_reward("jpeg_compressibility", scale=500)   # -kB/500 (flow_grpo and verl-omni's convention)
    fn = build_reward("jpeg_incompressibility")            # +kB
    out = fn(images, prompts, metadata)                    # {"jpeg_compressibility": [B], "kb": [B]}

Images [B, 3, H, W] in [0, 1] are quantised as a PNG save would quantise them, uint8 = round(255 x) after
clamping to [0, 1] (ddpo-pytorch and flow_grpo do the same before `Image.save`), and encoded by Pillow at
`quality` (default 95) with Pillow's other defaults (4:2:0 chroma subsampling at this quality, no optimise
pass). A kB is 1000 bytes, as in ddpo-pytorch. The size depends on the libjpeg build behind Pillow, so
`version` names Pillow's and libjpeg's versions: record it with the run
(docs/reference/specs/rewards-eval.md §1.8, §3.3). Samples with NaN or infinite pixels raise: they have no size, and a
made-up one would be a silent score.
"""

from __future__ import annotations

import io

import numpy as np
import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel
from difrl.utils.images import to_uint8


def to_uint8_hwc(images: torch.Tensor, reward: str) -> np.ndarray:
    """[B, 3, H, W] float in [0, 1] -> [B, H, W, 3] uint8 RGB, rounded as a PNG save would be (round(255 x)
    after clamping; torchvision's `to_pil_image` truncates instead, which biases every pixel down by 0.5).

    Raises ValueError naming the samples when some pixel is NaN or infinite (those would cast to garbage)."""
    if not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"reward {reward!r} scores RGB images [B, 3, H, W] in [0, 1], got {shape}")
    x = images.detach().float()
    finite = torch.isfinite(x).flatten(1).all(1)  # [B]
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"reward {reward!r}: samples {bad[:8]} of the batch have NaN or infinite pixels")
    return to_uint8(x).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # [B, H, W, 3]


def jpeg_sizes(images: torch.Tensor, quality: int = 95, reward: str = "jpeg") -> list[int]:
    """Bytes of each image [B, 3, H, W] in [0, 1] encoded by Pillow as a JPEG at `quality`."""
    from PIL import Image

    sizes = []
    for arr in to_uint8_hwc(images, reward):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=int(quality))
        sizes.append(buf.tell())
    return sizes


def _pillow_version() -> str:
    import PIL
    from PIL import features

    jpg = features.version("jpg")  # libjpeg(-turbo) version string, or None when Pillow lacks JPEG support
    if jpg is None:
        raise RewardConfigError("the JPEG rewards need Pillow built with JPEG support (features.check('jpg') is False)")
    return f"pillow-{PIL.__version__}+libjpeg-{jpg}"


class JPEGSize(RewardModel):
    """sign * kB / scale of each image as a JPEG; extras: `kb` (the size in kB, 1 kB = 1000 bytes)."""

    modality = "image"

    def __init__(self, key: str, sign: float, quality: int = 95, scale: float = 1.0, batch_size: int | None = 64):
        super().__init__(device="cpu", dtype="float32", batch_size=batch_size)
        if not 1 <= int(quality) <= 100:
            raise RewardConfigError(f"reward {key!r}: quality must be in [1, 100], got {quality!r}")
        if not float(scale) > 0:
            raise RewardConfigError(f"reward {key!r}: scale must be > 0, got {scale!r}")
        self.key, self.sign, self.quality, self.scale = key, float(sign), int(quality), float(scale)
        self.version = f"1+{_pillow_version()}"

    def score(self, images, prompts, metadata):
        kb = torch.tensor(jpeg_sizes(images, self.quality, self.key), dtype=torch.float64) / 1000.0  # [B]
        return {self.key: (self.sign * kb / self.scale).float(), "kb": kb.float()}


@register_reward("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95, scale: float = 1.0, batch_size: int | None = 64) -> JPEGSize:
    """-kB / scale: smaller JPEGs score higher (DDPO's "compressibility"; flow_grpo uses scale=500)."""
    return JPEGSize("jpeg_compressibility", -1.0, quality=quality, scale=scale, batch_size=batch_size)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95, scale: float = 1.0, batch_size: int | None = 64) -> JPEGSize:
    """+kB / scale: larger JPEGs score higher (DDPO's "incompressibility")."""
    return JPEGSize("jpeg_incompressibility", 1.0, quality=quality, scale=scale, batch_size=batch_size)
