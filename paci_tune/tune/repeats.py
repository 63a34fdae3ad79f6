"""Repeated points: samplers propose a point already run often in small discrete spaces; it is not trained again.

A finished one's result is copied, a deterministic failure (out of memory, divergence, a refusal)
repeated, and a pruned one's curve is replayed against the pruner, which trains it only if it now
survives past the point where it was stopped (a capped one is not trained again). Each answer is
told to the study here; the search loop (:mod:`.search`) shows it. May import: optuna and the tune
layer's :mod:`.record`, :mod:`.extra`.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from . import extra, record
from .record import TrialRecord

DETERMINISTIC_FAILURES = ("oom", "diverged", "rejected")


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


def same_point(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    """The most recent finished trial of ``study`` with exactly ``trial``'s parameters."""
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    same = [t for t in extra.search_trials(study, done) if t.params == trial.params]
    if not same:
        return None
    complete = [t for t in same if t.state == TrialState.COMPLETE]
    return (complete or same)[-1]
