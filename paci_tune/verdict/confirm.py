"""Confirmation: the best few points of each schedule trained again on fresh seeds, ranked by their mean.

A search picks the best of many single noisy draws, so its winner's score is biased low (the
winner's curse). Before recommending, the ``search.confirm.top`` best distinct points of each
schedule are trained again with ``search.confirm.seeds`` fresh seeds (each a different model
initialisation and data order: ``training.seed`` + 1, + 2, ...), the same seeds for every point and
schedule, so PACI and flush are compared seed by seed. The search's own draw is not in the mean:
it is the one that was selected. Confirmation trials are ordinary trials of the study (enqueued with
the point's parameters and a ``confirm`` attribute by :mod:`paci_tune.tune.extra`; resumable; never
pruned; not counted against ``search.trials``). This module reads them back.

``speedup_vs_flush`` is the ratio of the two schedules' mean scores, with a percentile bootstrap
interval over the paired seeds; the verdict is ``paci`` or ``flush`` only when the interval
excludes 1, else ``tie`` -- and :data:`UNDECIDED` when a confirmed run of either compared point missed
the target, since then the ratio compares not-reached penalties, not times to accuracy. May
import: optuna, numpy, :mod:`paci_tune.tune` (the point, the trial record, the plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from ..tune.extra import retried_numbers
from ..tune.point import TrialParams
from ..tune.record import StudyRecord, TrialRecord
from ..tune.rounds import BOOTSTRAP_DRAWS, paired_ratio


@dataclass
class Confirmed:
    """One confirmed point: its score per fresh seed (inf for a failed run), their mean and spread."""

    trial: int  # the search trial whose point this is
    params: TrialParams
    scores: dict[int, float] = field(default_factory=dict)
    time_to_target: dict[int, float | None] = field(default_factory=dict)
    trials: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return bool(self.scores)

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.scores.values()))) if self.scores else math.inf

    @property
    def std(self) -> float:
        vals = list(self.scores.values())
        return float(np.std(vals, ddof=1)) if len(vals) > 1 and all(map(math.isfinite, vals)) else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "point": self.params.label(),
            "seeds": {
                s: {"score": self.scores[s], "time_to_target": self.time_to_target.get(s), "trial": self.trials[s]}
                for s in sorted(self.scores)
            },
            "mean": self.mean,
            "std": self.std,
        }


def confirmed(study: optuna.Study, schedule: str, seeds: list[int], params_of: Any) -> list[Confirmed]:
    """The study's confirmed points in plan order, with every seed that has finished."""
    numbers = StudyRecord.read(study).confirm_plan or []
    trials = study.get_trials(deepcopy=False)
    by_number, retried = {t.number: t for t in trials}, retried_numbers(trials)
    out = {n: Confirmed(n, params_of(by_number[n], schedule)) for n in numbers}
    for t in trials:
        r = TrialRecord.read(t)
        if (
            r.confirm_of is None
            or r.confirm_of not in out
            or r.seed not in seeds
            or t.state not in (TrialState.COMPLETE, TrialState.FAIL)
        ):
            continue
        if t.number in retried:
            continue  # an interrupted run that was queued again: its retry counts
        point, seed = out[r.confirm_of], int(r.seed)  # type: ignore[arg-type]
        if seed in point.scores and t.state == TrialState.FAIL:
            continue  # a duplicate (two workers queued the same seed): a finished run wins
        point.scores[seed] = float(t.value) if t.state == TrialState.COMPLETE and t.value is not None else math.inf
        point.time_to_target[seed] = r.time_to_target
        point.trials[seed] = t.number
    return [out[n] for n in numbers]


def paired_speedup(flush: Confirmed, paci: Confirmed, draws: int = BOOTSTRAP_DRAWS) -> tuple[float, float, float]:
    """Flush's mean score over PACI's, and a percentile bootstrap interval over the seeds both ran."""
    return paired_ratio(flush.scores, paci.scores, draws)


UNDECIDED = "undecided"
"""The verdict when a compared run missed the target: its score is the not-reached penalty (a final
loss turned into seconds), so a ratio of scores is not a ratio of times to accuracy."""


def what_to_change(warm_started: bool) -> str:
    """The advice of an undecided verdict: a longer budget, a looser target, a (longer) warm start."""
    warm = ("a longer warm-up (search.warm_start.steps)" if warm_started else
            "a warm start from a checkpoint of the run past its first phase (search.warm_start)")  # fmt: skip
    return (
        f"what to change: a longer budget (budget.seconds or training.steps), a looser target (target.value), or {warm}"
    )


def missed(point: Confirmed) -> int:
    """How many of the point's confirmed runs did not reach the target."""
    return sum(point.time_to_target.get(s) is None for s in point.scores)


def verdict(low: float, high: float) -> str:
    """``paci`` when the whole interval is above 1, ``flush`` when below, otherwise ``tie``."""
    if low > 1.0:
        return "paci"
    if high < 1.0:
        return "flush"
    return "tie"
