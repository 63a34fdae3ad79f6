"""A search-space file's values, parsed: integer lists and ranges, LR scales, PACI's ``backward_weights``,
interleaved's ``chunks``.

Each parser takes the value as the file gives it and returns the choices :mod:`.space` binds, or
raises a ConfigError naming the ``space.KEY``, the value and what is allowed. ``backward_weights``'
values are the schema's own (``pipeline.backward_weights``'s ``Literal``), so the two cannot drift.
May import: :mod:`paci_tune.config` (the schema), :mod:`paci_tune.schedule` (v's default),
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

import math
from typing import Any

from ..config.schema import BACKWARD_WEIGHTS, PipelineConfig
from ..errors import ConfigError
from ..schedule import DEFAULT_CHUNKS

MAX_CHOICES = 10_000
"""Values one integer range may expand to: each is a point of a finite grid the search enumerates."""
DEFAULT_BACKWARD_WEIGHTS: str = PipelineConfig.backward_weights
"""The schema's default (``forward``): a point's label names only the other value."""


def int_choices(key: str, spec: Any) -> list[int]:
    """A list of positive integers, or a range: ``{low, high}`` with ``step`` or ``log: true``."""
    allowed = "a list of positive integers, or {low, high} with optional step or log: true (powers of two)"
    if isinstance(spec, list):
        if not spec or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2**63 for v in spec):
            raise ConfigError(key, spec, allowed)
        return sorted(set(spec))
    if isinstance(spec, dict) and set(spec) <= {"low", "high", "step", "log"} and {"low", "high"} <= set(spec):
        low, high, step, log = spec["low"], spec["high"], spec.get("step", 1), spec.get("log", False)
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step))
        if not ints or not 1 <= low <= high or step < 1 or not isinstance(log, bool):
            raise ConfigError(key, spec, allowed)
        if high >= 2**63 or (not log and (high - low) // step >= MAX_CHOICES):
            raise ConfigError(key, spec, f"a range of at most {MAX_CHOICES} values below 2**63")
        if log:
            first = 2 ** math.ceil(math.log2(low))
            return [v for v in (first * 2**i for i in range(64)) if v <= high]
        return list(range(low, high + 1, step))
    raise ConfigError(key, spec, allowed)


def keep(key: str, values: list[int], ok: Any, why: str) -> list[int]:
    kept = [v for v in values if ok(v)]
    if not kept:
        raise ConfigError(key, values, f"at least one value that satisfies: {why}")
    return kept


def finite_positive(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return 0 < float(v) < math.inf
    except OverflowError:
        return False


def backward_weights_choices(spec: Any) -> tuple[str, ...]:
    """The space's ``backward_weights``: absent (or null) -- the run's own value, no dimension -- or a
    non-empty list of the schema's values, kept in their order without repeats."""
    if spec is None:
        return ()
    allowed = (
        "absent (the run's pipeline.backward_weights), or a non-empty list of: "
        + ", ".join(BACKWARD_WEIGHTS)
        + " (PACI's choices; two make a dimension, one fixes it)"
    )
    if not isinstance(spec, list) or not spec or any(not isinstance(v, str) or v not in BACKWARD_WEIGHTS for v in spec):
        raise ConfigError("space.backward_weights", spec, allowed)
    return tuple(v for v in BACKWARD_WEIGHTS if v in spec)


def chunks_choices(spec: Any) -> tuple[int, ...]:
    """The space's ``chunks`` (interleaved's v choices): absent -- ``[2]``, :data:`DEFAULT_CHUNKS` -- or
    integers >= 2. Like ``backward_weights`` (PACI's only), it is a dimension of one study and changes
    no other: a space without ``interleaved`` may carry it unused, as a shipped space may."""
    if spec is None:
        return (DEFAULT_CHUNKS,)
    values = int_choices("space.chunks", spec)
    if min(values) < 2:
        raise ConfigError(
            "space.chunks", spec, "integers >= 2 (v model chunks per stage of interleaved 1F1B; v = 1 is 1f1b)"
        )
    return tuple(values)


def lr_space(spec: Any) -> tuple[Any, bool]:
    allowed = "absent, a list of positive numbers, or {low, high, log}"
    if spec is None:
        return None, False
    if isinstance(spec, list):
        if not spec or not all(finite_positive(v) for v in spec):
            raise ConfigError("space.lr_scale", spec, allowed)
        return tuple(sorted({float(v) for v in spec})), False
    if isinstance(spec, dict) and {"low", "high"} <= set(spec) <= {"low", "high", "log"}:
        low, high, log = spec["low"], spec["high"], spec.get("log", True)
        nums = all(finite_positive(v) for v in (low, high))
        if not nums or not 0 < low < high or not isinstance(log, bool):
            raise ConfigError("space.lr_scale", spec, allowed)
        return (float(low), float(high), log), True
    raise ConfigError("space.lr_scale", spec, allowed)


def lr_grid(scales: Any, is_range: bool) -> list[float] | dict[str, float]:
    """The LR scales a space searches, as the edge rule reads them (:mod:`paci_tune.verdict.edges`): its
    choices, ``{low, high}`` of a range, or ``[1.0]`` where the space has no ``lr_scale``."""
    if scales is None:
        return [1.0]
    if is_range:
        return {"low": float(scales[0]), "high": float(scales[1])}
    return [float(x) for x in scales]
