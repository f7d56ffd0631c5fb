"""Reference statistics of a feature set, cached on disk, and the FD / KID report against them.

    ref = reference_stats(ext, real_images, cache_dir="~/.cache/difrl/fid", dataset_name="coco30k", resolution=512)
    gen = extract_features(ext, generated_images)                  # difrl.eval.extractors: [N, D] float32 on the CPU
    report = fid_report(gen, ref, ext)    # {"fd", "kid_mean", "kid_std", "extractor", "weights_sha256", "resize_mode",
                                          #  "n_gen", "n_ref", "ref_stats_sha256", ...}
    st = stats_of(feats); st.save("ref.npz"); FeatureStats.load("ref.npz")

Reference statistics are computed once per (dataset, extractor name + weights hash, resolution) and cached as a
float64 `.npz` (mu, sigma, n, JSON provenance; `FeatureStats.sha256` identifies the numbers), written atomically.
The distances themselves are difrl.eval.fd's; the extractors (and what their names and hashes mean) are
difrl.eval.extractors'.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from difrl.eval.extractors import EvalConfigError, FeatureExtractor, extract_features, iter_batches
from difrl.eval.fd import frechet_distance_from_stats, kid
from difrl.utils.io import atomic_write_npz

STATS_FORMAT = "difrl-feature-stats-v1"


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
        arrays = {"format": np.array(STATS_FORMAT), "mu": self.mu, "sigma": self.sigma, "n": np.int64(self.n),
                  "provenance": np.array(json.dumps(self.provenance, sort_keys=True, default=str))}
        if self.features is not None:
            arrays["features"] = self.features
        atomic_write_npz(path, **arrays)
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



# --- reference statistics and the report ------------------------------------------------------------------

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
            for b in iter_batches(images, int(batch_size)):
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
