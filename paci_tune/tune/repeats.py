"""Repeated points: samplers propose a point already run often in small discrete spaces; it is not trained again.

A finished one's result is copied, a deterministic failure (out of memory, divergence, a refusal)
repeated, and a pruned one's curve is replayed against the pruner, which trains it only if it now
survives past the point where it was stopped (a capped one is not trained again). Each answer is
told to the study here; the search loop (:mod:`.search`) shows it. Two workers that draw one point at
once would both train it: the later trial waits for the earlier one (:func:`wait_for_earlier`) and is then
answered as its repeat. May import: optuna and the tune layer's :mod:`.record`, :mod:`.extra`, :mod:`.liveness`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from . import extra, record
from .liveness import Watch, is_dead
from .record import TrialRecord

DETERMINISTIC_FAILURES = ("oom", "diverged", "rejected")
POLL_S = 0.5  # how often a trial waiting for another worker's run of its point looks again


@dataclass(frozen=True)
class Told:
    """How a repeat was answered: its state, why, its score and (pruned) the grid step."""

    state: str
    reason: str
    value: float | None = None
    step: int | None = None


def answer_repeat(study: optuna.Study, trial: optuna.Trial) -> Told | None:
    """Answer a repeated point from its earlier trial and tell the study; None when it must be trained."""
    earlier = same_point(study, trial)
    if earlier is None:
        return None
    if earlier.state == TrialState.COMPLETE:
        record.copy_result(earlier, trial)
        for step, v in sorted(earlier.intermediate_values.items()):
            trial.report(v, step)
        study.tell(trial, earlier.value)
        return Told("complete", f"same point as trial {earlier.number}", earlier.value)
    if earlier.state == TrialState.FAIL:
        reason = str(TrialRecord.read(earlier).fail_reason or "")
        if not reason.startswith(DETERMINISTIC_FAILURES):
            return None
        repeated = f"{reason} (same point as trial {earlier.number})"
        record.copy_failure(earlier, trial, repeated)
        study.tell(trial, state=TrialState.FAIL)
        return Told("failed", repeated)
    # Pruned before: replay its curve; train it again only if the pruner now lets it through. One capped
    # (:mod:`.capping`) stays stopped where it was: the cap only falls, so its run would be capped there again.
    capped = TrialRecord.read(earlier).capped_at is not None
    steps = sorted(earlier.intermediate_values.items())
    for step, v in steps:
        trial.report(v, step)
        if trial.should_prune() or (capped and step == steps[-1][0]):
            record.copy_pruned(earlier, trial, step)
            study.tell(trial, state=TrialState.PRUNED)
            return Told("pruned", f"same point as trial {earlier.number}", step=step)
    record.mark_rerun(trial, earlier.number)  # survives where it was pruned: train it again
    return None


def wait_for_earlier(study: optuna.Study, trial: optuna.Trial, grace: float, lost: threading.Event) -> None:
    """Return once no earlier search trial of ``trial``'s point runs (another worker drew it a moment before):
    it finished, so :func:`answer_repeat` answers from it, or its worker is dead (:func:`.liveness.is_dead`),
    so this trial trains. The earlier never waits for the later, so two workers cannot wait on each other.
    ``lost``: this trial was reaped meanwhile; stop waiting."""
    watch = Watch()
    while not lost.is_set():
        now = time.time()
        running = [
            t
            for t in extra.search_trials(study, (TrialState.RUNNING,))
            if t.number < trial.number and t.params == trial.params and not is_dead(t, now, grace, watch)
        ]
        if not running:
            return
        lost.wait(POLL_S)


def same_point(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    """The most recent finished trial of ``study`` with exactly ``trial``'s parameters."""
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    same = [t for t in extra.search_trials(study, done) if t.params == trial.params]
    if not same:
        return None
    complete = [t for t in same if t.state == TrialState.COMPLETE]
    return (complete or same)[-1]
