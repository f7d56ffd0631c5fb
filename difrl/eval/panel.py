"""The evaluation panel of a diffusers world: held-out rewards and FD / KID on the evaluation samples.

    panel = EvalPanel(cfg.eval, resolution=(H, W))          # cfg.eval.rewards, cfg.eval.fid (difrl.train.config)
    metrics = panel(images, prompts, metadata, seeds, ids)  # {"heldout/<name>": mean, "fd": ..., "kid": ...,
                                                            #  "fd_extractor": ..., "fd_report": {...provenance}}

Held-out rewards are scored on the same fixed-seed evaluation samples as the training reward and are
never trained on, so a training reward that climbs while they stay flat or fall is reward hacking
(docs/reference/specs/rewards-eval.md §3.2). The Fréchet distance uses a named extractor from local weights
(difrl.eval.extractors, difrl.eval.reference): Inception (FID, TF1 resize), CLIP or DINOv2, against a
reference image directory (resized to the samples' size, bicubic) or a saved FeatureStats `.npz`; the
reference statistics are cached per (dataset, extractor, weights, resolution). Videos [N, F, 3, H, W] are
scored per frame against the reference images (`fd` over all frames; the report says "per frame"), and with
`eval.fid.reference_clips` (a directory of GIF / animated WebP clips) at the clip level: `fd_clip`
on a clip feature made of the mean frame feature and the mean absolute change between consecutive
frame features ([2 D], so clips of any length compare; a simple appearance + motion summary, not
FVD's I3D features). Everything is built on the first call, so a run without a panel pays nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def make_extractor(kind: str, weights, device="cpu"):
    from difrl.eval.extractors import ClipExtractor, DinoV2Extractor, InceptionExtractor

    option = "eval.fid.weights"  # the config key errors name
    if kind == "inception":
        return InceptionExtractor(weights, antialias=False, device=device, option=option)
    if kind == "clip":
        return ClipExtractor(weights, device=device, option=option)
    if kind == "dinov2":
        return DinoV2Extractor(weights, device=device, option=option)
    raise ValueError(f"eval.fid.extractor must be inception, clip or dinov2, got {kind!r}")


def reference_images(directory: Path, resolution: tuple[int, int], batch: int = 64):
    """Batches [b, 3, H, W] in [0, 1] of the directory's images (sorted by name), RGB, resized to `resolution`."""
    from PIL import Image

    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"eval.fid.reference {str(directory)!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    h, w = resolution
    for lo in range(0, len(files), batch):
        out = []
        for p in files[lo:lo + batch]:
            img = Image.open(p).convert("RGB")
            if img.size != (w, h):
                img = img.resize((w, h), Image.BICUBIC)
            out.append(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1))
        yield torch.stack(out).float() / 255.0


def clip_features(frame_feats: torch.Tensor) -> torch.Tensor:
    """[N, F, D] per-frame features -> [N, 2 D]: the mean over frames and the mean |f_{t+1} - f_t| (0 for F = 1)."""
    motion = ((frame_feats[:, 1:] - frame_feats[:, :-1]).abs().mean(1) if frame_feats.shape[1] > 1
              else torch.zeros_like(frame_feats[:, 0]))
    return torch.cat([frame_feats.mean(1), motion], dim=1)


def reference_clips(directory: Path, resolution: tuple[int, int]) -> list[torch.Tensor]:
    """The directory's clips (GIF / animated WebP, sorted by name) as [F, 3, H, W] in [0, 1], frames resized."""
    from PIL import Image, ImageSequence

    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in (".gif", ".webp"))
    if not files:
        raise ValueError(f"eval.fid.reference_clips {str(directory)!r} holds no .gif / .webp clips")
    h, w = resolution
    clips = []
    for p in files:
        frames = []
        for f in ImageSequence.Iterator(Image.open(p)):
            f = f.convert("RGB")
            f = f if f.size == (w, h) else f.resize((w, h), Image.BICUBIC)
            frames.append(torch.frombuffer(bytearray(f.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1))
        clips.append(torch.stack(frames).float() / 255.0)
    return clips


def _dataset_name(directory: Path) -> str:
    """The directory's name plus a hash of its file names and sizes: two reference sets never share a cache file."""
    h = hashlib.sha256()
    for p in sorted(directory.iterdir()):
        if p.suffix.lower() in IMAGE_SUFFIXES:
            h.update(f"{p.name}:{p.stat().st_size};".encode())
    return f"{directory.name}-{h.hexdigest()[:8]}"


class EvalPanel:
    def __init__(self, eval_cfg, resolution: tuple[int, int], device="cpu"):
        self.cfg, self.resolution, self.device = eval_cfg, tuple(resolution), device
        self.rewards: dict | None = None
        self.extractor = self.reference = self.reference_clip_feats = None

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], seeds: torch.Tensor,
                 ids: torch.Tensor) -> dict:
        out = {}
        if self.cfg.rewards:
            from difrl.rewards import build_reward, score_all

            if self.rewards is None:
                self.rewards = {n: self._build(build_reward, n, o or {}) for n, o in self.cfg.rewards.items()}
            scores = score_all(self.rewards, images, prompts, metadata, seeds, ids)  # a failure raises: never a 0
            out.update({f"heldout/{k}": float(v[torch.isfinite(v)].mean()) for k, v in scores.items()})
        if self.cfg.fid.reference is not None:
            out.update(self.fid(images))
        return out

    @staticmethod
    def _build(build_reward, name: str, options: dict):
        """A held-out reward; its option errors name the panel's keys (eval.rewards.NAME.OPTION, not reward.options)."""
        from difrl.rewards.base import RewardConfigError

        try:
            return build_reward(name, **options)
        except RewardConfigError as e:
            raise RewardConfigError(str(e).replace(f"reward.options.{name}.", f"eval.rewards.{name}.")) from e

    def fid(self, images: torch.Tensor) -> dict:
        from difrl.eval.extractors import extract_features
        from difrl.eval.reference import FeatureStats, fid_report, reference_stats

        fc = self.cfg.fid
        if self.extractor is None:
            self.extractor = make_extractor(fc.extractor, fc.weights, self.device)
            ref = Path(fc.reference).expanduser()
            if ref.suffix == ".npz":
                self.reference = FeatureStats.load(ref)
            elif ref.is_dir():
                self.reference = reference_stats(self.extractor, lambda: reference_images(ref, self.resolution),
                                                 fc.cache_dir, _dataset_name(ref), self.resolution, keep_features=True)
            else:
                raise FileNotFoundError(f"eval.fid.reference {str(ref)!r}: neither a directory of images nor a .npz of "
                                        "feature statistics")
        frames = images.flatten(0, 1) if images.ndim == 5 else images  # videos: every frame against the images
        gen = extract_features(self.extractor, frames)
        rep = fid_report(gen, self.reference, self.extractor, kid_subset_size=fc.kid_subset_size)
        rep["per_frame"], rep["resolution"] = images.ndim == 5, list(images.shape[-2:])
        out = {"fd": rep["fd"], "fd_extractor": rep["extractor"], "fd_report": rep}
        if "kid_mean" in rep:
            out["kid"] = rep["kid_mean"]
        if images.ndim == 5 and fc.reference_clips is not None:
            out.update(self.clip_fd(gen.view(images.shape[0], images.shape[1], -1)))
        return out

    def clip_fd(self, frame_feats: torch.Tensor) -> dict:
        """Clip-level FD / KID on `clip_features` against the reference clips (features computed once)."""
        from difrl.eval.extractors import extract_features
        from difrl.eval.reference import fid_report

        if self.reference_clip_feats is None:
            clips = reference_clips(Path(self.cfg.fid.reference_clips).expanduser(), self.resolution)
            self.reference_clip_feats = torch.cat([clip_features(extract_features(self.extractor, c)[None])
                                                   for c in clips])
        rep = fid_report(clip_features(frame_feats), self.reference_clip_feats, None,
                         kid_subset_size=self.cfg.fid.kid_subset_size)
        rep.update({"extractor": f"{self.extractor.name}+clip(mean,motion)", "weights_sha256": self.extractor.weights_sha256,
                    "reference_clips": str(self.cfg.fid.reference_clips)})
        return {"fd_clip": rep["fd"], "fd_clip_report": rep, **({"kid_clip": rep["kid_mean"]} if "kid_mean" in rep else {})}
