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
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

import yaml

__all__ = ["ConfigError", "cfg_field", "config_error", "load_config", "load_config_union", "apply_overrides",
           "config_from_dict", "config_to_dict", "save_config", "describe_config"]

MISSING = dataclasses.MISSING
CLI = "command line"


class ConfigError(ValueError):
    """A config problem; ``key`` is the dotted key concerned (if any)."""

    def __init__(self, message: str, key: str | None = None, *, _located: bool = False):
        super().__init__(message)
        self.key = key
        self._located = _located


def config_error(key: str | None, message: str) -> ConfigError:
    """Error for ``validate()`` hooks; ``key`` is relative to the dataclass being validated."""
    return ConfigError(message, key)


def cfg_field(default: Any = MISSING, *, default_factory: Any = MISSING, help: str = "",
              choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None, choices_hint: str = "",
              ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field carrying help text, allowed choices and numeric bounds. `choices` may be a function returning
    them, asked each time a value is checked (a table that plug-ins extend: model.kind); `choices_hint` ends the error
    for a value not among them (how to add one)."""
    if isinstance(default, (list, dict, set)):  # mutable default: copy per instance
        default_factory, default = (lambda d=default: copy.deepcopy(d)), MISSING
    meta = {"help": help, "choices": choices if callable(choices) or choices is None else tuple(choices),
            "choices_hint": choices_hint, "ge": ge, "gt": gt, "le": le, "lt": lt}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


# ----------------------------------------------------------------------------- helpers
class _Cli:
    """An override value: the parsed YAML plus the raw text (kept for ``str`` fields)."""

    def __init__(self, text: str, value: Any):
        self.text, self.value = text, value


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, _Cli) else v


class _Ctx:
    """Knows where each value came from: the base label, or the command line."""

    def __init__(self, label: str, cli_keys: set[str] = frozenset(), file_keys: set[str] | None = None,
                 problems: list | None = None):
        self.label, self.cli_keys, self.file_keys = label, cli_keys, file_keys
        self.problems = problems  # a list: collect each ConfigError there instead of raising it

    def collect(self, e: ConfigError) -> None:
        """Raise `e`, or append it to the problems being collected."""
        if self.problems is None:
            raise e
        self.problems.append(e)

    def src(self, key: str) -> str:
        """CLI for a key (or a parent) set on the command line; the label for one in the file (or any key when
        the file's keys are not known); "default value" for a key neither sets."""
        in_file = self.file_keys is None or re.sub(r"(\[\d+\])+$", "", key) in self.file_keys  # a list item: its list
        while key:
            if key in self.cli_keys:
                return CLI
            shorter = re.sub(r"(\[\d+\]|\.?[^.\[]*)$", "", key, count=1)
            key = "" if shorter == key else shorter
        return self.label if in_file else "default value"


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    """Every dotted key of a nested mapping (a YAML file's), parents included."""
    out: set[str] = set()
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out |= {_join(prefix, k)} | _dotted_keys(v, _join(prefix, k))
    return out


def _join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _err(ctx: _Ctx, key: str, text: str) -> ConfigError:
    return ConfigError(f"config key {key!r} ({ctx.src(key)}) {text}", key, _located=True)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None) or tp is None:
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "Literal[" + ", ".join(map(repr, args)) + "]"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _type_error(ctx: _Ctx, key: str, value: Any, tp: Any, note: str = "") -> ConfigError:
    if isinstance(value, Mapping) and not (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict):
        return _err(ctx, key, f"got a mapping {_show(value)}; expected {_type_name(tp)} "
                              "(a single value, not a section)")
    got = f"got {_show(value)} ({type(value).__name__}); expected "
    if dataclasses.is_dataclass(tp):
        return _err(ctx, key, got + f"a mapping of {tp.__name__} settings")
    return _err(ctx, key, got + _type_name(tp) + note)


def _default(f: dataclasses.Field, base: Any) -> Any:
    if base is not None:
        return copy.deepcopy(getattr(base, f.name))
    if f.default is not MISSING:
        return copy.deepcopy(f.default)
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


# ------------------------------------------------------------------------ conversion
def _convert(tp: Any, value: Any, key: str, ctx: _Ctx, base: Any = None) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return _plain(value)
    if origin in (Union, types.UnionType):
        if _plain(value) is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, key, ctx, base)
        collecting, ctx.problems = ctx.problems, None  # each option is a trial: its errors raise, never collected
        try:
            for a in options:
                try:
                    return _convert(a, value, key, ctx, base)
                except ConfigError:
                    pass
        finally:
            ctx.problems = collecting
        raise _type_error(ctx, key, _plain(value), tp)
    if tp is str and isinstance(value, _Cli):  # `name=123` on the command line means "123"
        return value.value if isinstance(value.value, str) else value.text
    value = _plain(value)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _err(ctx, key, f"got {_show(value)}; expected one of {', '.join(map(repr, args))}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, ctx, base if isinstance(base, tp) else None)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp in (int, float):
        if isinstance(value, str):  # yaml reads "1e-4" as a string
            try:
                return tp(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool):
            return tp(value)
    elif origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(value) != len(args):
                    raise _type_error(ctx, key, value, tp, f" (exactly {len(args)} items)")
                return tuple(_convert(a, v, f"{key}[{i}]", ctx) for i, (a, v) in enumerate(zip(args, value)))
            item = args[0] if args else Any
            items = [_convert(item, v, f"{key}[{i}]", ctx) for i, v in enumerate(value)]
            return tuple(items) if (origin or tp) is tuple else items
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            kt, vt = args if args else (Any, Any)
            return {_convert(kt, k, key, ctx): _convert(vt, v, _join(key, k), ctx) for k, v in value.items()}
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _type_error(ctx, key, value, tp)


def _choices(meta) -> tuple | None:
    """A field's allowed values now (cfg_field's `choices`, called when it is a function), or None."""
    choices = meta.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _check_meta(f: dataclasses.Field, value: Any, key: str, ctx: _Ctx) -> None:
    meta = f.metadata
    if isinstance(value, (list, tuple)):
        items = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, dict):
        items = [(_join(key, k), v) for k, v in value.items()]
    else:
        items = [(key, value)]
    for k, v in items:
        if v is None:
            continue
        choices = _choices(meta)
        if choices is not None and v not in choices:
            raise _err(ctx, k, f"= {_show(v)} is not an allowed choice; expected one of "
                               + ", ".join(map(repr, choices)) + (f"; {h}" if (h := meta.get("choices_hint")) else ""))
        for name, sym, ok in (("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b),
                              ("le", "<=", lambda a, b: a <= b), ("lt", "<", lambda a, b: a < b)):
            if meta.get(name) is not None and isinstance(v, (int, float)) and not ok(v, meta[name]):
                raise _err(ctx, k, f"= {_show(v)} is out of range; expected {sym} {meta[name]}")


def _build(cls: type, data: Any, prefix: str, ctx: _Ctx, base: Any = None) -> Any:
    data = _plain(data)
    if not isinstance(data, Mapping):
        raise _type_error(ctx, prefix, data, cls)
    fields, hints = _init_fields(cls), typing.get_type_hints(cls)
    for k in data:
        if k not in fields:
            key = _join(prefix, k)
            close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
            hint = (f"did you mean {_join(prefix, close[0])!r}?" if close else
                    f"valid keys {'at ' + repr(prefix) if prefix else 'at the top level'}: "
                    + ", ".join(fields))
            ctx.collect(ConfigError(f"unknown config key {key!r} ({ctx.src(key)}); {hint}", key, _located=True))
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            dflt = _default(f, base) if dataclasses.is_dataclass(_unwrap_optional(hints[name])) else None
            try:
                kwargs[name] = _convert(hints[name], data[name], key, ctx, None if dflt is MISSING else dflt)
                _check_meta(f, kwargs[name], key, ctx)
            except ConfigError as e:
                ctx.collect(e)
                kwargs[name] = _default(f, base)  # collecting: the default stands in, so the rest is checked
        else:
            kwargs[name] = _default(f, base)
            if kwargs[name] is MISSING:
                raise ConfigError(f"missing required config key {key!r} ({ctx.src(key)}); expected a "
                                  f"value of type {_type_name(hints[name])}: set it in the YAML "
                                  f"file or pass {key}=VALUE", key, _located=True)
    return cls(**kwargs)


def _validate_tree(obj: Any, prefix: str, ctx: _Ctx) -> None:
    for name in _init_fields(type(obj)):
        child = getattr(obj, name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            _validate_tree(child, _join(prefix, name), ctx)
    if callable(getattr(obj, "validate", None)):
        try:
            obj.validate()
        except ConfigError as e:
            if not e._located:
                key = _join(prefix, e.key) if e.key else prefix
                where = f"config key {key!r} ({ctx.src(key)})" if key else "config"
                located = ConfigError(f"{where} is invalid: {e}", key or None, _located=True)
                if ctx.problems is None:
                    raise located from None
                e = located
            ctx.collect(e)  # collecting: this section's problem; its siblings and parents are still validated


# ----------------------------------------------------------------------- public API
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
