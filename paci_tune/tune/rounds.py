"""Confirmation until decided: how many fresh seeds the confirmation runs, one paired round at a time.

The confirmation starts with ``search.confirm.seeds`` seeds (the minimum). Once every queued run of
every schedule's planned points has finished, each schedule's best confirmed point (the lowest mean
score over the seeds so far) is found, and PACI's is compared with the strongest synchronous
schedule's (the baseline: the lowest mean among ``1f1b``, ``zb-h1``, ``interleaved`` searched), the
baseline's mean over PACI's with a paired bootstrap interval (:func:`paired_ratio`). The confirmation
stops when that interval excludes 1 (``excludes_1``), or is narrower than ``search.confirm.tolerance``
relative to its point estimate (``narrow``: the answer is known to that precision, even if it is
"about equal"), or when ``search.confirm.max_seeds`` is reached (``max_seeds``); otherwise one more
seed is added, for every planned point of every schedule, so the seeds stay paired. One seed decides
nothing: its bootstrap "interval" is a single point. Nothing is spent where the answer is
already clear, and every worker and every resume computes the same count from the stored trials.

A search without PACI or without a synchronous schedule has nothing to decide: it runs the minimum.
May import: optuna, numpy and the tune layer's :mod:`.record`, :mod:`.extra`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import optuna
from optuna.trial import TrialState

from .extra import confirm_seeds, retried_numbers
from .record import StudyRecord, TrialRecord

BOOTSTRAP_DRAWS = 4000
LEVEL = 0.95
STOPPED_BY = ("excludes_1", "narrow", "max_seeds")
"""Why a confirmation stopped adding seeds (best.yaml's ``confirmation.stopped_by``)."""


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


def decided(point: float, low: float, high: float, tolerance: float) -> str | None:
    """``excludes_1`` when the interval lies wholly on one side of 1, ``narrow`` when its width is under
    ``tolerance`` x the point estimate, else None (more seeds could change the answer)."""
    if low > 1.0 or high < 1.0:
        return "excludes_1"
    if math.isfinite(point) and point > 0 and (high - low) < tolerance * point:
        return "narrow"
    return None


@dataclass(frozen=True)
class Round:
    """Where a confirmation stands: the seeds to have run, and why it stopped (None: still deciding)."""

    seeds: int
    stopped_by: str | None


def _scores(study: optuna.Study, seeds: list[int]) -> tuple[dict[int, dict[int, float]], bool]:
    """Per planned search trial, its finished confirmation scores by seed (inf for a failed run); and
    whether every run of ``seeds`` of every planned point has finished."""
    plan = StudyRecord.read(study).confirm_plan or []
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    out: dict[int, dict[int, float]] = {n: {} for n in plan}
    for t in trials:
        r = TrialRecord.read(t)
        if r.confirm_of not in out or r.seed not in seeds or t.number in retried:
            continue
        if t.state == TrialState.COMPLETE and t.value is not None:
            out[r.confirm_of][int(r.seed)] = float(t.value)  # type: ignore[arg-type]
        elif t.state == TrialState.FAIL:
            out[r.confirm_of].setdefault(int(r.seed), math.inf)  # type: ignore[arg-type]
    done = bool(plan) and all(set(seeds) <= set(by_seed) for by_seed in out.values())
    return out, done


def _best(scores: dict[int, dict[int, float]]) -> dict[int, float]:
    """The scores of the point with the lowest mean (ties: the earlier trial)."""
    n = min(scores, key=lambda k: (float(np.mean(list(scores[k].values()))), k))
    return scores[n]


def current_round(
    studies: dict[str, optuna.Study], base_seed: int, minimum: int, maximum: int, tolerance: float
) -> Round:
    """How many seeds the confirmation needs now (module docstring): the minimum until it has run, then
    one more per undecided round up to ``maximum``."""
    n = minimum
    while True:
        sync = [s for s in studies if s != "paci"]
        if "paci" not in studies or not sync:
            return Round(n, None)
        seeds = confirm_seeds(base_seed, n)
        tables = {s: _scores(studies[s], seeds) for s in ("paci", *sync)}
        if not all(done for _, done in tables.values()):
            return Round(n, None)  # this round is still running (or not planned yet)
        bests = {s: _best(tables[s][0]) for s in sync}
        base = min(sync, key=lambda s: (float(np.mean(list(bests[s].values()))), sync.index(s)))
        point, low, high = paired_ratio(bests[base], _best(tables["paci"][0]))
        why = decided(point, low, high, tolerance) if n >= 2 else None  # one seed's "interval" is its point
        if why is not None:
            return Round(n, why)
        if n >= maximum:
            return Round(n, "max_seeds")
        n += 1
