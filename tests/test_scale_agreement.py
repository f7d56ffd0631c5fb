"""Processes that must agree before they act: the on-policy ratio check stops every process together, and the plan
refuses a forest whose trees of one prompt would be split over processes.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_scale_agreement.py -q

The ratio-check tests launch 2 processes (torchrun, gloo on CPU) of the digits trainer with the log-prob recompute
made wrong on rank 1 only: every process must stop with the RatioCheckError, not rank 1 alone while rank 0 waits in
backward's all-reduce (under NCCL: for ever). The plan tests need no processes (world_size is a parameter).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from difrl.config import ConfigError
from difrl.train.config import load_flow_config
from difrl.train.flow_plan import plan

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "configs" / "digits.yaml"


class _NoWorld:
    """A world that fails on any use: the plan must decide before the model is ever loaded."""

    def __getattr__(self, name):
        raise AssertionError(f"the plan used the world ({name})")


# ---------------------------------------------------------------------------------- a forest over processes

FOREST = ["rollout.kind=tree", "tree.roots=4", "tree.split_steps=[1]", "rollout.group_size=8",  # 4 trees x 2 leaves
          "rollout.prompts_per_iter=2", "train.micro_batch=64", "train.updates_per_epoch=null"]


def test_a_forest_split_over_processes_is_refused_by_the_plan(tmp_path):
    # 2 prompts x 4 trees = 8 trees over 8 processes: one tree each, so evenly split (the forward counts agree), but
    # a prompt's 4 trees are one group of depthwise_advantages and would sit on 4 processes
    cfg = load_flow_config(DIGITS, FOREST)
    with pytest.raises(ConfigError) as e:
        plan(cfg, _NoWorld(), 8, tmp_path, lambda msg: None)
    msg = str(e.value)
    assert e.value.key == "rollout.prompts_per_iter"
    assert "tree.roots=4" in msg and "rollout.prompts_per_iter=2" in msg and "8 processes" in msg
    assert "1 tree(s) per process" in msg  # what would happen
    # values that work: a multiple of the processes for prompts_per_iter, or processes that divide the prompts
    assert "rollout.prompts_per_iter=8" in msg and "1 or 2 processes" in msg
    # the same forest on 2 processes (one prompt's 4 trees on each) and on 1 plans
    for world_size in (1, 2):
        n_total, per_proc, _, _, _ = plan(cfg, _NoWorld(), world_size, tmp_path, lambda msg: None)
        assert (n_total, per_proc) == (16, 16 // world_size)
    # 4 prompts over 8 processes: refused as well (half a forest each), with 8 as the nearest prompts that work
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_iter=8 .*or 1, 2 or 4 processes"):
        plan(load_flow_config(DIGITS, [*FOREST, "rollout.prompts_per_iter=4"]), _NoWorld(), 8, tmp_path, print)
