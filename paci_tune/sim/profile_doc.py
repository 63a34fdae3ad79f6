"""A profile document's values checked one by one: its keys, links, unit costs and sizes.

What :meth:`paci_tune.sim.profile.Profile.from_dict` reads a parsed YAML profile with (the format is
:mod:`.profile`'s docstring). An unknown key, a missing cost or a value out of range is a
:class:`~paci_tune.errors.ConfigError` naming its dotted key (``profile.units[2].microbatch.8``,
say); a unit's entry becomes its :class:`~.costs.UnitProfile`, one backward half given making the
other the rest of the backward. May import: :mod:`.costs`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .costs import UnitCost, UnitProfile

_TOP_KEYS = (
    "format",
    "machine",
    "device",
    "torch",
    "dtype",
    "date",
    "threads",
    "seq_len",
    "units",
    "p2p",
    "allreduce",
    "tied",
    "optimizer",
    "optimizer_note",
)
_UNIT_KEYS = (
    "name",
    "param_bytes",
    "trainable_bytes",
    "optimizer_s",
    "copy_s",
    "microbatch",
    "optimizer_steps",
    "step_bytes",
)
_COST_KEYS = ("forward_s", "backward_s", "activation_bytes", "saved_bytes")
_SPLIT_KEYS = ("backward_input_s", "backward_weight_s")
_TRANSIENT_KEYS = ("transient_bytes", "eval_bytes", "split_bytes")
_P2P_KEYS = ("latency_s", "bandwidth_Bps", "backend")


def _mapping(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, "a mapping with keys: " + ", ".join(allowed))
    for k, v in value.items():
        if k not in allowed:
            raise ConfigError(f"{key}.{k}", v, "a known key: " + ", ".join(allowed))


def _link(key: str, raw: Any) -> tuple[float, float, str]:
    """(latency_s, bandwidth_Bps, backend) of a ``p2p`` or ``allreduce`` mapping."""
    _mapping(key, raw, _P2P_KEYS)
    latency = _number(f"{key}.latency_s", raw.get("latency_s"))
    bandwidth = raw.get("bandwidth_Bps")
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, (int, float))
        or not bandwidth > 0
        or (isinstance(bandwidth, int) and bandwidth >= 2**1023)
    ):
        raise ConfigError(f"{key}.bandwidth_Bps", bandwidth, "a positive number of bytes/s (.inf: free)")
    return latency, float(bandwidth), str(raw.get("backend", "unknown"))


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**63:
        raise ConfigError(key, value, "a finite number >= 0")
    if not math.isfinite(float(value)):
        raise ConfigError(key, value, "a finite number >= 0")
    return float(value)


def _int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**63:
        raise ConfigError(key, value, f"an integer >= {minimum} (below 2**63)")
    return value


def _unit(key: str, raw: Any, index: int) -> UnitProfile:
    _mapping(key, raw, _UNIT_KEYS)
    mbs = raw.get("microbatch")
    if not isinstance(mbs, Mapping) or not mbs:
        raise ConfigError(f"{key}.microbatch", mbs, "a non-empty mapping of micro-batch size to costs")
    costs: dict[int, UnitCost] = {}
    for b_raw, c in mbs.items():
        try:
            b = int(b_raw)  # YAML written by hand may quote the size
        except (TypeError, ValueError):
            b = 0
        if b < 1 or isinstance(b_raw, bool) or (isinstance(b_raw, float) and b != b_raw):
            raise ConfigError(f"{key}.microbatch", b_raw, "positive integer micro-batch sizes as keys")
        ck = f"{key}.microbatch.{b}"
        _mapping(ck, c, _COST_KEYS + _SPLIT_KEYS + _TRANSIENT_KEYS)
        for k in _COST_KEYS:
            if k not in c:
                raise ConfigError(f"{ck}.{k}", None, "a number >= 0 (every cost is required)")
        split = [None if c.get(k) is None else _number(f"{ck}.{k}", c[k]) for k in _SPLIT_KEYS]
        for i, half in enumerate(split):  # one half given: the other is the rest of the backward
            other = split[1 - i]
            if half is None and other is not None:
                split[i] = max(float(c["backward_s"]) - other, 0.0)
        costs[b] = UnitCost(
            _number(f"{ck}.forward_s", c["forward_s"]),
            _number(f"{ck}.backward_s", c["backward_s"]),
            _int(f"{ck}.activation_bytes", c["activation_bytes"]),
            _int(f"{ck}.saved_bytes", c["saved_bytes"]),
            *split,
            *(None if c.get(k) is None else _int(f"{ck}.{k}", c[k]) for k in _TRANSIENT_KEYS),
        )
    param_bytes = _int(f"{key}.param_bytes", raw.get("param_bytes"))
    trainable = raw.get("trainable_bytes")
    if trainable is not None:
        trainable = _int(f"{key}.trainable_bytes", trainable)
        if trainable > param_bytes:
            raise ConfigError(f"{key}.trainable_bytes", trainable, f"at most param_bytes ({param_bytes})")
    steps = raw.get("optimizer_steps") or {}
    if not isinstance(steps, Mapping):
        raise ConfigError(f"{key}.optimizer_steps", steps, "a mapping of optimizer to the seconds of its step")
    return UnitProfile(
        name=str(raw.get("name", f"unit{index}")),
        param_bytes=param_bytes,
        trainable_bytes=trainable,
        optimizer_s=_number(f"{key}.optimizer_s", raw.get("optimizer_s")),
        costs=costs,
        copy_s=None if raw.get("copy_s") is None else _number(f"{key}.copy_s", raw["copy_s"]),
        optimizer_steps={str(k): _number(f"{key}.optimizer_steps.{k}", v) for k, v in steps.items()},
        step_bytes=None if raw.get("step_bytes") is None else _int(f"{key}.step_bytes", raw["step_bytes"]),
    )
