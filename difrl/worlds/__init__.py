"""Bundled worlds: a policy, its prompts, an evaluation and a way to show samples.

    world = build_world("digits", model_path=None)
    metrics, images = world.evaluate(world.policy, per_digit=50, num_steps=10, seed=1234)
    world.save_grid(images, "samples/iter-0000.png")
    world = build_world("flux", "/models/FLUX.1-dev", cfg)   # a diffusers pipeline dir; prompts etc. from cfg.model
    sigmas = world.sigmas(28, 1.0)                           # the schedule the trainer samples on

A plain dict maps the config's ``model.kind`` to a builder ``(model_path, cfg) -> World``; new
worlds add an entry. The diffusers entries come from the adapter table (``difrl.models.adapters.ADAPTERS``),
one per model kind, all built by ``difrl/worlds/diffusers.py``; ``FLOW_KINDS`` lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from difrl.models.adapters import ADAPTERS  # the adapter classes only: diffusers is imported when a model loads
from difrl.samplers.schedules import sigma_schedule


@dataclass
class World:
    name: str
    policy: object  # FlowPolicy
    prompts: list[str]  # training prompts; prompt id = index
    evaluate: Callable[..., tuple[dict, torch.Tensor]]
    save_grid: Callable[[torch.Tensor, Path], None]
    metadata: Callable[[int], dict]  # prompt id -> reward metadata
    device: str = "auto"  # "cpu": the trainer keeps every process on the CPU even where a GPU exists
    sigmas: Callable[[int, float], torch.Tensor] = sigma_schedule  # (num_steps, shift) -> [num_steps + 1] sigmas
    save_lora: Callable[[object, Path], Path] | None = None  # (policy, dir): the model's own LoRA format; None = merged
    default_reward: str | None = None  # the reward of reward.weights=null (None: the config must name one)
    headline: tuple[str, ...] = ("reward",)  # eval keys shown in the progress bar, the CLI table and the plot


def _digits(model_path: str | None, cfg=None) -> World:
    from PIL import Image

    from difrl.models.digits import DigitsPolicy
    from difrl.worlds.digits import PROMPTS, DigitsWorld, evaluate_digits, image_grid

    world = DigitsWorld.load()
    policy = DigitsPolicy.from_checkpoint(model_path)

    def evaluate(policy, per_digit=50, num_steps=10, seed=1234, shift=1.0):
        return evaluate_digits(policy, world, per_digit, num_steps, seed, shift)

    def save_grid(images: torch.Tensor, path: Path) -> None:
        # images come prompt-major (per_digit of 0, then of 1, ...): one row per digit, 10 samples each
        per = images.shape[0] // 10
        rows = torch.cat([images[d * per: d * per + min(per, 10)] for d in range(10)])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image_grid(rows, nrow=min(per, 10))).save(path)

    return World("digits", policy, list(PROMPTS), evaluate, save_grid, lambda pid: {"digit": pid}, device="cpu",
                 default_reward="digit_prob", headline=("accuracy", "fd"))


def _moving_digits(model_path: str | None, cfg=None) -> World:
    from difrl.models.video_flow import MovingDigitsPolicy, parse_moving_prompt
    from difrl.worlds.moving_digits import PROMPTS, MovingDigitsWorld, evaluate_moving_digits, grid_order, save_gif

    world = MovingDigitsWorld.load()
    policy = MovingDigitsPolicy.from_checkpoint(model_path)
    prompts = list(PROMPTS)  # model.prompts (if set): train on those; the eval always covers all 40
    if cfg is not None and getattr(cfg.model, "prompts", None):
        prompts = [str(p) for p in cfg.model.prompts]
        for p in prompts:
            parse_moving_prompt(p)  # an unreadable prompt stops the run here, named
    ev = getattr(cfg, "eval", None)
    if ev is not None and (getattr(ev, "rewards", None) or getattr(getattr(ev, "fid", None), "reference", None)):
        raise ValueError("model.kind=moving_digits evaluates with its own classifier, unseen judge and clip FD; "
                         "eval.rewards and eval.fid are for diffusers models (they would be ignored here)")

    def evaluate(policy, per_digit=10, num_steps=10, seed=1234, shift=1.0):
        return evaluate_moving_digits(policy, world, per_digit, num_steps, seed, shift)

    def save_grid(videos: torch.Tensor, path: Path) -> None:
        # a GIF beside the trainer's .png name: row = digit, columns = left, right, up, down x 3 samples
        per = videos.shape[0] // len(PROMPTS)
        save_gif(videos[grid_order(per)], Path(path).with_suffix(".gif"), nrow=4 * min(per, 3))

    def metadata(pid: int) -> dict:
        digit, direction = parse_moving_prompt(prompts[pid])
        return {"digit": digit, "direction": direction, "prompt_id": pid}

    return World("moving_digits", policy, prompts, evaluate, save_grid, metadata, device="cpu",
                 default_reward="moving_digit", headline=("accuracy", "motion_accuracy", "fd"))


def _diffusers(kind: str) -> Callable[..., World]:
    def build(model_path: str | None, cfg=None) -> World:
        from difrl.worlds.diffusers import diffusers_world

        return diffusers_world(kind, model_path, cfg)

    return build


# one entry per diffusers adapter: a new model kind in difrl/models/adapters.py is a world (and a flow-config choice)
WORLDS: dict[str, Callable[..., World]] = {"digits": _digits, "moving_digits": _moving_digits,
                                           **{kind: _diffusers(kind) for kind in ADAPTERS}}
FLOW_KINDS: tuple[str, ...] = tuple(WORLDS)  # the model.kind values the flow trainer runs (difrl/train/config.py)


def build_world(kind: str, model_path: str | None = None, cfg=None) -> World:
    """The world for `kind`; `cfg` (a FlowConfig) gives the diffusers worlds their prompts, size, dtype and rewards."""
    if kind not in WORLDS:
        raise ValueError(f"unknown model.kind {kind!r}; known: {', '.join(WORLDS)}")
    return WORLDS[kind](model_path, cfg)
