"""Confirmation until decided: which two points are compared, and how many fresh seeds the confirmation runs.

**The compared points are chosen on the search's draws**, before any confirmation seed is read: PACI's
best pipelined point (the first of its study's confirmation plan; PACI at P = 1 is flush and is searched by
the synchronous studies) and the strongest synchronous point over every layout (the synchronous study
whose planned best has the lowest search score, 1F1B-flush first on a tie). The fresh seeds only report
on them, so picking the best of many noisy draws does not bias the comparison.

**Seeds.** The confirmation starts with ``search.confirm.seeds`` seeds (the minimum). Once both compared
points have finished a round, the sequential paired test (:class:`.comparison.Design`) reads their per-seed
ratios: it stops when it decides, when the answer is known to ``tolerance``, when a compared run missed the
target, or at ``max_seeds``; otherwise one more seed is due, for every planned point of every schedule, so
the seeds stay paired. Every worker and every resume computes the same count from the stored trials.

A search without PACI or without a synchronous schedule has nothing to decide: it runs the minimum.
May import: optuna, numpy,
:mod:`paci_tune.schedule` and the tune layer's :mod:`.record`, :mod:`.extra`, :mod:`.comparison`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from ..schedule import sides, strongest
from .comparison import Design
from .extra import best_distinct_trials, confirm_seeds, retried_numbers
from .record import StudyRecord, TrialRecord


@dataclass(frozen=True)
class Round:
    """Where a confirmation stands: the seeds to have run, and why it stopped (None: still deciding)."""

    seeds: int
    stopped_by: str | None


@dataclass(frozen=True)
class Compared:
    """The two points a search's verdict compares: (schedule, search trial number) each."""

    paci: tuple[str, int]
    baseline: tuple[str, int]


def confirmed_schedules(studies: dict[str, optuna.Study]) -> set[str]:
    """The studies whose points the confirmation trains: PACI's and the strongest synchronous one's, by each
    study's best search draw (only those two are compared, so the others' fresh seeds would buy nothing);
    every study where there is nothing to compare (no PACI, or no synchronous schedule)."""
    paci, sync = sides(studies)
    if paci is None or not sync:
        return set(studies)
    firsts = {s: best[0].value for s in sync if (best := best_distinct_trials(studies[s], 1))}
    if not firsts:
        return {paci}
    return {paci, strongest(firsts)}


def compared(studies: dict[str, optuna.Study]) -> Compared | None:
    """PACI's planned best and the strongest synchronous schedule's (module docstring); None while a plan is
    missing or the search has no PACI or no synchronous schedule."""
    paci, sync = sides(studies)
    if paci is None or not sync:
        return None
    firsts: dict[str, tuple[int, float]] = {}
    for s in (paci, *sync):
        plan = StudyRecord.read(studies[s]).confirm_plan or []
        if not plan:
            continue
        t = next((t for t in studies[s].get_trials(deepcopy=False) if t.number == plan[0]), None)
        if t is not None and t.value is not None:
            firsts[s] = (plan[0], float(t.value))
    ranked = [s for s in sync if s in firsts]
    if paci not in firsts or not ranked:
        return None
    base = strongest({s: firsts[s][1] for s in ranked})
    return Compared((paci, firsts[paci][0]), (base, firsts[base][0]))


@dataclass(frozen=True)
class Run:
    """One finished confirmation run: its score (inf for a failed run), its time to target (None: missed) and
    its trial."""

    score: float
    time_to_target: float | None
    trial: int

    @property
    def reached(self) -> bool:
        return self.time_to_target is not None and math.isfinite(self.score)


def confirmed_runs(study: optuna.Study, of: int) -> dict[int, Run]:
    """The finished confirmation runs of search trial ``of``, by seed. A retried run counts through its retry;
    a finished run beats a failed duplicate (two workers queued the same seed)."""
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    out: dict[int, Run] = {}
    for t in trials:
        r = TrialRecord.read(t)
        if r.confirm_of != of or r.seed is None or t.number in retried:
            continue
        if t.state == TrialState.COMPLETE and t.value is not None:
            out[int(r.seed)] = Run(float(t.value), r.time_to_target, t.number)
        elif t.state == TrialState.FAIL and int(r.seed) not in out:
            out[int(r.seed)] = Run(math.inf, None, t.number)
    return out


def current_round(studies: dict[str, optuna.Study], base_seed: int, design: Design) -> Round:
    """How many seeds the confirmation needs now (module docstring): the minimum until the compared points
    have run it, then one more per undecided look up to ``design.max_seeds``."""
    pair = compared(studies)
    if pair is None:
        return Round(design.min_seeds, None)
    runs = [confirmed_runs(studies[s], n) for s, n in (pair.baseline, pair.paci)]
    ratios, missed = [], []
    for seed in confirm_seeds(base_seed, design.max_seeds):
        if seed not in runs[0] or seed not in runs[1]:
            break  # seeds are read in order: the prefix both have finished
        base, paci = runs[0][seed], runs[1][seed]
        ratios.append(base.score / paci.score if paci.score > 0 and math.isfinite(paci.score) else math.inf)
        missed.append(not (base.reached and paci.reached))
    if len(ratios) < design.min_seeds:
        return Round(design.min_seeds, None)  # the minimum is still running (or not queued yet)
    look = design.settle(ratios, missed)
    if look.stopped_by is not None:
        return Round(look.n, look.stopped_by)
    return Round(len(ratios) + 1, None)
