"""A search space's optimizer and staleness choices: parsed, expanded into labelled recipes, turned into overrides.

A space may tune the optimizer every schedule trains with, and PACI's staleness controls::

    optimizer:                     # every schedule's study, the same choices (a baseline tuned as hard)
      name: [adamw, nadam, muon]
      betas: [[0.9, 0.95], [0.99, 0.999]]   # adamw, nadam (and muon's AdamW part)
      momentum_decay: [0.004, 0.04]         # nadam
      momentum: [0.95]                      # muon, sgd
    staleness:                     # PACI's study only (no effect on a synchronous schedule)
      stage_momentum: [null, 0.995]
      predict_weights: [false, true]
      stale_lr: [null, 0.5]

Each is expanded into **recipes**, one per combination of the values each optimizer reads (a key an
optimizer ignores does not multiply its recipes; a key left out keeps the run's own value), and a
recipe is one categorical value of the study: its label names it in full and is parsed back into
the run's overrides, so a stored trial needs nothing but its label (``nadam betas=0.99,0.999
momentum_decay=0.004``; staleness ``stage_momentum=0.995 predict_weights`` or ``off``). One recipe
fixes it for every trial; none (the key absent) leaves the run's own. May import:
:mod:`paci_tune.config`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..config.optimizer import OPTIMIZERS
from ..errors import ConfigError

READS = {"adamw": ("betas",), "sgd": ("momentum",), "nadam": ("betas", "momentum_decay"), "muon": ("momentum", "betas")}
"""The space's optimizer keys each optimizer reads (muon's ``betas`` are its AdamW part's)."""
OPTIMIZER_KEYS = ("name", "betas", "momentum_decay", "momentum")
STALENESS_KEYS = ("stage_momentum", "predict_weights", "stale_lr")
OFF = "off"
"""The staleness recipe with every control off."""


def _list(key: str, spec: Any, ok: Any, allowed: str) -> list[Any]:
    if not isinstance(spec, list) or not spec or not all(ok(v) for v in spec):
        raise ConfigError(key, spec, f"a non-empty list of {allowed}")
    out: list[Any] = []
    for v in spec:
        if v not in out:
            out.append(v)
    return out


def _unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1


def _stage_momentum(v: Any) -> bool:
    return v is None or (_unit(v) and v > 0)


def _horizon(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1)


def _number(v: float) -> str:
    return f"{float(v):g}"


def optimizer_recipes(spec: Any) -> tuple[str, ...]:
    """The space's ``optimizer`` section expanded into recipe labels (module docstring); () when absent."""
    if spec is None:
        return ()
    if not isinstance(spec, dict) or any(k not in OPTIMIZER_KEYS for k in spec) or "name" not in spec:
        raise ConfigError(
            "space.optimizer",
            spec,
            "a mapping with name (a list of optimizers) and optionally " + ", ".join(OPTIMIZER_KEYS[1:]),
        )
    names = _list(
        "space.optimizer.name", spec["name"], lambda v: v in OPTIMIZERS, "optimizers: " + ", ".join(OPTIMIZERS)
    )
    values: dict[str, list[str]] = {}
    if "betas" in spec:
        pairs = _list(
            "space.optimizer.betas",
            spec["betas"],
            lambda v: isinstance(v, list) and len(v) == 2 and all(_unit(b) for b in v),
            "[beta1, beta2] pairs, each in [0, 1)",
        )
        values["betas"] = [",".join(_number(b) for b in pair) for pair in pairs]
    if "momentum_decay" in spec:
        positive = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0  # noqa: E731
        psis = _list("space.optimizer.momentum_decay", spec["momentum_decay"], positive, "positive numbers")
        values["momentum_decay"] = [_number(v) for v in psis]
    if "momentum" in spec:
        values["momentum"] = [
            _number(v) for v in _list("space.optimizer.momentum", spec["momentum"], _unit, "numbers in [0, 1)")
        ]
    out = []
    for name in names:
        keys = [k for k in READS[name] if k in values]
        for combo in itertools.product(*(values[k] for k in keys)):
            out.append(" ".join([name, *(f"{k}={v}" for k, v in zip(keys, combo, strict=True))]))
    return tuple(out)


def staleness_recipes(spec: Any) -> tuple[str, ...]:
    """The space's ``staleness`` section expanded into recipe labels (module docstring); () when absent."""
    if spec is None:
        return ()
    if not isinstance(spec, dict) or not spec or any(k not in STALENESS_KEYS for k in spec):
        raise ConfigError("space.staleness", spec, "a mapping of any of: " + ", ".join(STALENESS_KEYS))
    lists = []
    for key in STALENESS_KEYS:
        if key == "predict_weights":
            vals = _list(
                f"space.staleness.{key}", spec.get(key, [False]), lambda v: isinstance(v, bool), "true or false"
            )
            lists.append(["predict_weights" if v else None for v in vals])
        else:
            ok = _stage_momentum if key == "stage_momentum" else _horizon
            what = "null or numbers in (0, 1)" if key == "stage_momentum" else "null or numbers in (0, 1]"
            lists.append(
                [
                    None if v is None else f"{key}={_number(v)}"
                    for v in _list(f"space.staleness.{key}", spec.get(key, [None]), ok, what)
                ]
            )
    return tuple(" ".join(p for p in combo if p) or OFF for combo in itertools.product(*lists))


def recipe_overrides(optimizer: str | None, staleness: str | None) -> dict[str, Any]:
    """The dotted run overrides of an optimizer recipe and a staleness recipe (None: the run's own)."""
    out: dict[str, Any] = {}
    if optimizer is not None:
        name, *pairs = optimizer.split(" ")
        out["optimizer.name"] = name
        for pair in pairs:
            key, value = pair.split("=", 1)
            out[f"optimizer.{key}"] = [float(v) for v in value.split(",")] if key == "betas" else float(value)
    if staleness is not None:
        out.update({"pipeline.stage_momentum": None, "pipeline.predict_weights": False, "pipeline.stale_lr": None})
        for part in [] if staleness == OFF else staleness.split(" "):
            key, _, value = part.partition("=")
            out[f"pipeline.{key}"] = True if key == "predict_weights" else float(value)
    return out
