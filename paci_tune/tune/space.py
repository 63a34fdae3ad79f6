"""Search spaces: ``search_spaces/*.yaml`` parsed, constrained and handed to Optuna.

A space lists the pipeline depth P (``stages``), the micro-batch size and, when the global batch
is ``free``, the window ``a``; optionally an LR scale. Each is a list of choices or a range
(``{low, high}``, ``step``, or ``log: true`` for powers of two / a log-uniform float).

Constraints are applied once, when the space is bound to a run, so the sampler only ever sees
feasible values and the grid is finite:

- ``global_batch: fixed`` -- a * micro-batch size = the run's global batch: the micro-batch size
  must divide it and the window follows from it (or the other way round);
- ``global_batch: free`` -- a and micro-batch size are searched independently; the LR follows the
  batch through ``lr_schedule.reference_batch`` scaling;
- P <= the model's units (a stage holds at least one), and P <= ``hardware.devices`` when the
  clock is the wall (the sim and rst clocks model one device per stage). May import: optuna,
:mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from ..base.files import read_mapping
from ..base.shipped import resolve_path, shipped, shipped_names
from ..errors import ConfigError

SCHEDULES = ("paci", "1f1b")
MAX_CHOICES = 10_000
"""Values one integer range may expand to: each is a point of a finite grid the search enumerates."""
_KEYS = ("description", "schedules", "global_batch", "stages", "microbatch_size", "window", "lr_scale")


@dataclass(frozen=True)
class TrialParams:
    """One point of the space: everything a trial changes in the run configuration."""

    schedule: str
    stages: int
    window: int
    microbatch_size: int
    lr_scale: float = 1.0

    @property
    def global_batch(self) -> int:
        return self.window * self.microbatch_size

    def overrides(self) -> dict[str, Any]:
        """Dotted run-config overrides (``pipeline.window`` ...) that make a run this point."""
        return {
            "pipeline.schedule": self.schedule,
            "pipeline.stages": self.stages,
            "pipeline.window": self.window,
            "pipeline.microbatch_size": self.microbatch_size,
            "training.global_batch": self.global_batch,
        }

    def label(self) -> str:
        lr = f" lr x{self.lr_scale:.2g}" if self.lr_scale != 1.0 else ""
        return f"{self.schedule} P={self.stages} a={self.window} b={self.microbatch_size}{lr}"


@dataclass(frozen=True)
class SearchSpace:
    """A space bound to one run: every integer dimension is a finite, feasible list of choices."""

    name: str
    schedules: tuple[str, ...]
    fixed_batch: int | None  # the global batch when fixed, else None
    stages: tuple[int, ...]
    microbatch_size: tuple[int, ...]
    window: tuple[int, ...]  # empty when fixed: derived from the micro-batch size
    lr_scale: tuple[float, ...] | tuple[float, float, bool] | None  # choices, (low, high, log) or None
    lr_is_range: bool = False

    def suggest(self, trial: optuna.trial.BaseTrial, schedule: str) -> TrialParams:
        """Ask Optuna for one point; ``schedule`` is fixed by the study the trial belongs to."""
        stages = int(trial.suggest_categorical("stages", list(self.stages)))
        b = int(trial.suggest_categorical("microbatch_size", list(self.microbatch_size)))
        if self.fixed_batch is not None:
            a = self.fixed_batch // b
        else:
            a = int(trial.suggest_categorical("window", list(self.window)))
        lr = 1.0
        if self.lr_scale is not None:
            if self.lr_is_range:
                low, high, log = self.lr_scale  # type: ignore[misc]
                lr = float(trial.suggest_float("lr_scale", float(low), float(high), log=bool(log)))
            else:
                lr = float(trial.suggest_categorical("lr_scale", list(self.lr_scale)))
        return TrialParams(schedule, stages, a, b, lr)

    def grid(self, schedule: str | None = None) -> list[TrialParams]:
        """Every point (of one schedule, or all); a continuous LR range has no grid."""
        if self.lr_is_range:
            raise ConfigError("lr_scale", "a range", "a list of choices for a grid search")
        lrs = list(self.lr_scale) if self.lr_scale is not None else [1.0]
        out = []
        for s in [schedule] if schedule else self.schedules:
            for p, b, lr in itertools.product(self.stages, self.microbatch_size, lrs):
                windows = [self.fixed_batch // b] if self.fixed_batch is not None else list(self.window)
                out += [TrialParams(s, p, a, b, float(lr)) for a in windows]
        return out

    def grid_params(self) -> dict[str, list[Any]]:
        """The search space in the form ``optuna.samplers.GridSampler`` takes."""
        if self.lr_is_range:
            raise ConfigError("search.sampler", "grid", "a space whose lr_scale is a list of choices, not a range")
        out: dict[str, list[Any]] = {"stages": list(self.stages), "microbatch_size": list(self.microbatch_size)}
        if self.fixed_batch is None:
            out["window"] = list(self.window)
        if self.lr_scale is not None:
            out["lr_scale"] = list(self.lr_scale)
        return out

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "schedules": list(self.schedules),
            "global_batch": self.fixed_batch if self.fixed_batch is not None else "free",
            "stages": list(self.stages),
            "microbatch_size": list(self.microbatch_size),
        }
        if self.fixed_batch is None:
            out["window"] = list(self.window)
        if self.lr_scale is not None:
            keys = ("low", "high", "log")
            lr = self.lr_scale
            out["lr_scale"] = dict(zip(keys, lr, strict=True)) if self.lr_is_range else list(lr)
        return out


def resolve_space_path(name: str) -> Path:
    """A space by file path, or by name from the shipped spaces (package data, :mod:`paci_tune.base.shipped`)."""
    p = resolve_path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        return p
    found = shipped("search_spaces", name)
    if found is not None:
        return found
    names = ", ".join(shipped_names("search_spaces"))
    raise ConfigError("search.space", name, f"a YAML file or one of the shipped spaces: {names}")


def load_space(
    name: str,
    *,
    global_batch: int,
    n_units: int,
    max_stages: int | None,
) -> SearchSpace:
    """Read a space file and bind it to a run: apply every constraint, refuse an empty dimension."""
    path = resolve_space_path(name)
    doc = read_mapping(path, "search.space", "keys " + ", ".join(_KEYS))
    for k, v in doc.items():
        if k not in _KEYS:
            raise ConfigError(f"space.{k}", v, "one of: " + ", ".join(_KEYS))
    if not isinstance(doc.get("description", ""), str):
        raise ConfigError("space.description", doc["description"], "a string")
    schedules = doc.get("schedules", list(SCHEDULES))
    if not isinstance(schedules, list) or not schedules or any(s not in SCHEDULES for s in schedules):
        raise ConfigError("space.schedules", schedules, "a non-empty list of: " + ", ".join(SCHEDULES))
    mode = doc.get("global_batch", "fixed")
    if mode not in ("fixed", "free"):
        raise ConfigError("space.global_batch", mode, "fixed (a * micro-batch size = training.global_batch) or free")

    stages = _int_choices("space.stages", doc.get("stages"))
    cap = n_units if max_stages is None else min(n_units, max_stages)
    why = f"at most {n_units} (the model's units)" + (
        f" and at most hardware.devices={max_stages} on the wall clock" if max_stages is not None else ""
    )
    stages = _keep("space.stages", stages, lambda p: p <= cap, why)

    if mode == "fixed":
        if "window" in doc and "microbatch_size" in doc:
            raise ConfigError(
                "space.window", doc["window"], "absent when global_batch is fixed and microbatch_size is given "
                "(a = global_batch / micro-batch size); or set global_batch: free"
            )  # fmt: skip
        if "window" in doc:
            windows = _int_choices("space.window", doc["window"])
            windows = _keep("space.window", windows, lambda a: global_batch % a == 0, f"divisors of {global_batch}")
            sizes = [global_batch // a for a in windows]
        else:
            sizes = _int_choices("space.microbatch_size", doc.get("microbatch_size"))
            sizes = _keep(
                "space.microbatch_size", sizes, lambda b: global_batch % b == 0,
                f"divisors of training.global_batch={global_batch}",
            )  # fmt: skip
        windows = []
        fixed: int | None = global_batch
    else:
        sizes = _int_choices("space.microbatch_size", doc.get("microbatch_size"))
        windows = _int_choices("space.window", doc.get("window"))
        fixed = None

    lr, lr_range = _lr_space(doc.get("lr_scale"))
    return SearchSpace(
        name=path.stem,
        schedules=tuple(schedules),
        fixed_batch=fixed,
        stages=tuple(stages),
        microbatch_size=tuple(sorted(set(sizes))),
        window=tuple(windows),
        lr_scale=lr,
        lr_is_range=lr_range,
    )


def _int_choices(key: str, spec: Any) -> list[int]:
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


def _keep(key: str, values: list[int], ok: Any, why: str) -> list[int]:
    kept = [v for v in values if ok(v)]
    if not kept:
        raise ConfigError(key, values, f"at least one value that satisfies: {why}")
    return kept


def _finite_positive(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return 0 < float(v) < math.inf
    except OverflowError:
        return False


def _lr_space(spec: Any) -> tuple[Any, bool]:
    allowed = "absent, a list of positive numbers, or {low, high, log}"
    if spec is None:
        return None, False
    if isinstance(spec, list):
        if not spec or not all(_finite_positive(v) for v in spec):
            raise ConfigError("space.lr_scale", spec, allowed)
        return tuple(sorted({float(v) for v in spec})), False
    if isinstance(spec, dict) and {"low", "high"} <= set(spec) <= {"low", "high", "log"}:
        low, high, log = spec["low"], spec["high"], spec.get("log", True)
        nums = all(_finite_positive(v) for v in (low, high))
        if not nums or not 0 < low < high or not isinstance(log, bool):
            raise ConfigError("space.lr_scale", spec, allowed)
        return (float(low), float(high), log), True
    raise ConfigError("space.lr_scale", spec, allowed)
