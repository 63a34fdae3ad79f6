"""The extra runs a search queues once its quotas are met: confirmation seeds and the transfer check's long runs.

**Confirmation** (:mod:`paci_tune.verdict.confirm` reads it): the ``search.confirm.top`` best distinct
finished search points of the compared studies (:func:`.rounds.confirmed_schedules`) are trained again
with fresh seeds (``training.seed`` + 1, + 2, ...; as many as :mod:`.rounds` says), the same seeds for
every point and schedule. **Transfer check**
(:mod:`paci_tune.verdict.transfer` reads it): the ``search.transfer_check.top`` best distinct points
are trained once more at ``factor`` x the trial budget, with the same validation spacing
(:func:`long_budget`). Both plans are fixed on the first look (the study's ``confirm_plan`` /
``transfer_plan``), so every worker and every resume plans the same trials.

Extra runs are ordinary trials of the study, enqueued with the point's parameters and a ``confirm``
or ``transfer`` attribute (:mod:`.record`): resumable (a killed search queues only what is missing;
an interrupted one is retried as the same kind of run), never pruned, never answered from an earlier
trial, not counted against ``search.trials``, and left out of the search's ranking and the
recommendation's candidates (:func:`search_trials`). May import: optuna and the tune layer's :mod:`.record`.
"""

from __future__ import annotations

import math

import optuna
from optuna.trial import FrozenTrial, TrialState

from .record import CONFIRM, CONFIRM_PLAN, TRANSFER, TRANSFER_PLAN, Extra, StudyRecord, TrialRecord, is_extra


def confirm_seeds(base_seed: int, n: int) -> list[int]:
    """The fresh seeds of a confirmation: never the search's own (``base_seed``)."""
    return [base_seed + 1 + i for i in range(n)]


def search_trials(study: optuna.Study, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
    """The study's own search trials: no confirmation or transfer-check trials."""
    return [t for t in study.get_trials(deepcopy=False, states=states) if not is_extra(t)]


def best_distinct(study: optuna.Study, top: int) -> list[int]:
    """The numbers of the ``top`` best finished search trials with distinct points (:func:`best_distinct_trials`)."""
    return [t.number for t in best_distinct_trials(study, top)]


def best_distinct_trials(study: optuna.Study, top: int) -> list[FrozenTrial]:
    """The ``top`` best finished search trials with distinct points, best first (ties: the earlier).

    Repeats (answered from an earlier trial) are not new evidence and are left out.
    """
    done = [
        t
        for t in search_trials(study, (TrialState.COMPLETE,))
        if t.value is not None and not TrialRecord.read(t).is_repeat
    ]
    chosen: list[FrozenTrial] = []
    for t in sorted(done, key=lambda t: (t.value, t.number)):
        if len(chosen) < top and all(t.params != c.params for c in chosen):
            chosen.append(t)
    return chosen


def kept_plan(study: optuna.Study, top: int, key: str) -> list[int]:
    """The ``top`` best distinct finished search trials, stored on the study under ``key`` the first
    time, so every worker (and every resume) plans the same ones."""
    stored = StudyRecord.read(study).plan(key)
    if stored is not None:
        return stored
    numbers = best_distinct(study, top)
    StudyRecord.write_plan(study, key, numbers)
    return numbers


def confirm_plan(study: optuna.Study, top: int) -> list[int]:
    """The search trials whose points are confirmed: the ``top`` best distinct finished ones (kept once set)."""
    return kept_plan(study, top, CONFIRM_PLAN)


def transfer_plan(study: optuna.Study, top: int) -> list[int]:
    """The search trials whose points are trained longer: the ``top`` best distinct finished ones (kept once set)."""
    return kept_plan(study, top, TRANSFER_PLAN)


def retried_numbers(trials: list[FrozenTrial]) -> set[int]:
    """Failed trials that were queued again (their retry stands for them)."""
    return {r.retry_of for r in map(TrialRecord.read, trials) if r.retry_of is not None}


def _queued(study: optuna.Study) -> tuple[set[Extra], dict[int, FrozenTrial]]:
    """The extra runs queued, running or done in ``study`` (a retried one stands for its retry), and the
    study's trials by number."""
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    have: set[Extra] = set()
    for t in trials:
        r = TrialRecord.read(t)
        if t.number in retried:
            continue
        if r.is_confirmation:
            have.add(Extra(int(r.confirm_of), seed=r.seed))  # type: ignore[arg-type]
        elif r.is_transfer:
            have.add(Extra(int(r.transfer_of), factor=float(r.factor)))  # type: ignore[arg-type]
    return have, {t.number: t for t in trials}


def _enqueue_missing(study: optuna.Study, wanted: list[Extra]) -> int:
    """Queue each of ``wanted`` not queued, running or done yet, with its point's parameters; how many now."""
    have, by_number = _queued(study)
    missing = [e for e in wanted if e not in have]
    for e in missing:
        e.enqueue(study, dict(by_number[e.of].params))
    return len(missing)


def enqueue_confirmations(study: optuna.Study, numbers: list[int], seeds: list[int]) -> int:
    """Queue every (point, seed) not queued, running or done yet; how many were queued now."""
    return _enqueue_missing(study, [Extra(n, seed=s) for n in numbers for s in seeds])


def enqueue_transfers(study: optuna.Study, numbers: list[int], factor: float) -> int:
    """Queue a long run of each planned point not queued, running or done yet at ``factor``; how many now."""
    return _enqueue_missing(study, [Extra(n, factor=float(factor)) for n in numbers])


def waiting(study: optuna.Study, kind: str = CONFIRM) -> bool:
    """A trial of this kind (``kind``: :data:`.record.CONFIRM` or :data:`.record.TRANSFER`) is queued in ``study``."""
    waiting_ = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return any(
        (TrialRecord.read(t).is_confirmation if kind == CONFIRM else TrialRecord.read(t).is_transfer) for t in waiting_
    )


def transfer_queued(study: optuna.Study) -> bool:
    """A transfer trial waits in ``study``."""
    return waiting(study, TRANSFER)


def long_budget(seconds: float, grid: int, factor: float) -> tuple[float, int]:
    """(budget, grid) of a long run: ``factor`` x the seconds, ``ceil(grid * factor)`` validations, so the
    validation spacing (and the time to target's resolution) is a short trial's."""
    if factor == 1.0:
        return seconds, grid
    return seconds * factor, max(grid, math.ceil(grid * factor - 1e-9))
