"""The verdict of a finished search: its two compared points as one :class:`~paci_tune.tune.comparison.Comparison`.

The points are the ones :func:`paci_tune.tune.rounds.compared` chose on the search's draws (PACI's best
pipelined point, the strongest synchronous point over every layout), read on the confirmation's fresh
seeds with the sequential paired test; without a confirmation, each side's best search draw (an anecdote,
and the record says so). The recommendation follows the verdict: PACI only where it is shown faster,
the synchronous point on ``flush`` and on a tie (the simpler method, exact numerics), and on ``undecided``
the side that missed fewer runs, then the lower mean. May import: optuna, :mod:`paci_tune.tune`,
:mod:`paci_tune.schedule` and the verdict layer's :mod:`.confirm`.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..schedule import schedule_of, strongest
from ..schedule import sides as schedule_sides
from ..tune.comparison import PACI_WINS, UNDECIDED, Comparison, Design, Side, build
from ..tune.extra import search_trials
from ..tune.point import TrialParams
from ..tune.record import TrialRecord
from ..tune.rounds import compared
from .confirm import Confirmed

PointOf = Callable[[FrozenTrial, str], TrialParams]


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """Lowest score among finished search trials; the earliest on a tie (a repeat is not new evidence)."""
    done = [t for t in search_trials(study, (TrialState.COMPLETE,)) if t.value is not None]
    return min(done, key=lambda t: (t.value, t.number)) if done else None


def _side(study: optuna.Study, schedule: str, t: FrozenTrial, point_of: PointOf, c: Confirmed | None) -> Side:
    p = point_of(t, schedule)
    name = f"{study.study_name}#{t.number}"
    if c is not None and c.complete:
        reached = {s: c.time_to_target.get(s) is not None for s in c.scores}
        return Side(schedule, p.label(), name, p.stages, dict(c.scores), reached)
    r = TrialRecord.read(t)
    return Side(schedule, p.label(), name, p.stages, {0: float(t.value)}, {0: r.time_to_target is not None})  # type: ignore[arg-type]


def _unconfirmed_pair(
    studies: dict[str, optuna.Study],
) -> tuple[tuple[str, FrozenTrial], tuple[str, FrozenTrial]] | None:
    """PACI's best search draw and the best synchronous one (flush first on a tie), or None."""
    bests = {s: t for s, st in studies.items() if (t := best_trial(st)) is not None}
    paci, sync = schedule_sides(bests)
    if paci is None or not sync:
        return None
    base = strongest({s: float(bests[s].value) for s in sync})  # type: ignore[arg-type]
    return (paci, bests[paci]), (base, bests[base])


def verdict_of(
    studies: dict[str, optuna.Study],
    tables: dict[str, list[Confirmed]],
    point_of: PointOf,
    design: Design | None,
    *,
    spacing: float,
    advice: str,
) -> tuple[Comparison, dict[str, FrozenTrial]] | None:
    """The comparison and the two compared search trials by schedule; None when there is nothing to compare
    (no PACI or no synchronous trial finished). ``tables``: each schedule's confirmed points (empty: not
    confirmed); ``spacing``: time to target's resolution; ``advice``: what to change when undecided."""
    pair = compared(studies) if design is not None else None
    confirmed: dict[str, Confirmed] = {}
    if pair is not None:
        for schedule, number in (pair.paci, pair.baseline):
            c = next((c for c in tables.get(schedule, []) if c.trial == number), None)
            if c is not None and c.complete:
                confirmed[schedule] = c
    if pair is not None and len(confirmed) == 2:
        trials = {
            s: next(t for t in studies[s].get_trials(deepcopy=False) if t.number == n)
            for s, n in (pair.paci, pair.baseline)
        }
    else:  # not confirmed (or its runs are not there): the search's single draws
        unconfirmed = _unconfirmed_pair(studies)
        if unconfirmed is None:
            return None
        trials = dict(unconfirmed)
        design, confirmed = None, {}
    (paci_s, base_s) = trials
    sides = {s: _side(studies[s], s, t, point_of, confirmed.get(s)) for s, t in trials.items()}
    return build(sides[paci_s], sides[base_s], design, spacing=spacing, advice=advice), trials


def recommended_schedule(comparison: Comparison | None, means: dict[str, float]) -> str:
    """Whose point best.yaml recommends (module docstring); ``means``: each schedule's chosen point's score."""
    if comparison is None:
        return min(means, key=lambda s: (means[s], schedule_of(s).synchronous))
    paci, base = comparison.paci, comparison.baseline
    if comparison.verdict == PACI_WINS:
        return str(paci["schedule"])
    if comparison.verdict == UNDECIDED:
        missed = {str(side["schedule"]): int(side["runs"]) - int(side["reached"]) for side in (paci, base)}
        return min(missed, key=lambda s: (missed[s], means.get(s, float("inf"))))
    return str(base["schedule"])
