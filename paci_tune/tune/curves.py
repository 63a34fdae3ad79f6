"""Which runs train the same curve: a trial's numerics key.

On the ``sim`` and ``rst`` clocks a trial's time to target is its layout's clock read against its
loss curve, and many layouts train the very same curve (measured 2026-12-04, ``tests/test_curves.py``):

- **synchronous schedules** (1f1b, gpipe, zb-h1, interleaved) compute plain gradient accumulation
  over the global batch: their curve is the same at every P, D, a, cut and chunk count, and at every
  b too when the stream draws sequences (``data.draw: sequence``, :mod:`paci_tune.data.stream`); with
  the default draw each micro-batch draws its own b windows, and b stays in the key;
- **PACI** on one stage is flush (nothing is in flight, so no control acts): the same curve, to the bit;
- **PACI**'s on two or more depends on P and a (its staleness), its cut (which units are how stale), ``inflight``,
  ``backward_weights`` and the staleness controls, and, when the stream draws sequences, not on D or b
  at a fixed P, a and cut (a cut left ``auto`` is chosen from b and D, so such a key keeps them).

Everything else that changes a number changes the key: model, data, seed, global batch, optimizer
settings, LR schedule, the device type and precision runs resolve to (CPU and CUDA differ in the last
bits), the validation set, and the warm start's checkpoint (its path and its files' sizes and times).

**The LR schedule's horizon.** On a budget in seconds the schedule decays over the run's own clock
(:meth:`paci_tune.train.loop.Trainer.progress`), so two layouts of one global batch, whose steps take
different times, follow different LRs from their first step on: their curves differ unless
``lr_schedule.horizon_steps`` puts the decay in steps. Without it the key keeps the clock, the profile,
the budget and the layout: a curve shared only with the same run. A run whose LR reads the wall
clock has no key (its numbers depend on how fast its machine was); one on a step budget has one, though
a search never shares a wall-clock trial's curve: its time is its own measurement.

The key is a digest of a canonical document (:func:`numerics_doc`), so it is the same on every worker
of a study and in every process. May import: :mod:`paci_tune.train` (the checkpoint fingerprint),
:mod:`paci_tune.pipeline` (the device and precision a run resolves to), :mod:`paci_tune.config`,
:mod:`paci_tune.schedule` (a schedule's curve class).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..config.schema import RunConfig
from ..pipeline.factory import resolve_device, resolve_precision
from ..schedule.registry import SYNCHRONOUS_CURVE, schedule_of
from ..train.fingerprint import fingerprint

LAYOUT = (
    "schedule",
    "stages",
    "window",
    "microbatch_size",
    "data_parallel",
    "inflight",
    "partition",
    "chunks",
    "backward_weights",
    "stage_momentum",
    "predict_weights",
    "stale_lr",
)
"""The pipeline keys a synchronous schedule's numbers do not read (PACI's controls are None there)."""

PACI_FREE = ("microbatch_size", "data_parallel")
"""The pipeline keys PACI's numbers do not read at a fixed depth and window."""

EVALUATION = ("eval_every", "eval_every_seconds", "eval_far_every", "eval_microbatch_size", "target_val_loss")
"""When a run validates and when it stops: where its curve is read, not what it is."""


def numerics_doc(cfg: RunConfig) -> dict[str, Any] | None:
    """The canonical document a curve depends on (module docstring); None when the LR reads the wall clock."""
    t, horizon = cfg.training, cfg.lr_schedule.horizon_steps
    reads_clock = horizon is None and t.seconds is not None
    if reads_clock and t.clock == "wall":
        return None
    doc = fingerprint(cfg)
    training = {k: v for k, v in doc["training"].items() if k not in EVALUATION}
    if not reads_clock:
        training.pop("clock", None)
        training.pop("profile", None)
    doc["training"] = training
    if horizon is not None:
        doc["budget"] = {}  # the LR decays over its horizon; the budget only ends the curve
    elif not reads_clock:
        doc["budget"] = {"steps": t.steps}
    p = cfg.pipeline
    device = resolve_device(p.device)
    pipeline = {**doc["pipeline"], "device": device.type, "precision": resolve_precision(p.precision, device)}
    if not reads_clock:  # else the clock reads the layout, and every key of it stays
        by_sequence = doc["data"]["draw"] == "sequence"  # else each micro-batch's b windows: b decides the data
        spec = schedule_of(p.schedule)
        if spec.synchronous or p.stages == 1:  # PACI on one stage has nothing in flight: flush
            kept = {} if by_sequence else {"microbatch_size": p.microbatch_size}
            pipeline = {k: v for k, v in pipeline.items() if k not in LAYOUT} | kept | {"numerics": SYNCHRONOUS_CURVE}
        elif spec.asynchronous and isinstance(p.partition, list) and by_sequence:  # "auto": b, D decide the cut
            pipeline = {k: v for k, v in pipeline.items() if k not in PACI_FREE}
    doc["pipeline"] = pipeline
    if t.init_from:
        doc["init_from"] = checkpoint_identity(Path(t.init_from))
    return doc


def numerics_key(cfg: RunConfig) -> str | None:
    """A short digest of :func:`numerics_doc`: equal keys, equal curves (None: the LR reads the wall clock)."""
    doc = numerics_doc(cfg)
    if doc is None:
        return None
    text = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def checkpoint_identity(path: Path) -> dict[str, Any]:
    """A warm start's checkpoint as a key reads it: its resolved path and each file's size and time
    (a checkpoint written again, even in place, is another start)."""
    root = path.resolve()
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else []
    return {
        "path": str(root),
        "files": [[str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }
