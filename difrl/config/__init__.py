"""Typed configs: nested dataclasses filled from YAML plus dotted command-line overrides.

Usage::

    from dataclasses import dataclass, field
    from difrl.config import cfg_field, load_config, save_config

    @dataclass
    class TrainConfig:
        lr: float = cfg_field(3e-4, gt=0.0, help="learning rate")
        clip_range: list[float] = cfg_field(default_factory=lambda: [1e-4, 1e-4])

    @dataclass
    class RootConfig:
        seed: int = cfg_field(0)
        train: TrainConfig = field(default_factory=TrainConfig)

    cfg = load_config(RootConfig, "configs/digits.yaml", ["train.lr=1e-4", "seed=3"])
    save_config(cfg, "runs/x/config.yaml")   # load_config(RootConfig, that path) == cfg

Precedence: dataclass defaults < YAML file < overrides (applied in order).  Override
values are parsed with ``yaml.safe_load`` (``1e-4``, ``true``, ``[1, 2]``, ``null``).
Keys absent from the YAML keep their defaults; a mapping given for a ``dict[str, T]``
field replaces the default dict, while ``rewards.name=1.0`` adds/changes one entry.

Every problem is raised as :class:`ConfigError` naming the dotted key, where the value
came from, the value and what was expected.  For cross-field checks a dataclass may
define ``validate(self)``; it is called on every nested config (children first) and
should ``raise config_error("field", "why")`` -- the key is made fully dotted for you.
With ``problems=[]`` (``load_config``, ``load_config_union``) the same checks collect instead
of raising: each bad key is appended and left at its default (an unknown key is dropped, an
override that does not parse is skipped), each section's ``validate`` runs on its own, and the
config is returned so that the rest can be checked (``difrl check``, difrl.train.check).

The parts: difrl.config.fields (ConfigError, cfg_field, what a field says), difrl.config.build (a mapping into the
typed tree, checked and located), difrl.config.load (defaults < YAML < overrides), difrl.config.save (plain dicts,
YAML files, the key listing).
"""
from __future__ import annotations

from difrl.config.fields import CLI, ConfigError, cfg_field, config_error  # noqa: F401  (CLI: "command line", a source)
from difrl.config.load import apply_overrides, config_from_dict, load_config, load_config_union
from difrl.config.save import config_to_dict, describe_config, save_config

__all__ = ["ConfigError", "cfg_field", "config_error", "load_config", "load_config_union", "apply_overrides",
           "config_from_dict", "config_to_dict", "save_config", "describe_config"]
