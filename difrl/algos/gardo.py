"""GARDO's pieces (arXiv 2512.24138; reference tinnerhrhe/GARDO; docs/guides/methods.md "GARDO"): which samples get the KL,
how many, and the diversity-shaped advantages.

    u = proxy_uncertainty(proxy, [aux_1, aux_2])            # [N] win-rate gap: proxy's rank above the auxiliaries'
    flags = gate(u, frac=0.1)                               # [N] bool: the top `frac` of the positive gaps
    ctl = FracController(0.1); frac = ctl.update(u)         # the fraction adapts to the batch's uncertainty
    w = diversity_weights(features, group_ids)              # [N] nearest-neighbour cosine distance / its group mean
    adv = diversity_shaped(adv, w)                          # A >= 0: A * w; A < 0: unchanged

A sample's win rate under a reward is the fraction of the other N - 1 samples of the batch it scores above (ties
count 1/2). The uncertainty of the proxy on sample i is u_i = win_proxy(i) - mean_k win_aux_k(i): high when the
trained reward ranks it well above where the auxiliary rewards do, the pattern of reward hacking.
"""

from __future__ import annotations

import torch


def batch_win_rates(r: torch.Tensor) -> torch.Tensor:
    """[N] -> [N] float64: fraction of the other samples with a lower reward (ties 1/2); 1/2 for N = 1."""
    r = r.double()
    n = len(r)
    if n < 2:
        return torch.full((n,), 0.5, dtype=torch.float64)
    below = (r[:, None] > r[None, :]).double().sum(1)
    ties = (r[:, None] == r[None, :]).double().sum(1) - 1.0
    return (below + 0.5 * ties) / (n - 1)


def proxy_uncertainty(proxy: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    """u [N] float64 = win rate under the proxy minus the mean win rate under the auxiliary rewards (>= 1 of them)."""
    if not aux:
        raise ValueError("proxy_uncertainty needs at least one auxiliary reward")
    return batch_win_rates(proxy) - torch.stack([batch_win_rates(a) for a in aux]).mean(0)


def gate(u: torch.Tensor, frac: float) -> torch.Tensor:
    """[N] bool: the samples whose uncertainty is above the (1 - frac) quantile of the non-negative ones (the
    reference's percentile rule, strict >), so about `frac` of the samples the proxy overrates get the KL."""
    pos = u[u >= 0]
    if len(pos) == 0:
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = torch.quantile(pos.double(), 1.0 - frac)
    return u > threshold


class FracController:
    """The flagged fraction: starts at `base`; after each batch it grows by (1 + rate) when the batch's mean
    non-negative uncertainty is above every one of the last `window` batches', shrinks by (1 - rate) when below
    every one, and is kept in [lo, hi]. `state()` / `load()`: what a checkpoint keeps."""

    def __init__(self, base: float = 0.1, lo: float = 0.02, hi: float = 0.2, rate: float = 0.1, window: int = 20):
        self.base, self.lo, self.hi, self.rate, self.window = base, lo, hi, rate, window
        self.frac, self.history = base, []

    def update(self, u: torch.Tensor) -> float:
        pos = u[u >= 0]
        level = float(pos.mean()) if len(pos) else 0.0
        if self.history and level > max(self.history):
            self.frac *= 1.0 + self.rate
        elif self.history and level < min(self.history):
            self.frac *= 1.0 - self.rate
        self.frac = min(max(self.frac, self.lo), self.hi)
        self.history = (self.history + [level])[-self.window:]
        return self.frac

    def state(self) -> dict:
        return {"frac": self.frac, "history": list(self.history)}

    def load(self, state: dict | None) -> None:
        if state:
            self.frac, self.history = float(state["frac"]), [float(h) for h in state["history"]]


def diversity_weights(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N, D] features, [N] group ids -> [N] float32: each sample's cosine distance to its nearest other group member,
    divided by its group's mean distance (1 where the group's distances are all 0, or the group has one member). A
    duplicate of another member has distance 0, so weight 0."""
    f = torch.nn.functional.normalize(features.double().flatten(1), dim=-1)
    dist = 1.0 - (f @ f.T).clamp(-1.0, 1.0)  # [N, N]
    same = group_ids[:, None] == group_ids[None, :]
    own = torch.eye(len(f), dtype=torch.bool)
    nearest = dist.masked_fill(~same | own, float("inf")).amin(1)  # [N]; inf: a group of one
    nearest = torch.where(torch.isfinite(nearest), nearest, torch.ones_like(nearest)).clamp_min(0.0)
    _, inv = torch.unique(group_ids, return_inverse=True)
    total = torch.zeros(int(inv.max()) + 1 if len(inv) else 0, dtype=torch.float64).index_add_(0, inv, nearest)
    count = torch.zeros_like(total).index_add_(0, inv, torch.ones_like(nearest))
    mean = (total / count)[inv]
    return torch.where(mean > 0, nearest / mean.clamp_min(1e-12), torch.ones_like(nearest)).float()


def diversity_shaped(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """GARDO's multiplicative shaping: A_i w_i where A_i >= 0 (a good sample counts more the more it differs from its
    group), A_i where A_i < 0 (a bad one is not excused for being different)."""
    return torch.where(advantages >= 0, advantages * weights, advantages)
