"""Curve sharing: on the sim and rst clocks, a trial whose numerics another trial trained is not trained again.

A trial's time to target on a profile clock is its layout's clock read against its loss curve, and
many layouts train one curve (:mod:`.curves`: every synchronous schedule at every P, D, a and b of a
global batch; PACI at one P and a). With ``search.share_curves`` (the default on those clocks) each
trial's run is set up so that its curve is a function of its numerics alone:

- its LR decays over steps (``lr_schedule.horizon_steps``), not over its own clock: the **class
  horizon**, the most steps any point of the space with the same numerics fits in the budget. The
  class's fastest layout keeps the schedule it had; a slower one gets the same LR at each step and
  runs out of budget before the end of the decay;
- it validates on a grid of steps, every ``max(1, H // max(20, budget.grid))`` of them (time to
  target to 1/20 of the budget or finer), and only those validations are scored (:class:`StepGrid`);
  with ``search.validate_near_target`` (the default) only near the target, and every
  ``H / budget.grid`` steps far from it (:mod:`paci_tune.train.nearness`: a function of the curve, so
  every layout of a class validates at the same steps); the pruner still reads the clock grid;
- its data are drawn sequence by sequence (``data.draw: sequence`` unless the run file names a draw),
  so every split of a global batch trains on the same sequences (:mod:`paci_tune.data.stream`).

A trained trial stores its scored validations by step under its numerics key
(:func:`.record.write_numerics`), in the study's own storage, so workers on other machines share
them. A later trial with the same key reads its own layout's clock at each of its grid steps
(:func:`replay_points`) against the stored validations: the score it would have had, had it trained.
Where the stored curves stop short of a step it needs (the trial that trained them was pruned, or
ran fewer steps than this layout fits in the budget) it trains, and stores the longer curve. The wall
clock never shares: a wall-clock trial measures itself. May import: :mod:`paci_tune.train` (the clock),
:mod:`paci_tune.pipeline` (the cut), :mod:`paci_tune.sim` (the profile), :mod:`paci_tune.config`,
:mod:`paci_tune.errors`, optuna and the tune layer's :mod:`.curves`, :mod:`.point`, :mod:`.record`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from ..config import derive_doc, derive_run
from ..config.schema import RunConfig
from ..config.tune import TuneConfig
from ..errors import ConfigError
from ..pipeline.planning import budget_cut
from ..sim.profile import Profile
from ..train.clock import ProfileClock, run_clock
from ..train.nearness import after_validation, validated
from .curves import numerics_key
from .point import TrialParams
from .record import TrialRecord

VALIDATIONS = 20
"""Validations per budget at least, on the class's fastest layout: time to target to 1/20 of the budget."""

SHARED_DRAW = "sequence"


def applies(tune: TuneConfig, profile: str | None) -> bool:
    """Whether a search shares curves: switched on, a budget in seconds of a profile clock, a profile."""
    b = tune.budget
    return tune.search.share_curves and b.clock != "wall" and b.seconds is not None and profile is not None


@dataclass(frozen=True)
class StepGrid:
    """What makes a trial's curve its numerics' alone: the class horizon and the validation step."""

    horizon: int  # lr_schedule.horizon_steps: the most steps a point of the class fits in the budget
    every: int  # validate (and score) every this many steps
    draw: str | None  # data.draw to set (None: the run file names one)
    members: int = 1  # points of the space in the class
    far: int | None = None  # far from the target, validate only every this many steps (training.eval_far_every)

    def overrides(self) -> dict[str, Any]:
        draw = {"data.draw": self.draw} if self.draw else {}
        return {
            "lr_schedule.horizon_steps": self.horizon,
            "training.eval_every": self.every,
            "training.eval_far_every": self.far,
            "training.eval_every_seconds": None,
            **draw,
        }


def layout_clock(cfg: RunConfig, profile: Profile) -> tuple[ProfileClock, int, list[int]]:
    """The clock of ``cfg``'s layout on the cut its run will use, the global batches it fits in the budget, the cut.

    The cut is what a run resolves on a profile (:func:`~paci_tune.pipeline.planning.budget_cut`): the fastest,
    under ``hardware.memory`` when it is set.
    """
    cut = budget_cut(cfg, profile)
    clock = run_clock(cfg, profile, cfg.layout.with_partition(cut))
    assert cfg.training.seconds is not None
    return clock, clock.batches_within(None, cfg.training.seconds), cut


@dataclass(frozen=True)
class Replay:
    """Where a layout's run would validate and when: (step, clock) of each scored validation in its budget."""

    points: list[tuple[int, float]]
    steps: int  # the global batches the budget holds
    clock_end: float  # the clock when they are done
    cut: list[int]


def replay_points(cfg: RunConfig, profile: Profile, first_step: int, every: int) -> Replay:
    """The scored validations of ``cfg``'s run, as its trainer would place them: one segment (a trial
    does not checkpoint) of the batches its budget holds, from ``first_step`` (a warm start's), a
    validation after each global batch ``k`` with ``k % every == 0``, read when every stage has applied it
    (a budget that holds no batch: the run's one validation, of its start)."""
    clock, n, cut = layout_clock(cfg, profile)
    if n == 0:  # not one batch fits: the run validates its start, at its first clock reading
        return Replay([(first_step, clock.now())] if first_step % every == 0 else [], 0, clock.now(), cut)
    clock.begin_segment(n)
    points = [(first_step + i + 1, clock.model_done(i)) for i in range(n) if (first_step + i + 1) % every == 0]
    clock.end_segment(n)
    return Replay(points, n, clock.now(), cut)


def walk(
    replay: Replay, curve: dict[int, float], target: float, grid: StepGrid
) -> list[tuple[int, float, float]] | None:
    """(step, clock, val_loss) of each validation the run would score, up to its first at or below ``target``,
    read from ``curve``; None when the curve lacks one of them (the trial must train). Far from the target
    the run validates only at ``grid.far`` points, as its trainer decides (:mod:`paci_tune.train.nearness`)."""
    out: list[tuple[int, float, float]] = []
    far_vals: list[float] = []
    near = False
    for step, clock in replay.points:
        if not validated(step, grid.every, grid.far, near):
            continue
        if step not in curve:
            return None
        out.append((step, clock, curve[step]))
        near = after_validation(far_vals, step, curve[step], grid.far, target)
        if curve[step] <= target:
            break
    return out


class Horizons:
    """Each trial's :class:`StepGrid`, its class horizon computed once from every point of the space.

    ``doc_for(params)``: a point's trial run without sharing (:meth:`.search.Search.trial_doc`'s). A
    class is the points whose runs have one numerics key at a common horizon. A space without a grid
    (a continuous LR range) has no enumerable classes: each point's horizon is then its own steps.
    """

    def __init__(
        self,
        tune: TuneConfig,
        points: Callable[[], list[TrialParams]],
        doc_for: Callable[[TrialParams], dict[str, Any]],
        profile: Profile,
    ) -> None:
        self.doc_for, self.profile, self._points = doc_for, profile, points
        self.grid_per_budget = max(VALIDATIONS, tune.budget.grid)
        self.far_per_budget = tune.budget.grid if tune.search.validate_near_target else None
        self.draw = None if "draw" in (tune.run_doc.get("data") or {}) else SHARED_DRAW
        self._horizons: dict[str, tuple[int, int]] | None = None  # class key: (horizon, members)
        self._grids: dict[TrialParams, StepGrid] = {}  # asked for several times a trial: one simulation each
        self._classes: dict[TrialParams, tuple[str | None, int]] = {}

    def _class(self, params: TrialParams) -> tuple[str | None, int]:
        """(class key, steps in the budget) of a point (once per point: a layout's clock is simulated)."""
        if params not in self._classes:
            self._classes[params] = self._class_of(params)
        return self._classes[params]

    def _class_of(self, params: TrialParams) -> tuple[str | None, int]:
        doc = self.doc_for(params)
        over: dict[str, Any] = {"lr_schedule.horizon_steps": 1} | ({"data.draw": self.draw} if self.draw else {})
        key = numerics_key(derive_run(derive_doc(doc, over)))
        return key, layout_clock(derive_run(doc), self.profile)[1]

    def key_of(self, params: TrialParams) -> str | None:
        """The point's class: the numerics key of its run at any horizon (None: its LR reads the wall clock)."""
        return self._class(params)[0]

    def _all(self) -> dict[str, tuple[int, int]]:
        if self._horizons is None:
            horizons: dict[str, tuple[int, int]] = {}
            try:
                points = self._points()
            except ConfigError:
                points = []
            for q in points:
                key, n = self._class(q)
                if key is not None:
                    most, members = horizons.get(key, (0, 0))
                    horizons[key] = (max(most, n), members + 1)
            self._horizons = horizons
        return self._horizons

    def grid(self, params: TrialParams) -> StepGrid:
        if params not in self._grids:
            key, n = self._class(params)
            horizon, members = self._all().get(key, (n, 1)) if key is not None else (n, 1)
            horizon = max(1, horizon)
            every = max(1, horizon // self.grid_per_budget)
            far = None if self.far_per_budget is None else every * max(1, round(horizon / self.far_per_budget / every))
            self._grids[params] = StepGrid(horizon, every, self.draw, members, far if far != every else None)
        return self._grids[params]


def stored_curve(studies: Iterable[optuna.Study], key: str) -> tuple[dict[int, float], str, int] | None:
    """Every stored validation of numerics ``key``, by step (trials of any study of the search, oldest
    first), with the study and number of the first trial that trained it; None when none did."""
    curve: dict[int, float] = {}
    source: tuple[str, int] | None = None
    for study in studies:
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            rec = TrialRecord.read(t)
            n = rec.numerics
            if n is None or n.get("key") != key or rec.shared_from is not None or rec.repeat_of is not None:
                continue
            for step, val in n["curve"]:
                curve.setdefault(int(step), float(val))
            if source is None:
                source = (study.study_name, t.number)
    return None if source is None else (curve, *source)
