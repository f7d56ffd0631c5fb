"""Reward plug-ins (DESIGN.md seam 4): found by name, extended by third-party packages.

    fn = build_reward("digit_prob")                          # or "mypkg.rewards:brightness"
    scores = fn(images, prompts, metadata)                  # {"digit_prob": [B] tensor}

A reward factory takes keyword options (from the config's ``reward.options.<name>``) and returns
a callable ``(images [B, C, (F,) H, W] in [0, 1], prompts, metadata) -> dict[str, [B] tensor]``;
its main score is the entry named like the reward. Factories are found, in order, in the
built-in table, as a ``module:function`` path, or under the ``difrl.rewards`` entry-point
group of installed packages::

    [project.entry-points."difrl.rewards"]
    brightness = "myreward:brightness"
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Callable

import torch

RewardFn = Callable[..., dict[str, torch.Tensor]]
REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str):
    """Decorator adding a factory to the built-in table."""
    def deco(factory):
        REWARDS[name] = factory
        return factory
    return deco


@lru_cache(maxsize=1)
def _entry_point_rewards() -> dict:
    return {ep.name: ep for ep in entry_points(group="difrl.rewards")}


def find_reward_factory(name: str) -> Callable[..., RewardFn]:
    _load_builtins()
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module!r} ({e})") from e
    eps = _entry_point_rewards()
    if name in eps:
        return eps[name].load()
    known = sorted(REWARDS) + sorted(eps)
    raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(known)} "
                     "(or give a 'module:function' path)")


def build_reward(name: str, **options) -> RewardFn:
    return find_reward_factory(name)(**options)


def _load_builtins() -> None:
    import difrl.rewards.digits  # noqa: F401  (registers digit_prob)
    import difrl.rewards.simple  # noqa: F401  (registers brightness, color)
    import difrl.rewards.sudoku_cells  # noqa: F401  (registers sudoku_cells)


class RewardError(RuntimeError):
    """A reward raised, or returned NaN/inf, for some samples; names them."""

    def __init__(self, message: str, bad: torch.Tensor, scores: dict[str, torch.Tensor] | None = None):
        super().__init__(message)
        self.bad = bad  # [B] bool
        self.scores = scores  # every reward's [B] scores (non-finite where bad), or None if one raised


def score_all(rewards: dict[str, RewardFn], images, prompts: list[str], metadata: list[dict],
              seeds: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run every reward; each must return a finite [B] score under its own name.

    A reward that raises or returns NaN/inf raises RewardError naming the reward and the
    prompt ids and seeds of the failing samples (`bad` marks them, so a caller may drop their groups)."""
    out: dict[str, torch.Tensor] = {}
    B = len(prompts)
    bad = torch.zeros(B, dtype=torch.bool)
    problems = []
    for name, fn in rewards.items():
        try:
            res = fn(images, prompts, metadata)
        except Exception as e:
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e} on a batch of {B} samples "
                              f"(prompt ids {sorted(set(prompt_ids.tolist()))[:8]}, seeds {seeds.tolist()[:8]})",
                              torch.ones(B, dtype=torch.bool)) from e
        key = name.rsplit(":", 1)[-1]
        if not isinstance(res, dict) or key not in res:
            raise RewardError(f"reward {name!r} must return a dict with a [B] tensor under {key!r}, got "
                              f"{type(res).__name__} {list(res) if isinstance(res, dict) else ''}",
                              torch.ones(B, dtype=torch.bool))
        score = torch.as_tensor(res[key], dtype=torch.float32).flatten()
        if score.shape[0] != B:
            raise RewardError(f"reward {name!r} returned {score.shape[0]} scores for {B} samples", torch.ones(B, dtype=torch.bool))
        nonfinite = ~torch.isfinite(score)
        if nonfinite.any():
            idx = nonfinite.nonzero().flatten()
            problems.append(f"reward {name!r} returned {score[idx][:4].tolist()} for prompt ids "
                            f"{prompt_ids[idx].tolist()[:8]} with seeds {seeds[idx].tolist()[:8]}")
            bad |= nonfinite
        out[key] = score
        for k, v in res.items():
            if k != key:
                out[f"{key}/{k}"] = torch.as_tensor(v, dtype=torch.float32).flatten()
    if problems:
        raise RewardError("non-finite reward: " + "; ".join(problems), bad, out)
    return out
