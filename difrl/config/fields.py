"""The declaration side of a typed config: ConfigError, `cfg_field` (help text, choices, numeric bounds) and what a
dataclass field says about its key (its type's name, its default). Part of difrl.config (its docstring: how to use it).

    from difrl.config import cfg_field, config_error
    lr: float = cfg_field(3e-4, gt=0.0, help="learning rate")      # a field of a config dataclass
    raise config_error("clip_range", "must be increasing")          # in a dataclass's validate()
"""
from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

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


def _choices(meta) -> tuple | None:
    """A field's allowed values now (cfg_field's `choices`, called when it is a function), or None."""
    choices = meta.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


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
