"""Cheap verifiable image statistics as rewards: they need no checkpoint, so tiny random models can train on them.

    fn = build_reward("brightness")                        # mean pixel value in [0, 1]
    fn = build_reward("brightness", target=0.25)           # 1 - |mean - 0.25|
    fn = build_reward("color", channel="red")              # mean red minus mean of green and blue, in [-1, 1]
    fn(images, prompts, metadata)["brightness"]            # [B]

Images are [B, C, H, W] and videos [B, F, C, H, W] in [0, 1]; every statistic is a mean over
everything but the batch (and, for `color`, the channel) dimension, so videos score per clip.
They stand in for a real reward model in tests and in the tiny configs; they are not preferences.
"""

from __future__ import annotations

import torch

from difrl.rewards import register_reward

CHANNELS = {"red": 0, "green": 1, "blue": 2}


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.float().flatten(1).mean(1)


@register_reward("brightness")
def brightness(target: float | None = None):
    """Mean pixel value; with `target`, closeness 1 - |mean - target| (a peak reward, not a monotone one)."""

    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        mean = _per_sample_mean(images)
        if target is None:
            return {"brightness": mean}
        return {"brightness": 1.0 - (mean - float(target)).abs(), "mean": mean}

    return score


brightness.differentiable = True  # a mean of pixels (difrl.rewards.differentiable)


@register_reward("color")
def color(channel: str = "red"):
    """How much one colour channel dominates: mean(channel) - mean(other channels), in [-1, 1]."""
    if channel not in CHANNELS:
        raise ValueError(f"color reward: channel must be one of {sorted(CHANNELS)}, got {channel!r}")
    c = CHANNELS[channel]

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        if images.ndim not in (4, 5) or images.shape[-3] != 3:
            raise ValueError(f"color reward needs RGB images [B, 3, H, W] or videos [B, F, 3, H, W], got {tuple(images.shape)}")
        means = torch.stack([_per_sample_mean(images[..., k, :, :]) for k in range(3)], 1)  # [B, 3]
        others = [k for k in range(3) if k != c]
        return {"color": means[:, c] - means[:, others].mean(1)}

    return score
