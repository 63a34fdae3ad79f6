"""What a checkpoint must match to continue a run: the settings that change its numbers.

A run resumed from its own checkpoint (``--resume``) must compute exactly what the run that wrote
it would have; so its config's numerics -- model, data, optimizer, LR schedule, pipeline layout and
the budget the schedule decays over -- are recorded in the checkpoint and compared on resume. What
changes only how a run executes (the runtime, the device, where checkpoints go) is left out, and so
are the optimizer's keys the chosen optimizer does not read (:meth:`~paci_tune.config.optimizer.
OptimizerConfig.settings`). A key a checkpoint predates (written by an older version) matches when
this run leaves it at what the older version ran: its default, or :data:`PREDATED`'s value. May import:
:mod:`paci_tune.config`, :mod:`paci_tune.data` (the default draw).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.schema import LRScheduleConfig, PipelineConfig, RunConfig, TrainingConfig
from ..data.stream import DEFAULT_DRAW

EXECUTION_ONLY = {
    "pipeline": {"runtime", "device", "backend", "torch_schedule"},
    "training": {"checkpoint_every", "checkpoint_dir", "keep_checkpoints", "steps", "seconds", "init_from"},
}
"""Settings that change how a run executes but not its numbers: a run may resume under others."""

_SECTIONS = {"training": TrainingConfig, "lr_schedule": LRScheduleConfig, "pipeline": PipelineConfig}

PREDATED = {("data", "draw"): "microbatch"}
"""Keys older versions did not write, with what those versions ran: the data stream drew micro-batches
until 2026-12-04 (:data:`paci_tune.data.stream.DRAWS`), so an older checkpoint resumes only a run that
draws them too (``data.draw: microbatch``, the default)."""


def fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The part of a config a checkpoint must match to resume with the same numerics."""
    doc = cfg.to_dict()
    doc.pop("hardware", None)  # the device budget refuses runs; it changes no number of one that runs
    for section, keys in EXECUTION_ONLY.items():
        doc[section] = {k: v for k, v in doc[section].items() if k not in keys}
    doc["data"] = {**doc["data"], "draw": cfg.data.get("draw", DEFAULT_DRAW)}  # the draw in effect, always
    doc["optimizer"] = cfg.optimizer.settings()
    doc["budget"] = {"steps": cfg.training.steps, "seconds": cfg.training.seconds}
    return doc


def _default(path: list[str]) -> Any:
    """What a checkpoint that lacks a key ran: :data:`PREDATED`'s value, else the schema's default of a
    section key (``dataclasses.MISSING`` when it has none)."""
    if tuple(path) in PREDATED:
        return PREDATED[(path[0], path[1])]
    if len(path) != 2 or path[0] not in _SECTIONS:
        return dataclasses.MISSING
    field = {f.name: f for f in dataclasses.fields(_SECTIONS[path[0]])}.get(path[1])
    return dataclasses.MISSING if field is None else field.default


def mismatch(theirs: Any, mine: Any, path: str = "") -> str | None:
    """Where a checkpoint's fingerprint (``theirs``) and this run's (``mine``) differ, or None.

    Only this run's keys count: a key the checkpoint has that this version no longer compares (an
    optimizer key its optimizer ignores) does not, and one it lacks stands for what its version ran
    (:func:`_default`).
    """
    if isinstance(theirs, dict) and isinstance(mine, dict):
        for k in sorted(mine):
            where = f"{path}.{k}" if path else str(k)
            ran = theirs[k] if k in theirs else _default(where.split("."))
            m = mismatch(None if ran is dataclasses.MISSING else ran, mine[k], where)
            if m:
                return m
        return None
    a = list(theirs) if isinstance(theirs, tuple) else theirs
    b = list(mine) if isinstance(mine, tuple) else mine
    return None if a == b else f"{path}: checkpoint has {a!r}, this run has {b!r}"
