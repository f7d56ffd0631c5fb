"""A nested mapping (a YAML file's, overrides applied) converted into the typed dataclass tree and validated, every
problem located: the dotted key, where its value came from (the file, the command line, the default), the value and
what was expected. Part of difrl.config (its docstring: how to use it); loading calls it (difrl.config.load).

    ctx = _Ctx("in configs/digits.yaml", cli_keys={"train.lr"}, problems=None)   # problems=[]: collect, not raise
    cfg = _build(FlowConfig, tree, "", ctx); _validate_tree(cfg, "", ctx)
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from difrl.config.fields import (CLI, MISSING, ConfigError, _choices, _default, _init_fields, _join, _show, _type_name,
                                 _unwrap_optional)


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


def _err(ctx: _Ctx, key: str, text: str) -> ConfigError:
    return ConfigError(f"config key {key!r} ({ctx.src(key)}) {text}", key, _located=True)


def _type_error(ctx: _Ctx, key: str, value: Any, tp: Any, note: str = "") -> ConfigError:
    if isinstance(value, Mapping) and not (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict):
        return _err(ctx, key, f"got a mapping {_show(value)}; expected {_type_name(tp)} "
                              "(a single value, not a section)")
    got = f"got {_show(value)} ({type(value).__name__}); expected "
    if dataclasses.is_dataclass(tp):
        return _err(ctx, key, got + f"a mapping of {tp.__name__} settings")
    return _err(ctx, key, got + _type_name(tp) + note)


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
