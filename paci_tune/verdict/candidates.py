"""The ranked table of candidates: each schedule's best points and what the device budget dropped.

DeepSpeed's autotuner and NeMo's auto-configurator end with such a table, and a user reads it to see
how close the runners-up came, what each costs in step time and memory, and which layouts never ran
because they do not fit. Per schedule, the ``top`` best finished search trials with distinct points
(repeats are not evidence), each with its step time on the search's clock (the profile's prediction
on the rst and sim clocks), its predicted peak per device (the most loaded stage), its score and
whether it reached the target. The single draws of a search, so an anecdote where the confirmation
did not run: the verdict's intervals are in ``confirmation``. May import: optuna and the tune layer's
:mod:`~paci_tune.tune.extra`, :mod:`~paci_tune.tune.point`, :mod:`~paci_tune.tune.record`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from ..tune.extra import best_distinct
from ..tune.point import MemoryDrop, TrialParams
from ..tune.record import TrialRecord

TOP = 5
"""Rows per schedule: enough to see the runners-up, few enough to read."""


def _peak(record: TrialRecord) -> int | None:
    per_stage = record.figure("predicted_peak_memory_bytes")
    return max(per_stage) if isinstance(per_stage, list) and per_stage else None


def ranked(
    studies: dict[str, optuna.Study], point_of: Callable[[FrozenTrial, str], TrialParams], top: int = TOP
) -> dict[str, list[dict[str, Any]]]:
    """``{schedule: rows}``, best first; a schedule with no finished trial has no rows."""
    out: dict[str, list[dict[str, Any]]] = {}
    for schedule, study in studies.items():
        by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
        rows = []
        for rank, number in enumerate(best_distinct(study, top), start=1):
            t = by_number[number]
            r, p = TrialRecord.read(t), point_of(t, schedule)
            rows.append(
                {
                    "rank": rank,
                    "trial": number,
                    "point": p.label(),
                    "stages": p.stages,
                    "data_parallel": p.data_parallel,
                    "window": p.window,
                    "microbatch_size": p.microbatch_size,
                    "lr_scale": p.lr_scale,
                    "step_time_s": r.figure("clock_step_time_s"),
                    "predicted_peak_bytes": _peak(r),
                    "score": t.value,
                    "reached_target": r.time_to_target is not None,
                }
            )
        out[schedule] = rows
    return out


def memory_section(written: Any, cap: int | None, drops: tuple[MemoryDrop, ...]) -> dict[str, Any] | None:
    """best.yaml's ``memory``: the budget as written and in bytes, and every (schedule, point) it dropped."""
    if cap is None:
        return None
    return {"memory": written, "memory_bytes": cap, "dropped": [d.to_doc() for d in drops]}
