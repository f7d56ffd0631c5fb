"""Sigma schedules and step masks.

    sigmas = sigma_schedule(10, shift=3.0)           # [11], 1 -> 0
    mask = all_but_last(10)                          # [10] bool: which steps are SDE and trained

A schedule holds N+1 sigmas from 1 to 0 (diffusers' ``linspace(1, 1/N, N)`` plus the appended
terminal 0 is the same grid). A step mask says which of the N transitions are stochastic and
trained; every other step is a deterministic ODE step (flow-grpo-family.md §8.2). Masks are
functions of explicit integers and generators, so a run's masks are reproducible from
(seed, iteration) with no hidden state to save on resume.
"""

from __future__ import annotations

import math

import torch


def time_shift(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 / Wan static shift: sigma' = s sigma / (1 + (s - 1) sigma)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def exponential_time_shift(sigma: torch.Tensor, mu: float) -> torch.Tensor:
    """FLUX dynamic shift (diffusers' `time_shift_type="exponential"`): e^mu / (e^mu + 1/sigma - 1)."""
    out = torch.zeros_like(sigma)
    pos = sigma > 0
    out[pos] = math.exp(mu) / (math.exp(mu) + (1.0 / sigma[pos] - 1.0))
    return out


def sigma_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """[num_steps + 1] fp32 sigmas, 1 -> 0, uniform in t then shifted."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return time_shift(t, shift).to(torch.float32)


# ---- step masks: [N] bool (or [B, N] for per-sample subsets) ------------------------------------

def all_but_last(num_steps: int) -> torch.Tensor:
    """Flow-GRPO: every step stochastic and trained except the last (its CPS std is 0 and its
    Flow-SDE noise stays in the image)."""
    mask = torch.ones(num_steps, dtype=torch.bool)
    mask[-1] = num_steps == 1
    return mask


def fixed_window(num_steps: int, start: int, size: int) -> torch.Tensor:
    """Steps [start, start + size) are SDE and trained."""
    if start < 0 or size < 1 or start + size > num_steps:
        raise ValueError(f"window [{start}, {start + size}) does not fit in {num_steps} steps")
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:start + size] = True
    return mask


def random_window(num_steps: int, size: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """Flow-GRPO-Fast: the window start is uniform in [low, high - size] (window inside [low, high))."""
    if not (0 <= low and low + size <= high <= num_steps):
        raise ValueError(f"window of {size} does not fit in range [{low}, {high}) of {num_steps} steps")
    start = int(torch.randint(low, high - size + 1, (1,), generator=generator))
    return fixed_window(num_steps, start, size)


def sliding_window_start(iteration: int, size: int, num_steps: int, advance_every: int, stride: int = 1,
                         first: int = 0, roll_back: bool = True) -> int:
    """MixGRPO progressive window (spec §4.1): the start advances by `stride` every `advance_every`
    iterations, from high noise towards low noise; past the last start that still excludes the
    final step (num_steps - 1 - size) it rolls back to `first` (or stays there if not roll_back)."""
    last = num_steps - 1 - size
    if last < first:
        raise ValueError(f"a window of {size} steps starting at {first} does not fit in {num_steps - 1} trainable steps")
    moves = (iteration // advance_every) * stride
    if roll_back:
        return first + moves % (last - first + 1)
    return min(first + moves, last)


def random_subset(batch: int, num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """DanceGRPO: per sample, an independent random floor(fraction * (N - 1)) of the first N - 1 steps.
    Returns [B, N] bool (all steps are SDE; the mask says which are trained)."""
    k = max(1, int(math.floor(fraction * (num_steps - 1))))
    scores = torch.rand(batch, num_steps - 1, generator=generator)
    picked = scores.argsort(dim=1)[:, :k]
    mask = torch.zeros(batch, num_steps, dtype=torch.bool)
    mask.scatter_(1, picked, True)
    return mask
