"""A trial's end told to its study: its run's result (:func:`tell`), or its refusal (:func:`refuse`).

:func:`tell` stores what a trial's run measured on the trial (:class:`.record.Outcome`: its curve,
its stages' peak memory and drift, the predicted peak beside them) and tells the study its score,
or that it was pruned or failed; each returns the ``end`` event the live view shows. A trial
answered from a shared curve (:mod:`.sharing`) ends the same way, with the result
:func:`curve_result` reads off the curve: its validations on the trial's own layout's clock,
reported to the pruner one by one as its run would have reported them, and stopped where the pruner
or the cap (:mod:`.capping`) would have stopped that run. The search loop (:mod:`.search`) calls
them. May import: optuna and the tune layer's :mod:`.capping`, :mod:`.events`, :mod:`.objective`,
:mod:`.point`, :mod:`.record`, :mod:`.runner`, :mod:`.sharing`.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from . import record
from .capping import capped
from .events import SearchEvent
from .objective import Progress, grid_step
from .point import TrialParams
from .record import Outcome
from .runner import OnEval, TrialResult
from .sharing import Replay


def refuse(study: optuna.Study, trial: optuna.Trial, params: TrialParams, why: str) -> SearchEvent:
    """A proposal outside the device budget's feasible points: answered unrun, not counted
    (:func:`.study.counted`); the event the live view shows.

    Told as PRUNED with no value, not FAIL: TPE ignores failed trials, so it kept proposing the
    same infeasible pair (17 of 24 flush proposals in the example); a pruned trial without values
    ranks below every finished one, so the sampler learns to avoid the pair.
    """
    record.mark_refused(trial, why)
    study.tell(trial, state=TrialState.PRUNED)
    return SearchEvent(
        "end", params.schedule, trial.number, params, None, None, None, "rejected", f"rejected: {why}", None
    )


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    params: TrialParams,
    result: TrialResult,
    predicted_memory: list[int] | None,
) -> SearchEvent:
    """Store a trial's run on it (:class:`~.record.Outcome`; ``predicted_memory``: the peak bytes per stage
    predicted for its cut, beside the measured ones) and tell ``study`` how it ended; the event the live
    view shows."""
    p = result.progress
    clock_used, measured = p.clock, None
    if result.summary:
        measured = dict(result.summary)
        stages = result.summary.get("stages", [])
        measured["measured_peak_memory_bytes"] = [st.get("peak_memory_bytes") for st in stages]
        measured["stage_drift"] = [
            {"max": st.get("max_drift"), "mean": st.get("mean_drift"), "bound": st.get("drift_bound")} for st in stages
        ]
        clock_used = float(result.summary.get("clock", p.clock))
        measured["predicted_peak_memory_bytes"] = predicted_memory
    Outcome(
        p.reached_at,
        p.best_val,
        clock_used,
        round(result.wall_seconds, 3),
        [[round(c, 6), v] for c, v in result.evals],
        measured,
    ).write(trial)
    value: float | None = None
    if result.status == "complete":
        value = p.value
        study.tell(trial, value)
    elif result.status == "pruned":
        record.mark_pruned(trial, result.pruned_step, p.clock, result.capped_at)
        study.tell(trial, state=TrialState.PRUNED)
    else:
        record.mark_failed(trial, result.reason)
        study.tell(trial, state=TrialState.FAIL)
    return SearchEvent(
        "end",
        params.schedule,
        trial.number,
        params,
        result.pruned_step,
        p,
        None,
        result.status,
        result.reason,
        value,
    )


def curve_result(
    read: list[tuple[int, float, float]],
    replay: Replay,
    on_eval: OnEval,
    *,
    target: float,
    budget: float,
    grid: int,
    cap: float | None,
    first: int,
    how: str,
    trained: TrialResult | None,
) -> TrialResult:
    """The result of a trial answered from a stored curve: ``read`` (step, clock, val_loss) as
    :func:`.sharing.walk` places it on the trial's ``replay``, each validation reported by ``on_eval``
    and stopped as its run would be (the pruner on the ``grid`` of ``budget``, the ``cap``). ``first``:
    the warm start's step; ``how``: where the curve came from; ``trained``: the trial's own run of its
    class's curve, whose figures it keeps."""
    progress, evals, by_step, pruned, why, capped_at = Progress(target, budget), [], [], None, "pruned", None
    for step, clock, val in read:
        progress.add_eval(clock, val)
        evals.append((clock, val))
        by_step.append((step, val))
        if on_eval(grid_step(clock, budget, grid), progress) and progress.reached_at is None:
            pruned = grid_step(clock, budget, grid)
        elif capped(progress, cap):
            pruned, why, capped_at = grid_step(clock, budget, grid), f"capped past {cap:.3g}s", cap
        if pruned is not None:
            break
    ended = pruned is not None or progress.reached_at is not None
    steps = by_step[-1][0] if ended and by_step else first + replay.steps  # counted as a run's: from step 0
    summary = {
        "clock": progress.clock if ended else replay.clock_end,
        "partition": replay.cut,
        "steps": steps,
        "clock_step_time_s": replay.clock_end / replay.steps if replay.steps else 0.0,
    }
    return TrialResult(
        "pruned" if pruned is not None else "complete",
        progress,
        f"{why} at grid step {pruned} ({how})" if pruned is not None else how,
        pruned,
        {**(trained.summary or {}), **summary} if trained else summary,
        trained.wall_seconds if trained else 0.0,
        evals,
        by_step,
        capped_at,
    )
