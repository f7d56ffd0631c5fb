"""A typed config out again: plain dicts (YAML or JSON), a YAML file written atomically (a run's config.yaml), and the
listing of every key with its type, default and constraints (`difrl config`). Part of difrl.config.

    save_config(cfg, "runs/x/config.yaml")       # load_config(type(cfg), that path) == cfg
    print(describe_config(FlowConfig))
"""
from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from difrl.config.fields import MISSING, _choices, _default, _init_fields, _join, _show, _type_name


def config_to_dict(cfg: Any) -> Any:
    """Plain nested dicts/lists (tuples become lists), ready for YAML or JSON."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {name: config_to_dict(getattr(cfg, name)) for name in _init_fields(type(cfg))}
    if isinstance(cfg, Mapping):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    return cfg


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write ``cfg`` as YAML atomically (temp file in the same directory, then rename)."""
    from difrl.utils.io import atomic_write_text  # lazy: the config module itself needs no torch

    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))


def describe_config(cls: type) -> str:
    """One line per dotted key: type, default, help and constraints."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(c: type, prefix: str, base: Any) -> None:
        hints = typing.get_type_hints(c)
        for name, f in _init_fields(c).items():
            key, tp, dflt = _join(prefix, name), hints[name], _default(f, base)
            if dataclasses.is_dataclass(tp):
                walk(tp, key, dflt if isinstance(dflt, tp) else None)
                continue
            notes = [f.metadata.get("help") or ""]
            if _choices(f.metadata) is not None:
                notes.append("one of: " + ", ".join(map(str, _choices(f.metadata))))
            for m, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if f.metadata.get(m) is not None:
                    notes.append(f"{sym} {f.metadata[m]}")
            shown = "(required)" if dflt is MISSING else _show(config_to_dict(dflt))
            rows.append((key, _type_name(tp), shown, "; ".join(n for n in notes if n)))

    walk(cls, "", None)
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    return "\n".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}".rstrip()
                     for k, t, d, h in rows)
