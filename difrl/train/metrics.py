"""One iteration's update metrics, summed where the values live and read once (the trainers' Metrics).

    m = Metrics(num_steps)                       # per-step ratio statistics too when num_steps is given
    m.add("policy_loss", per_transition_loss, mask)
    m.add_ratio(ratio, steps, mask)
    row = m.result(accelerator)                  # means over all micro-steps and processes
"""

from __future__ import annotations

import math

import torch

from difrl.utils.collectives import reduce


class Metrics:
    """Means over one iteration's micro-steps (all processes together), plus per-step ratio mean/std
    when constructed with the number of steps.

    Sums stay tensors on the values' device until `result`: on a GPU a float() or a boolean index per metric and
    micro-step would each be a host sync. On the CPU the masked values are selected first and summed in fp64
    exactly as before (summation order, hence the logged bits, unchanged)."""

    def __init__(self, num_steps: int | None = None):
        self.num_steps = num_steps
        self.sums: dict[str, torch.Tensor] = {}  # name -> fp64 scalar on the values' device
        self.counts: dict[str, torch.Tensor | int] = {}
        self.per_step: dict[str, torch.Tensor] = {}  # name -> [sum, sum of squares, count] x steps

    @staticmethod
    def on_host(t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def add(self, name: str, value: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        v = value.detach().double()
        if mask is None:
            total, count = v.sum(), v.numel()
        elif self.on_host(v):
            v = v[mask]
            total, count = v.sum(), v.numel()
        else:  # masked sum without a data-dependent shape (no sync)
            keep = mask.to(v.device).expand_as(v)
            total, count = torch.where(keep, v, 0.0).sum(), keep.sum()
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.counts[name] = self.counts.get(name, 0) + count

    def add_ratio(self, ratio: torch.Tensor, steps: torch.Tensor, mask: torch.Tensor, name: str = "ratio_per_step") -> None:
        r = ratio.detach().double()
        acc = self.per_step.setdefault(name, torch.zeros(3, self.num_steps, dtype=torch.float64, device=r.device))
        if self.on_host(r):
            r, j, w = r[mask], steps[mask], None
        else:
            w = mask.to(r.device).double().flatten()
            r, j = r.flatten() * w, steps.to(r.device).flatten()
        acc[0].index_add_(0, j, r)
        acc[1].index_add_(0, j, r**2)
        acc[2].index_add_(0, j, torch.ones_like(r) if w is None else w)

    def result(self, accelerator=None) -> dict:
        """Means over the micro-steps (and processes). The sums and counts are packed where they live and read
        to the host once (a read per metric would be a sync each on a GPU)."""
        names = sorted(self.sums)  # every process logs the same names
        dev = next((v.device for v in (*self.sums.values(), *self.per_step.values())), torch.device("cpu"))
        counts = torch.tensor([0.0 if torch.is_tensor(self.counts[k]) else float(self.counts[k]) for k in names],
                              dtype=torch.float64).to(dev, non_blocking=True)
        for i, k in enumerate(names):
            if torch.is_tensor(self.counts[k]):  # a masked count still on the device: written there, no sync
                counts[i] = self.counts[k]
        sums = (torch.stack([self.sums[k].to(dev, non_blocking=True) for k in names]) if names
                else torch.zeros(0, dtype=torch.float64, device=dev))
        packed, per_step = torch.stack([sums, counts]), dict(sorted(self.per_step.items()))
        if accelerator is not None:  # summed over processes (on the accelerator's device: NCCL takes no host tensor)
            packed = reduce(accelerator, packed)
            per_step = {k: reduce(accelerator, v) for k, v in per_step.items()}
        packed, per_step = packed.cpu(), {k: v.cpu() for k, v in per_step.items()}
        out = {k: float(packed[0, i] / max(packed[1, i], 1.0)) for i, k in enumerate(names)}
        for name, acc in per_step.items():
            steps = {}
            for j in (acc[2] > 0).nonzero().flatten().tolist():
                s, sq, n = acc[:, j].tolist()
                mean = s / n
                steps[str(j)] = [mean, math.sqrt(max(sq / n - mean**2, 0.0))]
            out[name] = steps
        if self.num_steps is not None:
            out.setdefault("ratio_per_step", {})
        return out


def pooled_std(per_step: dict) -> float:
    """The std of all ratios from per-step [mean, std] pairs (equal counts per step)."""
    if not per_step:
        return 0.0
    means = [v[0] for v in per_step.values()]
    sq = [v[1] ** 2 + v[0] ** 2 for v in per_step.values()]
    mu = sum(means) / len(means)
    return math.sqrt(max(sum(sq) / len(sq) - mu**2, 0.0))
