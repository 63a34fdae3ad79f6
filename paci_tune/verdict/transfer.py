"""The transfer check: does the ranking of the short search trials survive a longer run?

A search ranks points by trials of ``budget.seconds``; that is only worth something if the
ranking holds at the budget the winner is trained for afterwards. With ``search.transfer_check:
{top: k, factor: f}`` the ``k`` best distinct finished search points of each schedule (the
confirmation's notion of "best" and "distinct point": :func:`paci_tune.tune.extra.best_distinct`) are trained
once more at ``f`` x the trial budget on the same clock, on the search trial's own seed
(``training.seed``), with the LR schedule decaying over the longer budget (No Train No Gain: the
run's ``training.seconds`` is the longer budget and the schedule follows progress through it).
``best.yaml`` then carries, per schedule and over both pooled, Spearman's rank correlation between
the points' short-budget scores and their long-budget ones (:func:`section`).

**When.** Once every study's search is over (its quota met, none of its search trials running)
*and* no confirmation is queued: the confirmation decides the recommendation, the transfer check
only reports on the search, so a search killed during the (longer) transfer runs already has its
recommendation's evidence complete, and a search without confirmation starts it right after the
quota. The plan is fixed on the first look (the study's ``transfer_plan`` attribute), as the
confirmation's is, so every worker agrees on it.

**The grid.** The validation *spacing* is kept (``budget.seconds / budget.grid``): a long run is
validated ``ceil(grid * f)`` times, so its time to target has the same resolution as a short
trial's (keeping the grid count instead would make a long run's validations ``f`` times coarser,
and its time to target with them). A long run's score is the objective on the longer budget: its
time to target, or ``f * B * (1 + excess / target)`` when it misses.

**Bookkeeping.** Transfer trials are ordinary trials of the study, enqueued with the point's
parameters and a ``transfer: {of, factor}`` attribute: resumable (a killed search queues only what
is missing; an interrupted one is retried as a transfer trial), never pruned, never answered from an
earlier trial of the same point, not counted against ``search.trials``, and left out of the search's
ranking, the confirmation plan and the recommendation (:mod:`paci_tune.tune.extra` plans and queues
them; this module reads them back). Their validations
are not reported to Optuna: values on another budget's scale would mislead a pruner comparing search
trials at the same step (the curve is in the trial's ``curve`` attribute). A run that fails scores
inf at the long budget (it ranks last), as a failed confirmation seed does. One thing is not hidden:
Optuna's samplers read every finished trial of a study, so a search resumed with a larger
``search.trials`` after its check samples with the long runs in view (as with confirmation runs).
May import: optuna,
numpy, :mod:`paci_tune.tune` (the point, the trial record, the plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from ..tune.extra import retried_numbers
from ..tune.point import TrialParams
from ..tune.record import StudyRecord, TrialRecord


# --------------------------------------------------------------------------------- Spearman
def average_ranks(x: Any) -> np.ndarray:
    """Ranks 1..n of ``x``, ties sharing the mean of the ranks they span (inf ranks last)."""
    a = np.asarray(x, dtype=float)
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based rank of each distinct value's first element
    return (first + (counts + 1) / 2.0)[inverse.reshape(-1)]


def undefined(x: Any, y: Any) -> str | None:
    """Why Spearman's correlation of ``x`` and ``y`` is undefined, or None when it is defined."""
    if len(x) < 2:
        return f"{len(x)} point(s): a rank correlation needs at least 2"
    if len(set(map(float, x))) < 2:
        return "the short-budget scores are all equal: no ranking to compare"
    if len(set(map(float, y))) < 2:
        return "the long-budget scores are all equal: no ranking to compare"
    return None


def spearman(x: Any, y: Any) -> float | None:
    """Spearman's rho: Pearson's correlation of the average ranks; None where undefined (:func:`undefined`)."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} and {len(y)} values")
    if undefined(x, y) is not None:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    dx, dy = rx - rx.mean(), ry - ry.mean()
    return float(np.sum(dx * dy) / math.sqrt(float(np.sum(dx * dx)) * float(np.sum(dy * dy))))


# --------------------------------------------------------------------------------- best.yaml
def points(study: optuna.Study, factor: float, label_of: Callable[[FrozenTrial], TrialParams]) -> list[dict[str, Any]]:
    """The planned points whose long run finished, in plan order: the short and the long score of each."""
    trials = study.get_trials(deepcopy=False)
    by_number, retried = {t.number: t for t in trials}, retried_numbers(trials)
    long: dict[int, tuple[FrozenTrial, TrialRecord]] = {}
    for t in trials:
        r = TrialRecord.read(t)
        if r.transfer_of is None or r.factor != float(factor) or t.number in retried:
            continue
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        n = r.transfer_of
        if n in long and (long[n][0].state == TrialState.COMPLETE or t.state == TrialState.FAIL):
            continue  # a duplicate (two workers queued the same run): a finished run wins, then the first
        long[n] = (t, r)
    out = []
    for n in StudyRecord.read(study).transfer_plan or []:
        if n not in long or n not in by_number or by_number[n].value is None:
            continue
        t, r = long[n]
        ok = t.state == TrialState.COMPLETE and t.value is not None
        row = {
            "trial": n,
            "point": label_of(by_number[n]).label(),
            "short": float(by_number[n].value),
            "long": float(t.value) if ok else math.inf,
            "long_trial": t.number,
            "long_time_to_target": r.time_to_target,
        }
        if not ok:
            row["long_failed"] = r.fail_reason or "failed"
        out.append(row)
    return out


def _rho(rows: list[dict[str, Any]]) -> dict[str, Any]:
    x, y = [r["short"] for r in rows], [r["long"] for r in rows]
    rho = spearman(x, y)
    out: dict[str, Any] = {"spearman": None if rho is None else round(rho, 6), "n": len(rows)}
    if rho is None:
        out["note"] = undefined(x, y)
    return out


def section(
    studies: dict[str, optuna.Study],
    factor: float,
    seconds: float | None,
    point_of: Callable[[FrozenTrial, str], TrialParams],
) -> dict[str, Any]:
    """``best.yaml``'s ``transfer_check``: per schedule its points and rho, and rho over both pooled."""
    doc: dict[str, Any] = {"factor": factor, "seconds": None if seconds is None else float(seconds) * factor}
    pooled: list[dict[str, Any]] = []
    for schedule, study in studies.items():
        rows = points(study, factor, lambda t, s=schedule: point_of(t, s))
        doc[schedule] = {**_rho(rows), "points": rows}
        pooled += rows
    doc["pooled"] = _rho(pooled)
    return doc


def summary_line(doc: dict[str, Any] | None) -> str | None:
    """One line for the search's final summary: rho per schedule and pooled (None without a check)."""
    if not doc:
        return None

    def one(d: dict[str, Any]) -> str:
        rho = d.get("spearman")
        return f"{rho:.3g} ({d.get('n')} points)" if rho is not None else f"n/a ({d.get('note')})"

    parts = [f"{s} {one(d)}" for s, d in doc.items() if isinstance(d, dict) and s != "pooled"]
    return f"transfer check ({doc['factor']:g}x the trial budget): Spearman of short vs long scores " + "; ".join(
        [*parts, f"pooled {one(doc['pooled'])}"]
    )
