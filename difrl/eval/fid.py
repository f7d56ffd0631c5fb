"""Fréchet distance (FID, FD_DINOv2, FD_CLIP, the worlds' FD), KID and cached reference statistics, offline.

    ext = InceptionExtractor("/ckpt/weights-inception-2015-12-05-6726825d.pth")     # FID; antialias=False: TF1 resize
    ext = DinoV2Extractor("/ckpt/dinov2-vitl14")                   # FD_DINOv2 (Dinov2Model.save_pretrained dir)
    ext = ClipExtractor("/ckpt/clip-vit-large-patch14")            # FD_CLIP (CLIPModel dir; processor_dir optional)
    ext = ModuleExtractor(world.classifier, "difrl-digits-cnn-penultimate-64d", method="features")
    ref = reference_stats(ext, real_images, cache_dir="~/.cache/difrl/fid", dataset_name="coco30k", resolution=512)
    gen = extract_features(ext, generated_images)                  # [N, D] float32 on the CPU
    report = fid_report(gen, ref, ext)    # {"fd", "kid_mean", "kid_std", "extractor", "weights_sha256", "resize_mode",
                                          #  "n_gen", "n_ref", "ref_stats_sha256", ...}

Images are [B, 3, H, W] float in [0, 1] (or uint8 in [0, 255]); nothing is downloaded: every extractor loads from a
local file or `save_pretrained` directory, and a missing one is an `EvalConfigError` that names the path.

What the numbers are (rewards-eval.md §3.1):
- `frechet_distance_from_stats` is difrl.eval.metrics' Fréchet distance (float64, symmetric eigendecompositions:
  tr sqrt(S_a^1/2 S_b S_a^1/2) instead of scipy.linalg.sqrtm(S_a S_b)); on stats from `stats_of` it returns the very
  bits of `metrics.frechet_distance(a, b)`.
- `kid` is the unbiased MMD^2 with the cubic polynomial kernel (Binkowski et al. 2018, "Demystifying MMD GANs",
  arXiv:1801.01401), mean and population std over random subsets, with torchmetrics' `KernelInceptionDistance`
  defaults (100 subsets of 1000, degree 3, gamma 1/D, coef 1) and the same subsets for the same seed.
- FID numbers from different resize paths are different metrics: `InceptionExtractor(antialias=False)` is the
  TF1-compatible bilinear resize of torch-fidelity / pytorch-fid / torchmetrics(antialias=False) that published FIDs
  use; antialias=True is torchmetrics' default. Every report carries {extractor, weights_sha256, resize_mode, n_gen,
  n_ref, ref_stats_sha256} so that two numbers are only compared when those agree.
- Float images are quantised to uint8 by rounding (what saving a PNG does: diffusers' `numpy_to_pil` rounds) before
  any extractor: FID of in-memory samples equals FID of the saved files. torchmetrics' `normalize=True` truncates
  instead (`(x * 255).byte()`), which shifts pixels by half a level on average.
- Reference statistics are computed once per (dataset, extractor name + weights hash, resolution) and cached as a
  float64 `.npz` (mu, sigma, n, JSON provenance; `FeatureStats.sha256` identifies the numbers).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from difrl.eval.metrics import _sqrt_psd

STATS_FORMAT = "difrl-feature-stats-v1"
# ImageNet normalisation of DINOv2 (facebookresearch/dinov2 `dinov2/data/transforms.py` IMAGENET_DEFAULT_MEAN/STD)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class EvalConfigError(ValueError):
    """An evaluation option is wrong (missing weights file or directory, unknown choice): nothing was computed."""


# --- local files ------------------------------------------------------------------------------------------------

def _local_file(path, what: str, who: str, option: str) -> Path:
    """A weights file that must exist locally; the error names the extractor, the option and the path."""
    if path in (None, ""):
        raise EvalConfigError(f"{who} needs {what}: set {option} to a local file (difrl never downloads weights)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise EvalConfigError(f"{who}: {what} not found at {str(p)!r} ({option}"
                              f"{'; it is a directory' if p.is_dir() else ''}; difrl never downloads weights)")
    return p


def _local_dir(path, what: str, who: str, option: str, model_type: str | None = None) -> Path:
    """A `save_pretrained` directory holding config.json (of `model_type` when given)."""
    if path in (None, ""):
        raise EvalConfigError(f"{who} needs {what}: set {option} to a local save_pretrained directory "
                              "(difrl never downloads weights)")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise EvalConfigError(f"{who}: {what} directory not found at {str(p)!r} ({option})")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise EvalConfigError(f"{who}: {what} directory {str(p)!r} ({option}) lacks config.json: is it a "
                              "save_pretrained directory?")
    if model_type is not None:
        try:
            found = json.loads(cfg_path.read_text()).get("model_type")
        except (OSError, json.JSONDecodeError) as e:
            raise EvalConfigError(f"{who}: cannot read {str(cfg_path)!r} ({option}): {e}") from e
        if found != model_type:
            raise EvalConfigError(f"{who}: {str(p)!r} ({option}) holds a {found!r} model, not {model_type!r}")
    return p


def _optional_import(module: str, who: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EvalConfigError(f"{who} needs the package {module!r}, which does not import here ({e}); install it "
                              "with: pip install 'difrl[eval]'") from e


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hf_weight_files(*dirs: Path) -> list[Path]:
    """The files that define a save_pretrained model's features: configs and weights (`.bin` ignored when
    `.safetensors` exist, as transformers prefers those), sorted per directory."""
    out: list[Path] = []
    for d in dict.fromkeys(dirs):
        files = sorted(p for p in d.iterdir() if p.is_file() and (
            p.suffix in (".safetensors", ".bin") or p.name in ("config.json", "preprocessor_config.json",
                                                                "model.safetensors.index.json")))
        if any(p.suffix == ".safetensors" for p in files):
            files = [p for p in files if p.suffix != ".bin"]
        out += files
    return out


def _sha256_paths(paths: list[Path]) -> str:
    """One SHA-256 over (file name, file bytes) in order: the identity of a directory's weights."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def state_dict_sha256(module: nn.Module) -> str:
    """SHA-256 over a module's state dict (names, dtypes, shapes and bytes, in key order): the identity of an
    in-memory extractor's weights."""
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] float in [0, 1] -> uint8 by rounding (clamped), as a saved PNG holds them; uint8 passes."""
    if images.dtype == torch.uint8:
        return images
    return (images.float().clamp(0, 1) * 255).round().to(torch.uint8)


# --- statistics ---------------------------------------------------------------------------------------------

@dataclass
class FeatureStats:
    """Gaussian statistics of a feature set: mu float64 [D], sigma float64 [D, D] (unbiased covariance), n samples,
    a JSON-able provenance dict, and optionally the float32 features [n, D] themselves (KID needs them)."""

    mu: np.ndarray
    sigma: np.ndarray
    n: int
    provenance: dict = field(default_factory=dict)
    features: np.ndarray | None = None

    def __post_init__(self):
        self.mu = np.ascontiguousarray(np.asarray(self.mu, dtype=np.float64).reshape(-1))
        d = self.mu.shape[0]
        self.sigma = np.ascontiguousarray(np.asarray(self.sigma, dtype=np.float64).reshape(d, d))
        self.n = int(self.n)
        if self.features is not None:
            self.features = np.ascontiguousarray(np.asarray(self.features, dtype=np.float32))
            if self.features.shape != (self.n, d):
                raise ValueError(f"features have shape {self.features.shape}, expected ({self.n}, {d})")

    @property
    def dim(self) -> int:
        return int(self.mu.shape[0])

    @property
    def sha256(self) -> str:
        """SHA-256 of the numbers (format tag, n, mu, sigma, and the features when kept), little-endian: stable across
        save/load and across recomputation on the same inputs; the provenance (which holds a timestamp) is not in it."""
        h = hashlib.sha256(STATS_FORMAT.encode() + b"\0")
        h.update(np.int64(self.n).astype("<i8").tobytes())
        h.update(self.mu.astype("<f8").tobytes())
        h.update(self.sigma.astype("<f8").tobytes())
        if self.features is not None:
            h.update(b"features\0" + self.features.astype("<f4").tobytes())
        return h.hexdigest()

    def save(self, path) -> Path:
        """Write a `.npz` (mu, sigma float64; n int64; provenance as a JSON string; features float32 when kept),
        atomically (a temporary file renamed into place), readable with `np.load(allow_pickle=False)`."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"format": np.array(STATS_FORMAT), "mu": self.mu, "sigma": self.sigma, "n": np.int64(self.n),
                  "provenance": np.array(json.dumps(self.provenance, sort_keys=True, default=str))}
        if self.features is not None:
            arrays["features"] = self.features
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path) -> "FeatureStats":
        path = Path(path).expanduser()
        if not path.is_file():
            raise EvalConfigError(f"feature statistics not found at {str(path)!r}")
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("format", "mu", "sigma", "n", "provenance") if k not in z.files]
            if missing:
                raise ValueError(f"{str(path)!r} is not a difrl feature-statistics file (lacks {', '.join(missing)})")
            if str(z["format"]) != STATS_FORMAT:
                raise ValueError(f"{str(path)!r} has format {str(z['format'])!r}, expected {STATS_FORMAT!r}")
            return cls(mu=z["mu"], sigma=z["sigma"], n=int(z["n"]), provenance=json.loads(str(z["provenance"])),
                       features=z["features"] if "features" in z.files else None)

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu [D], sigma [D, D]) as float64 tensors sharing memory with the arrays."""
        return torch.from_numpy(self.mu), torch.from_numpy(self.sigma)


def stats_of(features: torch.Tensor, provenance: dict | None = None, keep_features: bool = False) -> FeatureStats:
    """[N, D] features -> FeatureStats, in float64 with exactly the operations of metrics.frechet_distance (mean,
    torch.cov), so `frechet_distance_from_stats(stats_of(a), stats_of(b)) == frechet_distance(a, b)` bit for bit."""
    f = torch.as_tensor(features)
    if f.dim() != 2 or f.shape[0] < 2:
        raise ValueError(f"need [N >= 2, D] features, got shape {tuple(f.shape)}")
    a = f.detach().cpu().double()
    mu, sigma = a.mean(0), torch.cov(a.T).reshape(a.shape[1], a.shape[1])
    return FeatureStats(mu.numpy(), sigma.numpy(), a.shape[0], dict(provenance or {}),
                        f.detach().cpu().float().numpy() if keep_features else None)


class StatsAccumulator:
    """Streaming mean and covariance in float64 (Chan, Golub & LeVeque's pairwise update: each batch's mean and
    centred scatter matrix merged into the running ones), for reference sets too large to hold as features."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, None, None

    def add(self, feats: torch.Tensor) -> None:
        b = feats.detach().cpu().double()  # [B, D]
        if b.shape[0] == 0:
            return
        bm = b.mean(0)
        c = b - bm
        bm2 = c.T @ c  # [D, D] scatter of the batch about its own mean
        if self.n == 0:
            self.n, self.mean, self.m2 = b.shape[0], bm, bm2
            return
        n, nb = self.n, b.shape[0]
        tot = n + nb
        delta = bm - self.mean
        self.mean = self.mean + delta * (nb / tot)
        self.m2 = self.m2 + bm2 + torch.outer(delta, delta) * (n * nb / tot)
        self.n = tot

    def stats(self, provenance: dict | None = None) -> FeatureStats:
        if self.n < 2:
            raise ValueError(f"need at least 2 samples for a covariance, got {self.n}")
        return FeatureStats(self.mean.numpy(), (self.m2 / (self.n - 1)).numpy(), self.n, dict(provenance or {}))


def _as_mu_sigma(s) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(s, FeatureStats):
        return s.as_tensors()
    mu, sigma = s
    return torch.as_tensor(np.asarray(mu), dtype=torch.float64), torch.as_tensor(np.asarray(sigma), dtype=torch.float64)


def frechet_distance_from_stats(a, b) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) for two FeatureStats (or (mu, sigma) pairs),
    in float64. (S_a^1/2 S_b S_a^1/2)^1/2 has the trace of (S_a S_b)^1/2 (similar matrices), the form of
    Heusel et al. 2017 and pytorch-fid; both square roots are symmetric eigendecompositions with negative
    round-off eigenvalues clamped to 0 (difrl.eval.metrics._sqrt_psd), never a complex scipy.linalg.sqrtm."""
    mu_a, cov_a = _as_mu_sigma(a)
    mu_b, cov_b = _as_mu_sigma(b)
    if mu_a.shape != mu_b.shape:
        raise ValueError(f"feature dimensions differ: {mu_a.shape[0]} vs {mu_b.shape[0]}")
    sa = _sqrt_psd(cov_a)
    cross = _sqrt_psd(sa @ cov_b @ sa)
    return float(((mu_a - mu_b) ** 2).sum() + torch.trace(cov_a) + torch.trace(cov_b) - 2 * torch.trace(cross))


# --- KID ------------------------------------------------------------------------------------------------------

def polynomial_kernel(x: torch.Tensor, y: torch.Tensor, degree: int = 3, gamma: float | None = None,
                      coef: float = 1.0) -> torch.Tensor:
    """k(x, y) = (gamma <x, y> + coef)^degree; x [m, D], y [n, D] -> [m, n]; gamma defaults to 1/D."""
    g = 1.0 / x.shape[1] if gamma is None else gamma
    return (x @ y.T * g + coef) ** degree


def mmd2_unbiased(x: torch.Tensor, y: torch.Tensor, degree: int = 3, gamma: float | None = None,
                  coef: float = 1.0) -> float:
    """Unbiased MMD^2 (Gretton et al. 2012, eq. 3; the estimator of Binkowski et al. 2018's KID):
    sum_{i != j} k(x_i, x_j) / (m (m - 1)) + sum_{i != j} k(y_i, y_j) / (n (n - 1)) - 2 sum_{i, j} k(x_i, y_j) / (m n).
    x [m, D], y [n, D], computed in float64."""
    x, y = x.double(), y.double()
    m, n = x.shape[0], y.shape[0]
    if m < 2 or n < 2:
        raise ValueError(f"MMD needs at least 2 samples per set, got {m} and {n}")
    kxx, kyy, kxy = (polynomial_kernel(x, x, degree, gamma, coef), polynomial_kernel(y, y, degree, gamma, coef),
                     polynomial_kernel(x, y, degree, gamma, coef))
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    return float(sxx + syy - 2 * kxy.sum() / (m * n))


def kid(feats_a: torch.Tensor, feats_b: torch.Tensor, subsets: int = 100, subset_size: int = 1000, degree: int = 3,
        gamma: float | None = None, coef: float = 1.0, seed: int = 0) -> tuple[float, float]:
    """Kernel Inception Distance: (mean, population std) of `mmd2_unbiased` over `subsets` random subsets of
    `subset_size` rows drawn without replacement from each set. feats_a [N_a, D], feats_b [N_b, D].

    Subsets: per subset, `torch.randperm(N_a)` then `torch.randperm(N_b)` from a private generator seeded with
    `seed`: the draws of torchmetrics' `KernelInceptionDistance.compute()` (which draws real first, then fake, from
    the global generator) after `torch.manual_seed(seed)` with real = a. So
    `kid(real, fake)` equals torchmetrics' value for the same features up to float rounding (this computes in float64,
    torchmetrics in the features' dtype). Raises when `subset_size` exceeds either set, as torchmetrics does."""
    a, b = torch.as_tensor(feats_a).detach().cpu().double(), torch.as_tensor(feats_b).detach().cpu().double()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need [N, D] feature sets of one D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if subset_size > a.shape[0] or subset_size > b.shape[0]:
        raise ValueError(f"subset_size {subset_size} exceeds the number of samples ({a.shape[0]} and {b.shape[0]})")
    g = torch.Generator().manual_seed(int(seed))
    vals = []
    for _ in range(int(subsets)):
        ia = torch.randperm(a.shape[0], generator=g)[:subset_size]
        ib = torch.randperm(b.shape[0], generator=g)[:subset_size]
        vals.append(mmd2_unbiased(a[ia], b[ib], degree, gamma, coef))
    v = torch.tensor(vals, dtype=torch.float64)
    return float(v.mean()), float(v.std(unbiased=False))


# --- feature extractors -------------------------------------------------------------------------------------

class FeatureExtractor(nn.Module):
    """The protocol: `name` (the feature space, with its resize convention), `metric` (the report's metric name:
    "fid", "fd_dinov2", "fd_clip", "fd"), `weights_sha256`, `resize_mode`, `num_features` (D; torchmetrics reads
    it, so any extractor can be passed as `FrechetInceptionDistance(feature=ext)`), and
    `forward(images [B, 3, H, W] in [0, 1] or uint8) -> [B, D] float32`. Always in eval mode."""

    name: str = "extractor"
    metric: str = "fd"
    weights_sha256: str = ""
    resize_mode: str = "none"
    num_features: int = 0

    def train(self, mode: bool = True):
        return super().train(False)

    @property
    def device(self) -> torch.device:
        p = next(iter(list(self.parameters()) + list(self.buffers())), None)
        return p.device if p is not None else torch.device("cpu")

    def info(self) -> dict:
        return {"extractor": self.name, "metric": self.metric, "weights_sha256": self.weights_sha256,
                "resize_mode": self.resize_mode, "dim": int(self.num_features)}


class InceptionExtractor(FeatureExtractor):
    """FID's Inception-v3 (the TF 2015-12-05 graph as ported by torch-fidelity), 2048-d pool3 features, from a local
    `weights-inception-2015-12-05-6726825d.pth` (torch-fidelity's release file; difrl never fetches it).

    antialias=False (default): torch-fidelity's `FeatureExtractorInceptionV3` itself, whose resize to 299 is the
    TF1-compatible bilinear of the original FID code (what published FIDs use). antialias=True: torchmetrics'
    `NoTrainInceptionV3(antialias=True)`, torch's antialiased bilinear, torchmetrics' default FID. Float input is
    rounded to uint8 first (`to_uint8`); both networks take uint8 and scale (x - 128) / 128 inside.

    The file is read once with `torch.load(weights_only=True)` and must be a plain state dict before torch-fidelity
    (which unpickles with weights_only=False) sees it."""

    metric = "fid"

    def __init__(self, weights_path, antialias: bool = False, device="cpu", option: str = "weights_path"):
        super().__init__()
        who = "InceptionExtractor"  # option: the name the user sets weights_path by, for the error (eval.fid.weights)
        path = _local_file(weights_path, "the Inception weights (torch-fidelity's "
                           "weights-inception-2015-12-05-6726825d.pth)", who, option)
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise EvalConfigError(f"{who}: cannot read {str(path)!r} (weights_path) as a plain state dict with "
                                  f"torch.load(weights_only=True): {type(e).__name__}: {e}") from e
        if not isinstance(sd, dict) or "Mixed_7c.branch_pool.conv.weight" not in sd:
            raise EvalConfigError(f"{who}: {str(path)!r} (weights_path) is not torch-fidelity's Inception-v3 state "
                                  "dict (no 'Mixed_7c.branch_pool.conv.weight')")
        del sd
        self.antialias = bool(antialias)
        if self.antialias:
            fid_mod = _optional_import("torchmetrics.image.fid", who)
            _optional_import("torch_fidelity", who)
            self.net = fid_mod.NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                                  feature_extractor_weights_path=str(path), antialias=True)
        else:
            tf = _optional_import("torch_fidelity.feature_extractor_inceptionv3", who)
            self.net = tf.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                      feature_extractor_weights_path=str(path))
        self.net.requires_grad_(False).eval()
        self.weights_path = path
        self.weights_sha256 = sha256_file(path)
        self.resize_mode = "uint8-round+" + ("torch-bilinear-antialias-299" if self.antialias else "tf1-bilinear-299")
        self.name = f"inception-v3-tf2015-pool3-2048[{self.resize_mode}]"
        self.num_features = 2048
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_uint8(images)  # [B, 3, H, W] uint8; resized to 299 x 299 inside the network
        out = self.net(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.reshape(x.shape[0], -1).float()  # [B, 2048]


def save_random_inception_weights(path, seed: int = 0) -> Path:
    """Write a random-weights state dict of torch-fidelity's Inception-v3 (the full 23.9 M parameter architecture;
    95.7 MB) in the layout `FeatureExtractorInceptionV3` loads, for tests: convolutions He-normal so activations keep
    their scale through the 94 layers (default init shrinks them to ~1e-8), batch-norm affine terms perturbed.
    Nothing is downloaded: torch-fidelity's constructor is given an empty state dict, loaded non-strictly."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class _Unloaded(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return super().load_state_dict(state_dict, strict=False, assign=assign)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    empty = path.with_name(f".{path.name}.empty")
    torch.save({}, empty)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = _Unloaded("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(empty))
    finally:
        empty.unlink(missing_ok=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    torch.save(net.state_dict(), path)
    return path


class ClipExtractor(FeatureExtractor):
    """FD_CLIP: transformers `CLIPModel.get_image_features` (the projected image embedding, not L2-normalised) from a
    local save_pretrained directory, preprocessed on tensors like the CLIP rewards (difrl.rewards.vision: shortest
    side bicubic with antialias, centre crop, the processor's mean/std). The processor settings come from
    `processor_dir` (or `model_dir`) when it holds preprocessor_config.json, else CLIP's recipe at the model's
    image size with OpenAI's mean/std. Only the vision tower is kept."""

    metric = "fd_clip"

    def __init__(self, model_dir, processor_dir=None, device="cpu", option: str = "model_dir"):
        super().__init__()
        who = "ClipExtractor"
        from transformers import CLIPImageProcessor, CLIPModel

        from difrl.rewards.vision import OPENAI_MEAN, OPENAI_STD, hf_image_settings

        mdir = _local_dir(model_dir, "the CLIP model", who, option, model_type="clip")
        pdir = None
        if processor_dir not in (None, ""):
            pdir = Path(processor_dir).expanduser()
            if not (pdir / "preprocessor_config.json").is_file():
                raise EvalConfigError(f"{who}: no preprocessor_config.json in {str(pdir)!r} (processor_dir)")
        elif (mdir / "preprocessor_config.json").is_file():
            pdir = mdir
        model = CLIPModel.from_pretrained(str(mdir), local_files_only=True)
        model.text_model = model.text_projection = None  # get_image_features reads the vision tower only
        self.model = model.eval().requires_grad_(False)
        if pdir is not None:
            self.settings = hf_image_settings(CLIPImageProcessor.from_pretrained(str(pdir), local_files_only=True))
        else:
            s = int(model.config.vision_config.image_size)
            self.settings = {"size": s, "crop": (s, s), "mean": OPENAI_MEAN, "std": OPENAI_STD}
        self.weights_sha256 = _sha256_paths(_hf_weight_files(mdir, *([pdir] if pdir is not None else [])))
        self.num_features = int(model.config.projection_dim)
        crop = self.settings["crop"]
        self.resize_mode = (f"uint8-round+bicubic-antialias-short{self.settings['size']}"
                            + (f"-crop{crop[0]}x{crop[1]}" if crop else "")
                            + ("" if tuple(self.settings["mean"]) == OPENAI_MEAN else "-custom-mean-std"))
        self.name = f"hf-clip[{mdir.name}]-image-embeds-{self.num_features}d[{self.resize_mode}]"
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from difrl.rewards.vision import feature_tensor, preprocess_clip

        x = to_uint8(images).float() / 255  # [B, 3, H, W] in [0, 1] on the PNG grid
        x = preprocess_clip(x.to(self.device), self.settings)  # [B, 3, crop_h, crop_w], normalised
        return feature_tensor(self.model.get_image_features(pixel_values=x)).float()  # [B, projection_dim]


def _hub_pos_encoding(emb: nn.Module) -> Callable:
    """facebookresearch/dinov2's `DinoVisionTransformer.interpolate_pos_encoding` (`dinov2/models/vision_transformer.py`,
    interpolate_offset=0.1, no antialias: the hub models' defaults) for a transformers `Dinov2Embeddings`:
    bicubic with scale factor (grid + 0.1) / M. transformers' own version resizes to the target size instead, which
    samples the embedding grid at slightly different points; FD_DINOv2 references (EDM2, dgm-eval) run the hub model."""
    def interpolate_pos_encoding(embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        pos = emb.position_embeddings  # [1, 1 + M*M, D]
        n_patch, n_pos = embeddings.shape[1] - 1, pos.shape[1] - 1
        if n_patch == n_pos and height == width:
            return pos
        ps = emb.patch_size if isinstance(emb.patch_size, int) else emb.patch_size[0]
        m, dim = int(math.sqrt(n_pos)), pos.shape[-1]
        h0, w0 = height // ps + 0.1, width // ps + 0.1
        grid = pos[:, 1:].float().reshape(1, m, m, dim).permute(0, 3, 1, 2)  # [1, D, M, M]
        grid = F.interpolate(grid, scale_factor=(h0 / m, w0 / m), mode="bicubic")  # [1, D, h, w]
        if grid.shape[-2:] != (int(h0), int(w0)):
            raise RuntimeError(f"DINOv2 position grid resized to {tuple(grid.shape[-2:])}, expected {(int(h0), int(w0))}")
        grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pos.dtype)
        return torch.cat((pos[:, :1], grid), dim=1)

    return interpolate_pos_encoding


class DinoV2Extractor(FeatureExtractor):
    """FD_DINOv2 (Stein et al. 2023, "Exposing flaws of generative model evaluation metrics"; EDM2's `fd_dinov2`):
    transformers `Dinov2Model` from a local save_pretrained directory (e.g. facebook/dinov2-large), the CLS token
    after the final layer norm (`pooler_output`, the hub model's `x_norm_clstoken`).

    Preprocessing (uint8 images -> float 0..255 -> resize to image_size x image_size -> /255 -> ImageNet mean/std):
    resize="bicubic-antialias" is EDM2's / dgm-eval's fast path (torch bicubic with antialias, no crop);
    "tf1-bilinear" is torch-fidelity's DINOv2 extractor. pos_interp="hub" interpolates the position embeddings like
    the torch.hub model those references run (see `_hub_pos_encoding`); "transformers" keeps transformers' own.
    torch-fidelity's DINOv2 extractor itself cannot load local weights (NotImplementedError), hence this class."""

    metric = "fd_dinov2"

    def __init__(self, model_dir, image_size: int = 224, resize: str = "bicubic-antialias", pos_interp: str = "hub",
                 device="cpu", option: str = "model_dir"):
        super().__init__()
        who = "DinoV2Extractor"
        if resize not in ("bicubic-antialias", "tf1-bilinear"):
            raise EvalConfigError(f"{who}: resize must be 'bicubic-antialias' or 'tf1-bilinear', got {resize!r}")
        if pos_interp not in ("hub", "transformers"):
            raise EvalConfigError(f"{who}: pos_interp must be 'hub' or 'transformers', got {pos_interp!r}")
        from transformers import Dinov2Model

        mdir = _local_dir(model_dir, "the DINOv2 model", who, option, model_type="dinov2")
        self.model = Dinov2Model.from_pretrained(str(mdir), local_files_only=True).eval().requires_grad_(False)
        if pos_interp == "hub":
            self.model.embeddings.interpolate_pos_encoding = _hub_pos_encoding(self.model.embeddings)
        if resize == "tf1-bilinear":
            self._tf1 = _optional_import("torch_fidelity.interpolate_compat_tensorflow", who)
        self.image_size, self.resize = int(image_size), resize
        self.weights_sha256 = _sha256_paths(_hf_weight_files(mdir))
        self.num_features = int(self.model.config.hidden_size)
        self.resize_mode = f"uint8-round+{resize}-{self.image_size}+imagenet-norm+pos-{pos_interp}"
        self.name = f"hf-dinov2[{mdir.name}]-cls-{self.num_features}d[{self.resize_mode}]"
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_uint8(images).to(self.device).float()  # [B, 3, H, W] in 0..255
        size = (self.image_size, self.image_size)
        if self.resize == "bicubic-antialias":
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
        else:
            x = self._tf1.interpolate_bilinear_2d_like_tensorflow1x(x, size=size, align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        x = (x / 255 - mean) / std  # [B, 3, S, S]
        return self.model(pixel_values=x).pooler_output.float()  # [B, hidden_size]


class ModuleExtractor(FeatureExtractor):
    """Any nn.Module as a feature extractor (the worlds' classifiers): `method` names the module's function that maps
    a batch to [B, D] features ("forward", or e.g. "features" for difrl.rewards.digits.DigitClassifier's 64-d
    penultimate layer), or is a callable(module, images). Input is passed as it comes (no quantisation, no resize:
    `resize_mode` says what the caller does). `weights_sha256` defaults to the hash of the module's state dict.
    Give `num_features` to pass it to torchmetrics (which otherwise probes the module with a 299 x 299 image)."""

    def __init__(self, module: nn.Module, name: str, method: str | Callable = "forward", metric: str = "fd",
                 weights_sha256: str | None = None, resize_mode: str = "none", num_features: int | None = None):
        super().__init__()
        self.module = module.eval().requires_grad_(False)
        self.method, self.name, self.metric, self.resize_mode = method, str(name), str(metric), str(resize_mode)
        self.weights_sha256 = weights_sha256 or state_dict_sha256(module)
        self.num_features = int(num_features) if num_features else 0  # 0: set by the first batch

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        fn = (lambda x: self.method(self.module, x)) if callable(self.method) else getattr(self.module, self.method)
        out = fn(images).float()
        out = out.reshape(out.shape[0], -1)
        if not self.num_features:
            self.num_features = int(out.shape[1])
        return out


# --- running extractors, reference statistics -----------------------------------------------------------------

def _batches(images, batch_size: int) -> Iterable[torch.Tensor]:
    """A tensor [N, ...] in chunks, or an iterable of batches (tensors, (images, labels) pairs, or dicts with
    "images"), or a callable returning such an iterable (called only when the images are needed)."""
    if callable(images) and not torch.is_tensor(images):
        images = images()
    if torch.is_tensor(images):
        for i in range(0, images.shape[0], batch_size):
            yield images[i:i + batch_size]
        return
    for b in images:
        if isinstance(b, dict):
            b = b["images"]
        elif isinstance(b, (tuple, list)):
            b = b[0]
        b = torch.as_tensor(b)
        for i in range(0, b.shape[0], batch_size):
            yield b[i:i + batch_size]


@torch.no_grad()
def extract_features(extractor: nn.Module, images, batch_size: int = 64) -> torch.Tensor:
    """Run `extractor` over `images` (see `_batches`) in chunks of `batch_size` on its device: [N, D] float32 CPU."""
    dev = extractor.device if isinstance(extractor, FeatureExtractor) else torch.device("cpu")
    out = [extractor(b.to(dev)).float().cpu() for b in _batches(images, int(batch_size))]
    if not out:
        raise ValueError("no images to extract features from")
    return torch.cat(out)


def _slug(s: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(s)).strip("-")[:limit] or "x"


def _resolution_str(resolution) -> str:
    if isinstance(resolution, (tuple, list)):
        return "x".join(str(int(r)) for r in resolution)
    return str(int(resolution))


def _difrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("difrl")
    except PackageNotFoundError:
        return ""


def reference_stats_path(cache_dir, extractor: FeatureExtractor, dataset_name: str, resolution) -> Path:
    """`<cache_dir>/<dataset>-<res>px-<metric>-<key hash>.npz`, the key being (dataset, extractor name, weights
    sha256, resolution): another extractor, other weights or another resize convention never hit this file."""
    key = json.dumps({"dataset": str(dataset_name), "extractor": extractor.name,
                      "weights_sha256": extractor.weights_sha256, "resolution": _resolution_str(resolution)},
                     sort_keys=True)
    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / (f"{_slug(dataset_name)}-{_resolution_str(resolution)}px-"
                                           f"{_slug(extractor.metric)}-{h}.npz")


def reference_stats(extractor: FeatureExtractor, images, cache_dir, dataset_name: str, resolution,
                    batch_size: int = 64, keep_features: bool = False, extra_provenance: dict | None = None,
                    recompute: bool = False) -> FeatureStats:
    """The reference set's FeatureStats, computed once and cached under `cache_dir` (see `reference_stats_path`).

    `images`: a tensor [N, 3, H, W], an iterable of batches, or a callable returning one (only consumed on a cache
    miss). `keep_features=True` also stores the float32 features (KID needs them; 50k x 2048 is 410 MB). A cached
    file whose provenance disagrees with the requested key raises (it was edited or collided); `recompute=True`
    overwrites it. The returned stats carry the attributes `cache_file` and `cache_hit` (not saved)."""
    path = reference_stats_path(cache_dir, extractor, dataset_name, resolution)
    expect = {"dataset": str(dataset_name), "resolution": _resolution_str(resolution), "extractor": extractor.name,
              "weights_sha256": extractor.weights_sha256}
    if path.is_file() and not recompute:
        st = FeatureStats.load(path)
        got = {k: st.provenance.get(k) for k in expect}
        if got != expect:
            raise ValueError(f"cached reference statistics {str(path)!r} were made for {got}, not {expect}; delete "
                             "the file or pass recompute=True")
        if st.dim != extractor.num_features and extractor.num_features:
            raise ValueError(f"cached reference statistics {str(path)!r} are {st.dim}-d, the extractor makes "
                             f"{extractor.num_features}-d features")
        if not keep_features or st.features is not None:
            st.cache_hit, st.cache_file = True, str(path)
            return st
    if keep_features:
        feats = extract_features(extractor, images, batch_size)
        st = stats_of(feats, keep_features=True)
    else:
        acc = StatsAccumulator()
        dev = extractor.device
        with torch.no_grad():
            for b in _batches(images, int(batch_size)):
                acc.add(extractor(b.to(dev)).float())
        st = acc.stats()
    st.provenance = {**expect, "format": STATS_FORMAT, "metric": extractor.metric, "resize_mode": extractor.resize_mode,
                     "dim": st.dim, "n": st.n, "features_kept": bool(keep_features),
                     "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "difrl_version": _difrl_version(), "torch_version": torch.__version__,
                     **({"extra": dict(extra_provenance)} if extra_provenance else {})}
    st.save(path)
    st.cache_hit, st.cache_file = False, str(path)
    return st


def fid_report(gen, ref, extractor: FeatureExtractor | None = None, kid_subsets: int = 100,
               kid_subset_size: int = 1000, seed: int = 0) -> dict:
    """The Fréchet distance between generated and reference features, with its provenance.

    gen: [N, D] features or FeatureStats; ref: FeatureStats (e.g. from `reference_stats`) or [M, D] features.
    KID is added when raw features exist on both sides (`kid(ref, gen)`, so the subsets are torchmetrics' with
    real = ref), with subset_size min(kid_subset_size, n_gen, n_ref) reported as `kid_subset_size`.
    When `ref` has provenance from `reference_stats` and `extractor` is given, their extractor name and weights hash
    must agree (a distance between two feature spaces is meaningless). Keys: metric, fd, [kid_mean, kid_std,
    kid_subsets, kid_subset_size], extractor, weights_sha256, resize_mode, dim, n_gen, n_ref, ref_stats_sha256."""
    gen_feats = None if isinstance(gen, FeatureStats) else torch.as_tensor(gen)
    ref_feats = None if isinstance(ref, FeatureStats) else torch.as_tensor(ref)
    gs = gen if isinstance(gen, FeatureStats) else stats_of(gen_feats)
    rs = ref if isinstance(ref, FeatureStats) else stats_of(ref_feats)
    if gen_feats is None and gs.features is not None:
        gen_feats = torch.from_numpy(gs.features)
    if ref_feats is None and rs.features is not None:
        ref_feats = torch.from_numpy(rs.features)
    if gs.dim != rs.dim:
        raise ValueError(f"generated features are {gs.dim}-d, reference features {rs.dim}-d")
    prov = rs.provenance or {}
    if extractor is not None:
        for k, mine in (("extractor", extractor.name), ("weights_sha256", extractor.weights_sha256)):
            if prov.get(k) not in (None, mine):
                raise ValueError(f"reference statistics were made with {k}={prov[k]!r}, the generated features with "
                                 f"{mine!r}: the distance would compare two feature spaces")
        meta = extractor.info()
    else:
        meta = {"extractor": prov.get("extractor", "unknown"), "metric": prov.get("metric", "fd"),
                "weights_sha256": prov.get("weights_sha256", ""), "resize_mode": prov.get("resize_mode", "unknown")}
    out = {"metric": meta["metric"], "fd": frechet_distance_from_stats(gs, rs)}
    if gen_feats is not None and ref_feats is not None:
        m = min(int(kid_subset_size), gs.n, rs.n)
        out["kid_mean"], out["kid_std"] = kid(ref_feats, gen_feats, subsets=kid_subsets, subset_size=m, seed=seed)
        out["kid_subsets"], out["kid_subset_size"] = int(kid_subsets), m
    out.update({"extractor": meta["extractor"], "weights_sha256": meta["weights_sha256"],
                "resize_mode": meta["resize_mode"], "dim": gs.dim, "n_gen": gs.n, "n_ref": rs.n,
                "ref_stats_sha256": rs.sha256})
    return out
