"""Sigma schedules and step masks.

    sigmas = sigma_schedule(10, shift=3.0)           # [11], 1 -> 0
    mask = all_but_last(10)                          # [10] bool: which steps are SDE and trained
    sde, train, start = step_masks(cfg.steps, 10, seed, iteration, batch)   # one iteration's masks, any mode

A schedule holds N+1 sigmas from 1 to 0 (diffusers' ``linspace(1, 1/N, N)`` plus the appended
terminal 0 is the same grid). A step mask says which of the N transitions are stochastic and
trained; every other step is a deterministic ODE step (docs/reference/specs/flow-grpo-family.md §8.2). Masks are
functions of explicit integers and generators, so a run's masks are reproducible from
(seed, iteration) with no hidden state to save on resume.
"""

from __future__ import annotations

import math

import torch

from difrl.utils.rng import mix_seed


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
    """MixGRPO progressive window (docs/reference/specs/flow-grpo-family.md §4.1): the start advances by `stride` every
    `advance_every` iterations, from high noise towards low noise; past the last start that still excludes the
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


def step_masks(steps, num_steps: int, seed: int, iteration: int, num_samples: int
               ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(sde_mask [N], train_mask [B, N], window start or None) of one iteration: which steps are stochastic and
    which transitions are trained, a pure function of (seed, iteration). `steps`: the config's steps section
    (mode all_but_last = Flow-GRPO, fixed_window, random_window = Flow-GRPO-Fast, sliding_window = MixGRPO,
    random_subset = DanceGRPO; window_size, window_start, window_range, advance_every, stride, roll_back,
    fraction)."""
    n, s = num_steps, steps
    gen = torch.Generator().manual_seed(mix_seed(seed, iteration, 2))
    if s.mode == "all_but_last":
        m = all_but_last(n)
        return m, m.expand(num_samples, n), None
    if s.mode == "random_subset":  # DanceGRPO: every step SDE, a random subset per sample trained
        return torch.ones(n, dtype=torch.bool), random_subset(num_samples, n, s.fraction, gen), None
    if s.mode == "fixed_window":
        start = s.window_start
    elif s.mode == "random_window":
        lo, hi = s.window_range or (0, max(s.window_size, n // 2))
        m = random_window(n, s.window_size, lo, hi, gen)
        start = int(m.nonzero()[0])
    else:  # sliding_window (MixGRPO progressive)
        start = sliding_window_start(iteration, s.window_size, n, s.advance_every, s.stride, s.window_start, s.roll_back)
    m = fixed_window(n, start, s.window_size)
    return m, m.expand(num_samples, n), start
