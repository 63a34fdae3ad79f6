"""Confirmation: the compared points trained again on fresh seeds, read back per seed.

A search picks the best of many single noisy draws, so its winner's score is biased low (the
winner's curse). Before recommending, the ``search.confirm.top`` best distinct points of PACI's study
and of the strongest synchronous study are trained again with at least ``search.confirm.seeds`` fresh
seeds (each a different model initialisation and data order: ``training.seed`` + 1, + 2, ...), the
same seeds for every point, so PACI and its baseline are compared seed by seed. The search's own draw
is not among them: it is the one that was selected. Confirmation trials are ordinary trials of the
study (enqueued with the point's parameters and a ``confirm`` attribute by :mod:`paci_tune.tune.extra`;
resumable; never pruned; not counted against ``search.trials``). This module reads them back.

The verdict reads two of these rows, one per side, with the sequential paired test
(:mod:`.compare`, :mod:`paci_tune.tune.comparison`). May import: optuna, numpy, :mod:`paci_tune.tune`
(the point, the trial record, the plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna

from ..tune.point import TrialParams
from ..tune.record import StudyRecord
from ..tune.rounds import confirmed_runs


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
    """The study's confirmed points in plan order, with every seed of ``seeds`` that has finished."""
    numbers = StudyRecord.read(study).confirm_plan or []
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    out = []
    for n in numbers:
        point = Confirmed(n, params_of(by_number[n], schedule))
        for seed, run in sorted(confirmed_runs(study, n).items()):
            if seed in seeds:
                point.scores[seed], point.time_to_target[seed], point.trials[seed] = (
                    run.score,
                    run.time_to_target,
                    run.trial,
                )
        out.append(point)
    return out


def what_to_change(warm_started: bool) -> str:
    """The advice of an undecided verdict: a longer budget, a looser target, a (longer) warm start."""
    warm = (
        "a longer warm-up (search.warm_start.steps)"
        if warm_started
        else "a warm start from a checkpoint of the run past its first phase (search.warm_start)"
    )
    return (
        f"what to change: a longer budget (budget.seconds or training.steps), a looser target (target.value), or {warm}"
    )
