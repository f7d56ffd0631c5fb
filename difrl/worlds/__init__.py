"""Bundled worlds: a policy, its prompts, an evaluation and a way to show samples.

    world = build_world("digits", model_path=None)
    metrics, images = world.evaluate(world.policy, per_digit=50, num_steps=10, seed=1234)
    world.save_grid(images, "samples/iter-0000.png")
    world = build_world("flux", "/models/FLUX.1-dev", cfg)   # a diffusers pipeline dir; prompts etc. from cfg.model
    sigmas = world.sigmas(28, 1.0)                           # the schedule the trainer samples on
    masked = build_masked_world(cfg)                         # a MaskedConfig: Sudoku, digit tokens, text (difrl.worlds.masked)

Two plain dicts map the config's ``model.kind`` to the file in difrl/worlds/ that builds its world:
``FLOW_FILES`` (a flow world's file defines ``flow_world(kind, model_path, cfg) -> World`` and
``check_config(cfg)``; every diffusers model kind, ``difrl.models.adapters.model_kinds()``, is built by
``difrl/worlds/diffusers.py``) and ``MASKED_FILES`` (``masked_world(cfg) -> MaskedWorld``, optionally
``check_config`` and ``OWN_KEYS``). A new world is its file plus one entry; the trainers read the kinds
(``flow_kinds()``: the bundled worlds and every model family, those registered by plug-ins included;
``MASKED_KINDS``) and each world's config checks from here, and name no world themselves (docs/architecture.md).
What a trainer does with a world's results is the world's too (difrl/worlds/contract.py): the eval line it prints
(``World.eval_line``), the rows of the before / after table (``World.before_after_keys``), the early-stop rule
(``World.stop``: FDRise for digits and moving digits) and the final weights (``World.save_final``; MaskedWorld has the
same eval line, table and save members).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from difrl.models.adapters import BUILTIN_ADAPTERS, HOW_TO_ADD, model_kinds  # the table only: diffusers loads later
from difrl.samplers.schedules import sigma_schedule
from difrl.worlds.contract import FDRise, before_after_keys, format_eval, save_merged


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
    # (policy, net, lora, out_dir, write_merged): the final weights in the world's own files (difrl.worlds.contract);
    # the default: policy.safetensors, LoRA merged
    save_final: Callable[..., None] = save_merged
    default_reward: str | None = None  # the reward of reward.weights=null (None: the config must name one)
    headline: tuple[str, ...] = ("reward",)  # eval keys shown in the progress bar, the CLI table and the plot
    # (cfg, eval metrics, run state) -> the reason to stop early, or None (difrl.worlds.contract: FDRise); None: no rule
    stop: FDRise | None = None
    # eval metrics -> the line the trainer prints; None: the headline keys (contract.format_eval)
    describe_eval: Callable[[dict], str] | None = None
    # eval keys difrl train's before / after table lists first, in this order (those an evaluation has); the headline
    # keys follow (before_after_keys)
    before_after: tuple[str, ...] = ()

    @property
    def on_cpu(self) -> bool:
        """Whether the trainer keeps every process on the CPU (a small network: kernel launches would dominate)."""
        return self.device == "cpu"

    def eval_line(self, ev: dict) -> str:
        return self.describe_eval(ev) if self.describe_eval is not None else format_eval(ev, self.headline)

    def before_after_keys(self) -> list[str]:
        return before_after_keys(self.before_after, self.headline)


def check_bundled_config(cfg) -> None:
    """What a bundled flow world (digits, moving digits: a small network of its own, its own evaluation) refuses
    of a FlowConfig: the diffusers-only keys, which it would ignore."""
    from difrl.config import config_error

    mc = cfg.model
    for key in ("gradient_checkpointing", "compile"):
        if getattr(mc, key):
            raise config_error(f"model.{key}", f"applies to the diffusers transformers (flux, sd3, wan); the "
                                               f"{mc.kind} world's network is small enough without it")
    if cfg.eval.rewards or cfg.eval.fid.reference is not None:
        raise config_error("eval.rewards" if cfg.eval.rewards else "eval.fid.reference",
                           f"the {mc.kind} world evaluates with its own classifier, unseen judge and FD; the held-out "
                           "reward panel and eval.fid are for diffusers models")


def _flow(kind: str) -> Callable[..., World]:
    def build(model_path: str | None, cfg=None) -> World:
        return world_file(kind).flow_world(kind, model_path, cfg)

    return build


# model.kind -> its world's file in difrl/worlds/, which defines flow_world(kind, model_path, cfg) -> World and
# check_config(cfg) (what that world refuses of a FlowConfig); a new bundled flow world is its file plus one entry
FLOW_FILES: dict[str, str] = {"digits": "digits", "moving_digits": "moving_digits"}
# one entry per built-in diffusers adapter (difrl/models/adapters.py); flow_kinds() adds the families registered
# later (@register_model, the difrl.models entry points), which build_world and the configs accept too
WORLDS: dict[str, Callable[..., World]] = {kind: _flow(kind) for kind in (*FLOW_FILES, *BUILTIN_ADAPTERS)}
FLOW_KINDS: tuple[str, ...] = tuple(WORLDS)  # the built-in model.kind values the flow trainer runs


def flow_kinds() -> tuple[str, ...]:
    """Every model.kind the flow trainer runs, asked now: the bundled worlds, then every model family
    (difrl.models.adapters.model_kinds: an entry point's name without importing its package)."""
    return (*FLOW_FILES, *(k for k in model_kinds() if k not in FLOW_FILES))


def train_kinds() -> tuple[str, ...]:
    """Every model.kind of either trainer (difrl/train/config.py's ModelConfig.kind choices)."""
    return flow_kinds() + MASKED_KINDS


def check_world_config(cfg) -> None:
    """The chosen world's own checks of a FlowConfig (FlowConfig.validate calls it): a located ConfigError."""
    world_file(cfg.model.kind).check_config(cfg)


def build_world(kind: str, model_path: str | None = None, cfg=None) -> World:
    """The world for `kind`; `cfg` (a FlowConfig) gives the diffusers worlds their prompts, size, dtype and rewards."""
    if kind not in flow_kinds():
        raise ValueError(f"unknown model.kind {kind!r}; known: {', '.join(flow_kinds())}; {HOW_TO_ADD}")
    return _flow(kind)(model_path, cfg)


# ---- masked (discrete) worlds: model.kind -> the builder in the world's own file (types: difrl/worlds/masked.py)

# model.kind -> its world's file in difrl/worlds/, which defines masked_world(cfg) -> MaskedWorld, check_config(cfg)
# (what that world refuses of a MaskedConfig) and OWN_KEYS (the config keys only it reads); a new masked world is
# its file plus one entry
MASKED_FILES: dict[str, str] = {"sudoku": "sudoku", "digit_tokens": "digit_tokens", "hf_masked": "text_tasks"}
MASKED_KINDS: tuple[str, ...] = tuple(MASKED_FILES)  # the model.kind values the masked trainer runs


def world_file(kind: str):
    """The module in difrl/worlds/ that builds model.kind `kind`'s world (difrl/worlds/diffusers.py for an adapter
    kind), imported when asked for: the tables above import no world."""
    from importlib import import_module

    name = FLOW_FILES.get(kind) or MASKED_FILES.get(kind) or ("diffusers" if kind in model_kinds() else None)
    if name is None:
        raise ValueError(f"unknown model.kind {kind!r}; known: {', '.join(train_kinds())}; {HOW_TO_ADD}")
    return import_module(f"difrl.worlds.{name}")


def _masked(kind: str) -> Callable:
    return lambda cfg: world_file(kind).masked_world(cfg)


MASKED_WORLDS: dict[str, Callable] = {kind: _masked(kind) for kind in MASKED_FILES}


def build_masked_world(cfg):
    """The MaskedWorld (difrl.worlds.masked) of cfg.model.kind, built from `cfg` (a MaskedConfig)."""
    kind = cfg.model.kind
    if kind not in MASKED_WORLDS:
        raise ValueError(f"unknown masked model.kind {kind!r}; known: {', '.join(MASKED_WORLDS)}")
    return MASKED_WORLDS[kind](cfg)
