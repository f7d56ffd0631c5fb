"""Choosing the trainer: model.kind picks the typed config and the recipe that runs it.

    cfg = load_train_config("configs/digits.yaml", ["train.lr=1e-4"])   # FlowConfig or MaskedConfig, by model.kind
    summary = train_function(cfg)(cfg, out_dir=None)                    # difrl.train.flow.trainer.train or .masked.train

The flow kinds come from the world table (difrl.worlds.flow_kinds(): plug-in model families too), the masked ones from
difrl.worlds.MASKED_WORLDS. This sits above both configs and both recipes, so neither config module
imports a recipe (difrl/train/config.py is the common base that difrl/train/masked/config.py extends).
"""

from __future__ import annotations

from difrl.config import load_config_union
from difrl.models.adapters import HOW_TO_ADD
from difrl.train.config import FlowConfig, TrainerConfig
from difrl.train.masked.config import MaskedConfig
from difrl.worlds import MASKED_KINDS, train_kinds


def config_class(kind: str) -> type:
    """The config class of the trainer for model.kind."""
    return MaskedConfig if kind in MASKED_KINDS else FlowConfig


def load_train_config(path, overrides=(), problems: list | None = None) -> TrainerConfig:
    """The typed config of the trainer that model.kind (YAML, then overrides) names: a FlowConfig or a
    MaskedConfig. model.kind is checked against every known kind first, with the usual located error. `problems`:
    a list to collect the other ConfigErrors into instead of raising the first (difrl.config; difrl check)."""
    return load_config_union({k: config_class(k) for k in train_kinds()}, "model.kind", path, overrides, HOW_TO_ADD,
                             problems)


def train_function(cfg: TrainerConfig):
    """The recipe that runs a typed config: train(cfg, out_dir=None) of difrl.train.flow.trainer or difrl.train.masked.trainer
    (imported when asked for: loading a config does not import the trainers)."""
    if cfg.trainer == "masked":
        from difrl.train.masked.trainer import train
    else:
        from difrl.train.flow.trainer import train
    return train
