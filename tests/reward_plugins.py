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


def on_uint8_pixels():
    """Brightness of the pixels the `raw` wire encoding sends: round(255 clamp(x, 0, 1)) / 255 (the in-process
    twin of `remote` brightness with encoding raw)."""
    from difrl.rewards.simple import brightness

    inner = brightness()

    def fn(images, prompts, metadata):
        return inner((images.float().clamp(0, 1) * 255).round() / 255, prompts, metadata)["brightness"]
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


__all__ = ["boom", "sleepy", "nan_for_first", "on_uint8_pixels", "scaled", "torch"]
