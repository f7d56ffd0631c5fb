"""Rewards that misbehave on purpose, for the reward-server tests (the server process imports them as
`reward_plugins:<name>` with tests/ on PYTHONPATH)."""

import time
from pathlib import Path

import torch

from difrl.rewards.base import RewardModel


def boom():
    """Brightness, but raises for a batch holding a prompt with "boom" in it."""
    def fn(images, prompts, metadata):
        bad = [p for p in prompts if "boom" in p]
        if bad:
            raise ValueError(f"cannot score {bad[0]!r}")
        return images.float().flatten(1).mean(1)
    return fn


def sleepy(seconds: float = 2.0):
    """Brightness after `seconds` of sleep (a slow or, with a long sleep, hung scorer)."""
    def fn(images, prompts, metadata):
        time.sleep(seconds)
        return images.float().flatten(1).mean(1)
    return fn


def nan_for_first():
    def fn(images, prompts, metadata):
        s = images.float().flatten(1).mean(1).clone()
        s[0] = float("nan")
        return s
    return fn


class scaled(RewardModel):
    """Brightness times the number in the file `path`: a reward whose "weights" are a file (hashed into
    info()["weights_sha256"]); its version stays "1" whatever the file holds."""

    version = "1"

    def __init__(self, path: str):
        super().__init__(device="cpu", dtype="float32", batch_size=None)
        self.weight_files = [Path(path)]
        self.factor = float(Path(path).read_text())

    def score(self, images, prompts, metadata):
        return self.factor * images.float().flatten(1).mean(1)


__all__ = ["boom", "sleepy", "nan_for_first", "scaled", "torch"]
