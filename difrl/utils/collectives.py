"""Collectives over the processes of a run, with their tensors on the accelerator's device: the one way the trainers
gather and reduce.

    all_scores = gather(accelerator, scores)          # [B] on this process -> [N * B], back where `scores` was
    totals = reduce(accelerator, sums, "sum")         # summed over processes, back where `sums` was
    score = lambda t: gather(accelerator, t)          # what Sol-RL's candidate pool takes
    worst = gather_max(accelerator, err)              # the largest of the processes' floats, on every process
    rows, finish = split_rows(accelerator, n)         # this process's share of n rows; finish(part) -> all n rows

NCCL, the backend of every multi-GPU run, takes only tensors on the process's GPU ("Tensors must be CUDA and
dense"), while gloo, the backend of the CPU tests, takes host tensors too: a reward's scores, group ids or a
Python count wrapped in a tensor are on the host, so handing them to accelerate's gather as they are works in
every CPU test and crashes the first iteration on GPUs. Here the tensor goes to `accelerator.device` for the
collective and comes back to the device it came from (the caller's choice of where to compute next). On one
process accelerate returns the input, so the copies cost two tiny transfers an iteration; they are kept there too,
so that a test accelerator can check every collective's input on one process (tests/device_strict.py).
"""

from __future__ import annotations

import torch


def to_device(accelerator, t: torch.Tensor) -> torch.Tensor:
    """`t` on the accelerator's device (non-blocking from the host: the collective orders after the copy)."""
    return t.to(accelerator.device, non_blocking=True)


def gather(accelerator, t: torch.Tensor) -> torch.Tensor:
    """Every process's `t`, concatenated along dim 0 in rank order (accelerate's gather), on `t`'s device.
    Every process must call it, in the same order, with the same shape except dim 0 equal too."""
    return accelerator.gather(to_device(accelerator, t)).to(t.device)


def reduce(accelerator, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`t` reduced over processes ("sum" or "mean", accelerate's reduce), on `t`'s device. Collective."""
    return accelerator.reduce(to_device(accelerator, t), op).to(t.device)


def gather_max(accelerator, x: float) -> float:
    """The largest of the processes' `x`, the same float on every process (NaN if any is NaN). Collective: where
    every process must take the same decision from a local number (stop on a failed check, a loop's count), each
    calls it and decides on the result, so none raises or stops while another goes on into the next collective."""
    return float(gather(accelerator, torch.tensor([float(x)], dtype=torch.float64)).max())


def split_rows(accelerator, n: int):
    """This process's share of n rows and how to put the shares back together: (rows [ceil(n / P)] long, finish),
    finish(part [ceil(n / P), ...]) -> [n, ...] every process's part in row order (a collective). Process r takes the
    contiguous rows r * ceil(n / P) ... and repeats row n - 1 where it runs past n, so every process runs as many
    rows (equal forwards: docs/architecture.md "Many processes"); the repeats are dropped after the gather.
    One process: all."""
    per = -(-n // accelerator.num_processes)
    rows = torch.arange(accelerator.process_index * per, (accelerator.process_index + 1) * per).clamp(max=n - 1)
    return rows, lambda part: gather(accelerator, part)[:n]


def whole(n: int):
    """split_rows' answer for one process without an accelerator: every row, nothing to gather."""
    return torch.arange(n), lambda part: part
