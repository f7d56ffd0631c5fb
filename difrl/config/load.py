"""Where a config's values come from: the dataclass defaults, then a YAML file, then dotted `key=value` overrides
(applied in order), and a discriminated union of config classes chosen by one key. Part of difrl.config (its
docstring: precedence, the override syntax, collecting problems).

    cfg = load_config(FlowConfig, "configs/digits.yaml", ["train.lr=1e-4"])
    cfg = load_config_union({"digits": FlowConfig, "sudoku": MaskedConfig}, "model.kind", path, overrides)
    resumed = apply_overrides(cfg, ["train.iterations=20"])
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from difrl.config.build import _build, _Cli, _Ctx, _plain, _validate_tree
from difrl.config.fields import CLI, MISSING, ConfigError, _default, _init_fields, _join, _show, _unwrap_optional
from difrl.config.save import config_to_dict


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    """Every dotted key of a nested mapping (a YAML file's), parents included."""
    out: set[str] = set()
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out |= {_join(prefix, k)} | _dotted_keys(v, _join(prefix, k))
    return out


def _parse_override(arg: str) -> tuple[list[str], _Cli]:
    key, sep, text = arg.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"malformed override {arg!r}: expected dotted.key=value, e.g. train.lr=1e-4")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed override {arg!r}: value is not valid YAML ({e})") from None
    return [p.strip() for p in parts], _Cli(text.strip(), value)


def _apply(tree: dict, cls: type, overrides: Sequence[str], cli_keys: set[str], problems: list | None = None) -> None:
    for arg in [overrides] if isinstance(overrides, str) else overrides:
        try:
            _apply_one(tree, cls, arg, cli_keys)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(e)  # collecting: this override is skipped


def _apply_one(tree: dict, cls: type, arg: str, cli_keys: set[str]) -> None:
    parts, value = _parse_override(arg)
    node, tp, base = tree, cls, None
    for i, part in enumerate(parts[:-1]):
        tp, dflt = _unwrap_optional(tp), None
        if dataclasses.is_dataclass(tp) and part in _init_fields(tp):
            f = _init_fields(tp)[part]
            tp, dflt = typing.get_type_hints(tp)[part], _default(f, base)
        elif typing.get_origin(tp) is dict:
            tp, dflt = typing.get_args(tp)[1], base.get(part) if isinstance(base, Mapping) else None
        else:
            tp = None
        child = _plain(node.get(part))
        if child is None:  # absent: a dict field starts from its default, a section from {}
            child = config_to_dict(dflt) if isinstance(dflt, Mapping) else {}
        elif not isinstance(child, dict):
            key = ".".join(parts[:i + 1])
            raise ConfigError(f"cannot apply override {arg!r}: config key {key!r} holds "
                              f"{_show(child)}, not a mapping", key, _located=True)
        node[part], node, base = child, child, None if dflt is MISSING else dflt
    node[parts[-1]] = value
    cli_keys.add(".".join(parts))


def _read_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {os.fspath(path)}") from None
    except IsADirectoryError:
        run = os.path.isfile(os.path.join(path, "config.yaml"))
        raise ConfigError(f"{os.fspath(path)} is a directory, not a YAML config" + (
            f"; it is a run directory: continue that run with resume={os.fspath(path)} (difrl train "
            f"resume={os.fspath(path)}), or use its trained policy with difrl eval / difrl sample {os.fspath(path)}"
            if run else "")) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML in {os.fspath(path)}{where}: {what}") from None
    if data is None:  # an empty file would silently train the defaults (the digits world): say so instead
        raise ConfigError(f"config file {os.fspath(path)} is empty; give at least model.kind (e.g. copy "
                          "configs/digits.yaml), or run without a file for the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {os.fspath(path)} must contain a mapping at the top level, "
                          f"got {type(data).__name__}")
    return data


def config_from_dict(cls: type, mapping: Mapping, source: str = "<dict>") -> Any:
    """Build and validate ``cls`` from a nested mapping; ``source`` labels error messages."""
    ctx = _Ctx(f"in {source}")
    cfg = _build(cls, mapping, "", ctx)
    _validate_tree(cfg, "", ctx)
    return cfg


def load_config(cls: type, path: str | os.PathLike | None, overrides: Sequence[str] = (),
                problems: list | None = None) -> Any:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides. With a list as
    ``problems``, the ConfigErrors are collected there (module docstring) instead of raised."""
    tree = _read_yaml(path) if path is not None else {}
    file_keys = _dotted_keys(tree) if path is not None else None
    cli_keys: set[str] = set()
    _apply(tree, cls, overrides, cli_keys, problems)
    ctx = _Ctx(f"in {os.fspath(path)}" if path is not None else "no config file", cli_keys, file_keys, problems)
    cfg = _build(cls, tree, "", ctx)
    _validate_tree(cfg, "", ctx)
    return cfg


def load_config_union(classes: Mapping[str, type], key: str, path: str | os.PathLike | None,
                      overrides: Sequence[str] = (), note: str = "", problems: list | None = None) -> Any:
    """One of several config classes, chosen by the value of the dotted ``key`` (YAML file, then the last
    override of it; absent: the first class's default for it): a discriminated union such as
    ``{"digits": FlowConfig, "sudoku": MaskedConfig}`` keyed by ``model.kind``. An unknown value is a
    ConfigError naming the key, where it came from and the allowed values (then `note`: how to add one); then the
    chosen class is loaded with :func:`load_config` (which checks every other key, collecting into `problems`)."""
    tree = _read_yaml(path) if path is not None else {}
    parts, value, source = key.split("."), MISSING, f"in {os.fspath(path)}" if path is not None else "no config file"
    node: Any = tree
    for part in parts:
        node = node.get(part, MISSING) if isinstance(node, Mapping) else MISSING
    if node is not MISSING:
        value = node
    for arg in [overrides] if isinstance(overrides, str) else overrides:
        try:
            opt_parts, cli = _parse_override(arg)
        except ConfigError:
            if problems is None:
                raise
            continue  # collecting: load_config reports it
        if opt_parts == parts:
            value, source = cli.value, CLI
    if value is MISSING:
        return load_config(next(iter(classes.values())), path, overrides, problems)
    if not isinstance(value, str) or value not in classes:
        close = difflib.get_close_matches(str(value), list(classes), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"config key {key!r} ({source}) = {_show(value)} is not an allowed choice; {hint}expected one of "
                          + ", ".join(map(repr, classes)) + (f"; {note}" if note else ""), key, _located=True)
    return load_config(classes[value], path, overrides, problems)


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """A new config: ``cfg`` with ``key=value`` overrides applied (e.g. on resume)."""
    cls, tree, cli_keys = type(cfg), config_to_dict(cfg), set()
    _apply(tree, cls, overrides, cli_keys)
    ctx = _Ctx("in base config", cli_keys)
    new = _build(cls, tree, "", ctx)
    _validate_tree(new, "", ctx)
    return new
