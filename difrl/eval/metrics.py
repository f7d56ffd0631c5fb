"""Distribution metrics: Fréchet distance on named features, within-class diversity.

    fd = frechet_distance(feats_gen, feats_real)                 # [N, D], [M, D] -> float
    div = within_class_diversity(images, labels)                 # mean pairwise L2 within each class

The Fréchet distance ||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) is computed
in float64 with symmetric eigendecompositions (no scipy.linalg.sqrtm, which returns complex
noise on near-singular covariances). The number is only comparable between runs that use the
same feature extractor; every caller reports the extractor's name next to it.
"""

from __future__ import annotations

import torch


def sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    """The symmetric PSD square root of a symmetric [D, D] matrix by eigendecomposition, negative round-off
    eigenvalues clamped to 0 (real, unlike scipy.linalg.sqrtm on a near-singular covariance)."""
    w, v = torch.linalg.eigh((m + m.T) / 2)
    return (v * w.clamp_min(0).sqrt()) @ v.T


def frechet_distance_gaussians(mu_a: torch.Tensor, cov_a: torch.Tensor, mu_b: torch.Tensor,
                               cov_b: torch.Tensor) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) for means [D] and covariances [D, D] (float64
    in, float out). (S_a^1/2 S_b S_a^1/2)^1/2 has the trace of (S_a S_b)^1/2 (similar matrices), the form of
    Heusel et al. 2017 and pytorch-fid."""
    sa = sqrt_psd(cov_a)
    cross = sqrt_psd(sa @ cov_b @ sa)
    return float(((mu_a - mu_b) ** 2).sum() + torch.trace(cov_a) + torch.trace(cov_b) - 2 * torch.trace(cross))


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a [N, D] and b [M, D]."""
    a, b = a.double(), b.double()
    return frechet_distance_gaussians(a.mean(0), torch.cov(a.T), b.mean(0), torch.cov(b.T))


def within_class_diversity(x: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over classes of the mean pairwise L2 distance between distinct members ([N, ...] flattened)."""
    x = x.flatten(1).double()
    per_class = []
    for c in labels.unique():
        xc = x[labels == c]
        n = xc.shape[0]
        if n < 2:
            continue
        d = torch.cdist(xc, xc)
        per_class.append(d.sum() / (n * (n - 1)))
    return float(torch.stack(per_class).mean()) if per_class else float("nan")


def change_over_noise(before: dict, after: dict, key: str = "reward") -> dict | None:
    """after - before of an evaluation mean with its sampling noise, for a run's summary.

    Each evaluation reports `<key>` (a mean over n fixed-seed samples) and `<key>_sem` (the samples'
    std / sqrt(n)); noise = sqrt(sem_before^2 + sem_after^2) is the standard error of the difference
    if the two evaluations' samples were independent (they share seeds, so it overstates the noise of
    a paired difference: a conservative yardstick). None when either evaluation lacks the sem."""
    if f"{key}_sem" not in before or f"{key}_sem" not in after:
        return None
    delta = float(after[key]) - float(before[key])
    noise = (float(before[f"{key}_sem"]) ** 2 + float(after[f"{key}_sem"]) ** 2) ** 0.5
    return {"key": key, "before": float(before[key]), "after": float(after[key]), "delta": delta, "noise": noise,
            "delta_over_noise": delta / noise if noise > 0 else None}
