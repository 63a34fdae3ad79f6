"""Predict, then verify (``search.strategy: predict``): the next point a study trains is chosen by a model.

Time to target is a layout's step time (the simulator's, for nothing) times its curve's steps to target
(the numerics, a training each). So every feasible point is priced first, and trainings go only to what
changes the numerics:

- **a synchronous study** trains each of its curve classes (LR, optimizer, global batch: :mod:`.curves`)
  once, on the class's fastest layout; every other layout is read off that curve (:mod:`.siblings`);
- **PACI's study** ranks its untrained classes (P, a, LR, optimizer) by predicted time to target: the
  synchronous curve's steps at the same LR, optimizer and global batch, times PACI's statistical cost
  (:mod:`.predict`, fitted on the PACI classes trained so far, one model per optimizer), times the class's
  fastest step. It trains the best-predicted class whose optimistic bound (``search.verify_z`` standard
  deviations) beats the study's best time to target so far, refits, and is done when no untrained class
  could beat it. A class it cannot predict (its synchronous curve failed) is trained.

Each choice is queued in the study (:func:`.record.queue_planned`), so the study stays a real Optuna study:
storages, resume and several workers work as for sampled trials, and the pruner and capping still stop a
trained trial early. A class is settled by a finished trial of it in its study (planned, or one that trained
its curve; one whose worker died is not, and its retry or a new plan trains the class), and the planner
queues nothing while any trial waits in the study. May import: optuna, :mod:`paci_tune.config`,
:mod:`paci_tune.sim`, :mod:`paci_tune.schedule` and the tune layer's :mod:`.predict`, :mod:`.sharing`,
:mod:`.curves`, :mod:`.point`, :mod:`.space`, :mod:`.record`, :mod:`.extra`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..config import derive_run
from ..schedule import sides
from ..sim.profile import Profile
from . import extra
from .curves import numerics_key
from .point import TrialParams
from .predict import DelayModel, Fitted, Observation
from .record import REAPED, TrialRecord, queue_planned
from .sharing import replay_points, stored_curve
from .space import SearchSpace

Plan = Literal["queued", "wait", "done"]
"""A study's state: a planned trial waits in it; it waits for other trials (running, or the synchronous
curves PACI's predictions need); its search is over."""


@dataclass(frozen=True)
class Candidate:
    """An untrained PACI class at its fastest layout, with what its prediction needs."""

    params: TrialParams
    key: str
    step_s: float  # its layout's clock per global batch (the simulator's)
    budget_steps: int  # global batches its budget holds
    sync_steps: float | None  # the synchronous curve's steps to target at its LR (or a lower bound); None: unknown

    def times(self, fitted: Fitted | None, z: float) -> tuple[float, float]:
        """(predicted, optimistic) time to target; inf where even that misses the budget; (0, 0) when
        it cannot be predicted (it must be trained)."""
        if self.sync_steps is None or fitted is None:
            return 0.0, 0.0
        p = fitted.predict(self.params.stages, self.params.window, self.params.lr_scale)
        low = p.bounds(z)[0]
        return self._time(self.sync_steps * p.ratio), self._time(self.sync_steps * low)

    def _time(self, steps: float) -> float:
        return steps * self.step_s if steps <= self.budget_steps else math.inf


def choose(
    candidates: Sequence[Candidate], fits: Mapping[str | None, Fitted], best: float, z: float
) -> Candidate | None:
    """The candidate to train next: of those whose optimistic time beats ``best``, the one of best predicted
    time (ties: the space's order); None when none could beat it. ``fits``: the model of each optimizer
    recipe, None's for a recipe without its own."""
    scored = [(c.times(fits.get(c.params.optimizer) or fits.get(None), z), i, c) for i, c in enumerate(candidates)]
    open_ = [(t, i, c) for (t, low), i, c in scored if low < best]
    return min(open_, key=lambda r: (r[0], r[1]))[2] if open_ else None


def steps_to_target(curve: dict[int, float], target: float, first_step: int) -> tuple[float, bool]:
    """Steps from the start of training to the first validation at or below ``target``, and whether it got
    there (if not: the last validated step, a lower bound)."""
    for step in sorted(curve):
        if curve[step] <= target:
            return float(step - first_step), True
    return float(max(curve) - first_step) if curve else 0.0, False


@dataclass
class Planner:
    """Plans each study's next trial (module docstring)."""

    space: SearchSpace
    trial_doc: Callable[[TrialParams], dict[str, Any]]  # a point's trial run, its curve its numerics' alone
    profile: Profile
    first_step: int
    target: float
    z: float
    cap: int  # search.trials: the most planned trials a study runs, however the model ranks
    _steps: dict[TrialParams, tuple[float, int]] = field(default_factory=dict, repr=False)
    _keys: dict[TrialParams, str] = field(default_factory=dict, repr=False)
    _grids: dict[str, list[TrialParams]] = field(default_factory=dict, repr=False)  # the space is fixed
    _sync_keys: dict[TrialParams, str | None] = field(default_factory=dict, repr=False)

    def plan(self, studies: dict[str, optuna.Study], schedule: str) -> Plan:
        """Queue ``schedule``'s next planned trial unless one waits already; say where its study stands."""
        study = studies[schedule]
        trials = extra.search_trials(study)
        if any(t.state == TrialState.WAITING for t in trials):
            return "queued"  # planned, a dead worker's retry or another layout of a curve: those run first
        if sum(TrialRecord.read(t).plan_class is not None for t in trials) >= self.cap:
            return "wait" if _running(trials) else "done"
        settled, running = _classes_run(trials)
        untrained = {k: q for k, q in self._classes(schedule).items() if k not in settled | running}
        paci, _ = sides(studies)
        if schedule != paci:  # every class once, on its fastest layout (a curve trained elsewhere: read, free)
            if untrained:
                return self._queue(study, *next(iter(untrained.items())), None)
            return "wait" if running else "done"
        synced = self._synced(studies)
        candidates = []
        for key, q in untrained.items():
            sync = synced.get(self._sync_key(studies, q))
            if sync == "pending":
                return "wait"  # the synchronous curves come first: every prediction starts from one
            step_s, budget = self._step(q)
            candidates.append(Candidate(q, key, step_s, budget, None if sync is None else sync[0]))
        fits = self._fits(studies, trials, synced)
        pick = choose(candidates, fits, self._best(trials), self.z)
        if pick is None:
            return "wait" if running else "done"
        return self._queue(
            study, pick.key, pick.params, pick.times(fits.get(pick.params.optimizer) or fits[None], self.z)
        )

    # ------------------------------------------------------------------------------ the classes
    def key(self, q: TrialParams) -> str:
        """The numerics key a point's trial stores its curve under (its class's, at the class horizon)."""
        if q not in self._keys:
            self._keys[q] = str(numerics_key(derive_run(self.trial_doc(q))))
        return self._keys[q]

    def _classes(self, schedule: str) -> dict[str, TrialParams]:
        """Each numerics class of the schedule's feasible points, at its fastest layout (space order)."""
        out: dict[str, TrialParams] = {}
        for q in self._grid(schedule):
            key = self.key(q)
            if key not in out or self._step(q)[0] < self._step(out[key])[0]:
                out[key] = q
        return out

    def _grid(self, schedule: str) -> list[TrialParams]:
        if schedule not in self._grids:
            self._grids[schedule] = self.space.grid(schedule)
        return self._grids[schedule]

    def _step(self, q: TrialParams) -> tuple[float, int]:
        """(clock per global batch, global batches in the budget) of a point's layout (simulated once)."""
        if q not in self._steps:
            replay = replay_points(derive_run(self.trial_doc(q)), self.profile, self.first_step, 1)
            self._steps[q] = (replay.clock_end / replay.steps if replay.steps else math.inf, replay.steps)
        return self._steps[q]

    # --------------------------------------------------------------------------------- PACI's model
    def _sync_key(self, studies: dict[str, optuna.Study], q: TrialParams) -> str | None:
        """The class of the synchronous curve a PACI point is predicted from: the same LR, optimizer and global
        batch (None: no synchronous point matches)."""
        if q not in self._sync_keys:
            _, sync = sides(studies)
            same = (q.lr_scale, q.optimizer, q.global_batch)
            match = [r for s in sync for r in self._grid(s) if (r.lr_scale, r.optimizer, r.global_batch) == same]
            self._sync_keys[q] = self.key(match[0]) if match else None
        return self._sync_keys[q]

    def _synced(self, studies: dict[str, optuna.Study]) -> dict[str, tuple[float, bool] | Literal["pending"] | None]:
        """Each synchronous class's steps to target and whether it got there (if not -- stopped by the budget,
        the pruner or capping -- its steps are a lower bound, which keeps the prediction optimistic); "pending"
        before it ran; None when it failed. Read once per plan: one pass over the stored curves."""
        _, sync = sides(studies)
        keys = {self.key(r) for s in sync for r in self._grid(s)}
        settled = set().union(*(_classes_run(extra.search_trials(studies[s]))[0] for s in sync))
        out: dict[str, tuple[float, bool] | Literal["pending"] | None] = {}
        for key in keys:
            found = stored_curve(studies.values(), key)
            if found is not None:
                steps, reached = steps_to_target(found[0], self.target, self.first_step)
                out[key] = (max(steps, 1.0), reached)
            else:
                out[key] = None if key in settled else "pending"
        return out

    def _fits(
        self, studies: dict[str, optuna.Study], trials: list[FrozenTrial], synced: dict[str, Any]
    ) -> dict[str | None, Fitted]:
        """The delay model fitted per optimizer recipe (None: all pooled) on the PACI classes trained so far."""
        observed: dict[str | None, list[Observation]] = {}
        for t in trials:
            n = TrialRecord.read(t).numerics
            q = self._point(t)
            if n is None or q is None or t.state not in (TrialState.COMPLETE, TrialState.PRUNED):
                continue
            sync = synced.get(self._sync_key(studies, q))
            if not isinstance(sync, tuple) or not sync[1]:
                continue  # no ratio without the synchronous steps themselves
            steps, reached = steps_to_target({int(s): float(v) for s, v in n["curve"]}, self.target, self.first_step)
            obs = Observation(q.stages, q.window, q.lr_scale, max(steps, 1.0) / sync[0], reached)
            observed.setdefault(q.optimizer, []).append(obs)
        fits: dict[str | None, Fitted] = {o: DelayModel().fit(obs) for o, obs in observed.items()}
        fits[None] = DelayModel().fit([o for obs in observed.values() for o in obs])
        return fits

    def _point(self, t: FrozenTrial) -> TrialParams | None:
        """The feasible point a finished PACI trial ran (by its Optuna parameters)."""
        paci = self.space.paci
        return next((q for q in self._grid(paci) if self.space.params_of(q) == t.params), None) if paci else None

    @staticmethod
    def _best(trials: Iterable[FrozenTrial]) -> float:
        """The study's best time to target so far, over every layout answered (inf: none reached it)."""
        times = [TrialRecord.read(t).time_to_target for t in trials if t.state == TrialState.COMPLETE]
        return min((x for x in times if x is not None), default=math.inf)

    def _queue(self, study: optuna.Study, key: str, q: TrialParams, times: tuple[float, float] | None) -> Plan:
        """Queue ``q`` as the planned trial of class ``key`` (with its predicted and optimistic times)."""
        shown = None if times is None else [t if math.isfinite(t) else None for t in times]
        queue_planned(study, self.space.params_of(q), key, shown)
        return "queued"


def _classes_run(trials: Iterable[FrozenTrial]) -> tuple[set[str], set[str]]:
    """Numerics classes a study has finished (a planned trial of it, or a trained curve) and has running."""
    settled, running = set(), set()
    for t in trials:
        rec = TrialRecord.read(t)
        key = rec.plan_class or (rec.numerics.get("key") if rec.numerics else None)
        if key is None or t.state == TrialState.WAITING or rec.fail_reason == REAPED:
            continue  # a trial whose worker died settles nothing: its retry (or a new plan) trains the class
        (running if t.state == TrialState.RUNNING else settled).add(key)
    return settled, running - settled


def _running(trials: Iterable[FrozenTrial]) -> bool:
    return any(t.state == TrialState.RUNNING for t in trials)
