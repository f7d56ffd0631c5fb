"""Fréchet distance and KID from features or Gaussian statistics (the math of FID, FD_DINOv2, FD_CLIP, the worlds' FD).

    fd = frechet_distance_from_stats(gen_stats, ref_stats)        # FeatureStats or (mu [D], sigma [D, D]) pairs
    kid_mean, kid_std = kid(real_feats, fake_feats, subsets=100, subset_size=1000, seed=0)   # [N, D], [M, D]

What the numbers are (docs/reference/specs/rewards-eval.md §3.1):
- `frechet_distance_from_stats` is difrl.eval.metrics' Fréchet distance (float64, symmetric eigendecompositions:
  tr sqrt(S_a^1/2 S_b S_a^1/2) instead of scipy.linalg.sqrtm(S_a S_b)); on stats from
  `difrl.eval.reference.stats_of` it returns the very bits of `metrics.frechet_distance(a, b)`.
- `kid` is the unbiased MMD^2 with the cubic polynomial kernel (Binkowski et al. 2018, "Demystifying MMD GANs",
  arXiv:1801.01401), mean and population std over random subsets, with torchmetrics' `KernelInceptionDistance`
  defaults (100 subsets of 1000, degree 3, gamma 1/D, coef 1) and the same subsets for the same seed.
"""

from __future__ import annotations

import numpy as np
import torch

from difrl.eval.metrics import frechet_distance_gaussians


def _as_mu_sigma(s) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu [D], sigma [D, D]) float64 tensors of a FeatureStats (anything with `as_tensors`) or a (mu, sigma) pair."""
    if hasattr(s, "as_tensors"):
        return s.as_tensors()
    mu, sigma = s
    return torch.as_tensor(np.asarray(mu), dtype=torch.float64), torch.as_tensor(np.asarray(sigma), dtype=torch.float64)


def frechet_distance_from_stats(a, b) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) for two FeatureStats (or (mu, sigma) pairs),
    in float64: difrl.eval.metrics.frechet_distance_gaussians, whose two square roots are symmetric
    eigendecompositions with negative round-off eigenvalues clamped to 0 (`sqrt_psd`), never a complex
    scipy.linalg.sqrtm."""
    mu_a, cov_a = _as_mu_sigma(a)
    mu_b, cov_b = _as_mu_sigma(b)
    if mu_a.shape != mu_b.shape:
        raise ValueError(f"feature dimensions differ: {mu_a.shape[0]} vs {mu_b.shape[0]}")
    return frechet_distance_gaussians(mu_a, cov_a, mu_b, cov_b)


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
