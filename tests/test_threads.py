"""torch's thread count when a config leaves `threads` unset (difrl.train.scaffold.default_threads): OMP_NUM_THREADS is
a per-process count and wins; otherwise the process's CPU affinity split over the launch's processes.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_threads.py -q

Why it matters: under `pytest -n 2` (conftest sets OMP_NUM_THREADS=1) a training run in a worker took both cores, and a
second worker doing the same made four threads on two cores, every parallel op waiting for its slowest thread.
"""

from __future__ import annotations

import os

import pytest

from difrl.train.scaffold import default_threads


def test_omp_num_threads_is_the_count_per_process(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    assert default_threads(4) == 3  # already per process: not divided again (torchrun sets 1 per worker)


@pytest.mark.parametrize("omp", [None, "", "0", "two"])
def test_without_a_usable_omp_num_threads_the_cores_are_split_over_the_processes(monkeypatch, omp):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [default_threads(p) for p in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
