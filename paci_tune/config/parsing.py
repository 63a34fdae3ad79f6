"""Typed parsing of YAML into frozen dataclasses: unknown keys refused, each value checked against its annotation.

:func:`from_dict` builds any config dataclass (the run's sections in :mod:`.schema`, the tuning
sections in :mod:`.tune`, best.yaml's) from a parsed mapping. A value of the wrong type, or one no
consumer can hold (an integer past 63 bits, an infinite number), is a
:class:`~paci_tune.errors.ConfigError` naming the dotted key, the value and what the annotation
allows; ints are widened to floats where a float is asked. May import: :mod:`paci_tune.errors` and
the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal

from ..errors import ConfigError

INT_LIMIT = 2**63
"""Integers in a config are 64-bit in every consumer (numpy, torch); a larger one cannot be used."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0])}" + (f" (length {len(args)})" if origin is tuple else "")
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (ints to floats etc.)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        specific = None
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                if e.allowed != _type_name(arg) and e.key == key:
                    specific = e  # right type, wrong value (an infinite number): say that, not the type
        if specific is not None:
            raise specific
        raise ConfigError(key, value, _type_name(tp))
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(key, value, _type_name(tp))
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, value, "null")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, _type_name(tp))
        args = typing.get_args(tp)
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(key, value, _type_name(tp))
            return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= INT_LIMIT:
                raise ConfigError(key, value, "an integer of at most 63 bits")
            return value
        raise ConfigError(key, value, "an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(key, value, "a finite number")
            return number
        raise ConfigError(key, value, "a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "a string")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    raise TypeError(f"unsupported annotation {tp!r} at {key}")


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], list[str]]:
    """A dataclass's resolved annotations and field names, once per class (a search derives thousands of runs)."""
    return typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a YAML mapping, rejecting unknown keys and wrong types."""
    where = prefix or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, data, "a mapping of keys to values")
    hints, names = _fields_of(cls)
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(key, v, f"a known key of {where}: {', '.join(names)}")
        kwargs[k] = _coerce(key, v, hints[k])
    return cls(**kwargs)
