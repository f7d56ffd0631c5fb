"""The evaluation sections of the trainers' configs (``eval``, ``stop``); difrl.train.config re-exports them.

    cfg.eval.every, cfg.eval.rewards (the held-out panel), cfg.eval.fid.reference   # FlowEvalConfig
    cfg.stop.fd_rise                                                                 # StopConfig (digits world)

``EvalConfig`` is what every trainer's evaluation has; ``FlowEvalConfig`` adds the flow worlds' ODE
steps, the held-out reward panel and FID / KID (difrl.eval.panel); difrl/train/masked/config.py has
the masked worlds' ``MaskedEvalConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difrl.config import cfg_field, config_error


@dataclass
class EvalConfig:
    every: int = cfg_field(10, ge=0, help="iterations between evaluations (0 = only before/after)")
    per_digit: int = cfg_field(50, ge=1, help="samples per prompt (digits, digit_tokens, diffusers models)")
    seed: int = cfg_field(1234)


@dataclass
class FidConfig:
    """Fréchet distance (and KID) of the evaluation samples against a reference image set (difrl.eval.reference, difrl.eval.extractors);
    diffusers worlds (the digits world has its own FD on its classifier's features)."""
    extractor: str = cfg_field("inception", choices=("inception", "clip", "dinov2"),
                               help="inception: FID (TF1 resize, antialias=False); clip / dinov2: FD_CLIP / FD_DINOv2")
    weights: str | None = cfg_field(None, help="inception: the local weights file (pt_inception-2015-12-05 / "
                                               "weights-inception-2015-12-05-6726825d.pth); clip / dinov2: a "
                                               "save_pretrained directory")
    reference: str | None = cfg_field(None, help="a directory of reference images (resized to the samples' size) or "
                                                 "a .npz of FeatureStats; None = no FD")
    reference_clips: str | None = cfg_field(None, help="videos: a directory of reference clips (GIF / animated "
                                                       "WebP) for the clip-level FD (fd_clip); None = per-frame FD only")
    cache_dir: str = cfg_field("~/.cache/difrl/fid", help="reference statistics, one file per (dataset, extractor, "
                                                          "weights, resolution)")
    kid_subset_size: int = cfg_field(1000, ge=2, help="KID subsets of at most this many samples (100 subsets)")


@dataclass
class FlowEvalConfig(EvalConfig):
    num_steps: int = cfg_field(10, ge=1, help="ODE steps")
    rewards: dict[str, dict] = cfg_field(default_factory=dict,
                                         help="held-out reward panel: reward name (or name@alias) -> options; scored "
                                              "on the evaluation samples as heldout/<name>, never trained on (the "
                                              "reward-hacking monitor, side by side with the training reward)")
    fid: FidConfig = field(default_factory=FidConfig)

    def validate(self) -> None:
        from difrl.rewards import unknown_reward

        for name in self.rewards:
            if (problem := unknown_reward(name)) is not None:
                raise config_error(f"rewards.{name}", problem)


@dataclass
class StopConfig:
    """Early stopping on the eval's Fréchet distance (the unseen judge is never used)."""
    fd_rise: float | None = cfg_field(None, gt=0.0, help="stop once FD exceeds its best by this factor (e.g. 1.1); None = off")
    patience: int = cfg_field(2, ge=1, help="consecutive evaluations above the threshold before stopping")
    min_accuracy: float = cfg_field(0.0, ge=0.0, le=1.0, help="only stop once eval accuracy is at least this")
