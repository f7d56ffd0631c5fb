"""Video rewards from image rewards: an image reward over a clip's frames, reduced, plus temporal consistency.

    fn = build_reward("video", image_reward="clip_score", image_options={"model_dir": "/m/clip"},
                      reduce="mean", frames=4, temporal_weight=0.5)
    fn(videos [B, F, 3, H, W] in [0, 1], prompts, metadata)
    # {"video": [B], "frame_mean": [B], "frame_min": [B], "temporal": [B]}

Each selected frame is scored by the image reward with its clip's prompt and metadata (`frames`
evenly spaced frames, first and last included; None = all). `reduce` "mean" rewards the average
frame, "min" the worst one (a clip is only as good as its weakest frame; verl-omni's video
PickScore averages sampled frames). The temporal-consistency term is
1 - mean_t mean_pixels |x_{t+1} - x_t| in [0, 1]: 1 for a still clip, lower the more consecutive
frames differ. It rewards smoothness only, so it is weighted (`temporal_weight`, default 0) and
logged on its own; a flickering clip scores low on it, a frozen one scores 1.
"""

from __future__ import annotations

import torch

from difrl.rewards import build_reward, register_reward
from difrl.rewards.base import RewardConfigError, RewardModel


def frame_indices(num_frames: int, frames: int | None) -> torch.Tensor:
    """`frames` evenly spaced indices into range(num_frames), first and last included (all when None or more)."""
    if frames is None or frames >= num_frames:
        return torch.arange(num_frames)
    if frames == 1:
        return torch.tensor([num_frames // 2])
    return torch.linspace(0, num_frames - 1, frames).round().long()


def temporal_consistency(videos: torch.Tensor) -> torch.Tensor:
    """[B, F, 3, H, W] -> [B]: 1 - mean absolute change between consecutive frames (1 for F = 1)."""
    if videos.shape[1] < 2:
        return torch.ones(videos.shape[0])
    return 1.0 - (videos[:, 1:].float() - videos[:, :-1].float()).abs().flatten(1).mean(1)


@register_reward("video")
class VideoReward(RewardModel):
    """An image reward over frames (mean or min) + temporal_weight * temporal consistency."""

    modality = "video"

    @classmethod
    def preflight(cls, options: dict, who: str, prefix: str) -> list[str]:
        """difrl.rewards.preflight: the image reward's own checks, its options at `prefix`.image_options."""
        from difrl.rewards.preflight import preflight_reward

        name = options.get("image_reward", "brightness")
        return preflight_reward(name, options.get("image_options") or {}, f"{who} (image_reward {name!r})",
                                f"{prefix}.image_options")

    def __init__(self, image_reward: str = "brightness", image_options: dict | None = None, reduce: str = "mean",
                 frames: int | None = None, temporal_weight: float = 0.0, batch_size: int | None = None):
        super().__init__(device=None, dtype=None, batch_size=batch_size)
        if reduce not in ("mean", "min"):
            raise RewardConfigError(f"reward 'video': reduce must be 'mean' or 'min', got {reduce!r}")
        if frames is not None and int(frames) < 1:
            raise RewardConfigError(f"reward 'video': frames must be >= 1 or null, got {frames!r}")
        self.image = build_reward(image_reward, **(image_options or {}))
        if self.image.modality not in ("image", "any"):
            raise RewardConfigError(f"reward 'video': image_reward {image_reward!r} scores {self.image.modality}, "
                                    "not images")
        self.device, self.dtype = None, None  # the frames go to the image reward's own device, in its chunks
        self.reduce, self.frames, self.temporal_weight = reduce, frames, float(temporal_weight)
        self.weight_files = list(getattr(self.image.fn, "weight_files", []))
        self.version = f"{image_reward}@{self.image.info()['version']}/{reduce}/t{self.temporal_weight:g}"

    def score(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        B, F = videos.shape[:2]
        idx = frame_indices(F, self.frames)
        frames = videos[:, idx].reshape(B * len(idx), *videos.shape[2:])  # [B*F', 3, H, W], clip-major
        per_frame = self.image(frames, [p for p in prompts for _ in idx], [m for m in metadata for _ in idx])
        s = per_frame[self.image.key].view(B, len(idx))
        temporal = temporal_consistency(videos).cpu()
        frame_score = s.mean(1) if self.reduce == "mean" else s.min(1).values
        return {"video": frame_score + self.temporal_weight * temporal, "frame_mean": s.mean(1),
                "frame_min": s.min(1).values, "temporal": temporal}
