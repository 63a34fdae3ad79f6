"""Confirmation: the best few points of each schedule trained again on fresh seeds, ranked by their mean.

A search picks the best of many single noisy draws, so its winner's score is biased low (the
winner's curse). Before recommending, the ``search.confirm.top`` best distinct points of each
schedule are trained again with ``search.confirm.seeds`` fresh seeds (each a different model
initialisation and data order: ``training.seed`` + 1, + 2, ...), the same seeds for every point and
schedule, so PACI and flush are compared seed by seed. The search's own draw is not in the mean:
it is the one that was selected. Confirmation trials are ordinary trials of the study (enqueued with
the point's parameters and a ``confirm`` attribute; resumable; never pruned; not counted against
``search.trials``).

``speedup_vs_flush`` is the ratio of the two schedules' mean scores, with a percentile bootstrap
interval over the paired seeds; the verdict is ``paci`` or ``flush`` only when the interval
excludes 1, else ``tie``. May import: optuna, numpy and the tune layer's :mod:`.space`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from .space import TrialParams

CONFIRM_ATTR = "confirm"  # on a confirmation trial: {"of": the search trial's number, "seed": training.seed}
TRANSFER_ATTR = "transfer"  # on a transfer-check trial (:mod:`.transfer`): {"of": the search trial, "factor": f}
EXTRA_ATTRS = (CONFIRM_ATTR, TRANSFER_ATTR)
"""The user attributes that make a trial an extra run of a point the search already ran, not a search trial."""
PLAN_ATTR = "confirm_plan"  # on a study: the numbers of the search trials being confirmed, in rank order
BOOTSTRAP_DRAWS = 4000
LEVEL = 0.95


def is_confirmation(t: FrozenTrial) -> bool:
    return CONFIRM_ATTR in t.user_attrs


def is_extra(t: FrozenTrial | optuna.Trial) -> bool:
    """Not a search trial: a confirmation or a transfer-check run of a point the search already ran.

    Such trials are not counted against ``search.trials``, never reused as a repeat's answer, and not
    ranked, planned from or recommended: the one test of "is this a search trial" everywhere.
    """
    return any(k in t.user_attrs for k in EXTRA_ATTRS)


def search_trials(study: optuna.Study, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
    """The study's own search trials: no confirmation or transfer-check trials."""
    return [t for t in study.get_trials(deepcopy=False, states=states) if not is_extra(t)]


def confirm_seeds(base_seed: int, n: int) -> list[int]:
    """The fresh seeds of a confirmation: never the search's own (``base_seed``)."""
    return [base_seed + 1 + i for i in range(n)]


def plan(study: optuna.Study, top: int) -> list[int]:
    """The search trials whose points are confirmed: the ``top`` best distinct finished ones (kept once set)."""
    return kept_plan(study, top, PLAN_ATTR)


def kept_plan(study: optuna.Study, top: int, attr: str) -> list[int]:
    """The ``top`` best distinct finished search trials, stored on the study under ``attr`` the first
    time, so every worker (and every resume) plans the same ones."""
    stored = study.user_attrs.get(attr)
    if stored is not None:
        return [int(n) for n in stored]
    numbers = best_distinct(study, top)
    study.set_user_attr(attr, numbers)
    return numbers


def best_distinct(study: optuna.Study, top: int) -> list[int]:
    """The ``top`` best finished search trials with distinct points, best first (ties: the earlier).

    Repeats (answered from an earlier trial) are not new evidence and are left out.
    """
    done = [t for t in search_trials(study, (TrialState.COMPLETE,)) if t.value is not None and "repeat_of" not in
            t.user_attrs]  # fmt: skip
    chosen: list[FrozenTrial] = []
    for t in sorted(done, key=lambda t: (t.value, t.number)):
        if len(chosen) < top and all(t.params != c.params for c in chosen):
            chosen.append(t)
    return [t.number for t in chosen]


def enqueue(study: optuna.Study, numbers: list[int], seeds: list[int]) -> int:
    """Queue every (point, seed) not queued, running or done yet; how many were queued now."""
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    have = {(t.user_attrs[CONFIRM_ATTR]["of"], t.user_attrs[CONFIRM_ATTR]["seed"]) for t in trials
            if is_confirmation(t) and t.number not in retried}  # fmt: skip
    by_number = {t.number: t for t in trials}
    queued = 0
    for n in numbers:
        for s in seeds:
            if (n, s) not in have:
                study.enqueue_trial(dict(by_number[n].params), user_attrs={CONFIRM_ATTR: {"of": n, "seed": s}})
                queued += 1
    return queued


def retried_numbers(trials: list[FrozenTrial]) -> set[int]:
    """Failed trials that were queued again (their retry stands for them)."""
    return {int(t.user_attrs["retry_of"]) for t in trials if "retry_of" in t.user_attrs}


def waiting(study: optuna.Study, attr: str = CONFIRM_ATTR) -> bool:
    """A trial of this kind (``attr``: a confirmation, or a transfer check) is queued in ``study``."""
    return any(attr in t.user_attrs for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


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
    numbers = [int(n) for n in study.user_attrs.get(PLAN_ATTR, [])]
    trials = study.get_trials(deepcopy=False)
    by_number, retried = {t.number: t for t in trials}, retried_numbers(trials)
    out = {n: Confirmed(n, params_of(by_number[n], schedule)) for n in numbers}
    for t in trials:
        c = t.user_attrs.get(CONFIRM_ATTR)
        if (
            c is None
            or c["of"] not in out
            or c["seed"] not in seeds
            or t.state not in (TrialState.COMPLETE, TrialState.FAIL)
        ):
            continue
        if t.number in retried:
            continue  # an interrupted run that was queued again: its retry counts
        point = out[c["of"]]
        if c["seed"] in point.scores and t.state == TrialState.FAIL:
            continue  # a duplicate (two workers queued the same seed): a finished run wins
        point.scores[c["seed"]] = float(t.value) if t.state == TrialState.COMPLETE and t.value is not None else math.inf
        point.time_to_target[c["seed"]] = t.user_attrs.get("time_to_target")
        point.trials[c["seed"]] = t.number
    return [out[n] for n in numbers]


def paired_speedup(flush: Confirmed, paci: Confirmed, draws: int = BOOTSTRAP_DRAWS) -> tuple[float, float, float]:
    """Flush's mean score over PACI's, and a percentile bootstrap interval over the seeds both ran."""
    return paired_ratio(flush.scores, paci.scores, draws)


def paired_ratio(
    num: dict[int, float], den: dict[int, float], draws: int = BOOTSTRAP_DRAWS
) -> tuple[float, float, float]:
    """mean(num) / mean(den) over their common seeds, and a percentile bootstrap interval.

    Seeds are paired: each resample draws seed indices with replacement and takes the ratio of the
    two means over the same seeds. A seed that failed in either scores inf there.
    """
    common = sorted(set(num) & set(den))
    if not common:
        return math.nan, math.nan, math.nan
    f = np.array([num[s] for s in common])
    p = np.array([den[s] for s in common])
    with np.errstate(invalid="ignore", divide="ignore"):
        point = float(f.mean() / p.mean())
        idx = np.random.default_rng(0).integers(0, len(common), size=(draws, len(common)))
        ratios = f[idx].mean(axis=1) / p[idx].mean(axis=1)
    lo, hi = np.nanquantile(ratios, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return point, float(lo), float(hi)


def verdict(low: float, high: float) -> str:
    """``paci`` when the whole interval is above 1, ``flush`` when below, otherwise ``tie``."""
    if low > 1.0:
        return "paci"
    if high < 1.0:
        return "flush"
    return "tie"
