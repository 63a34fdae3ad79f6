"""Clocks: what "time" means for budgets, LR schedules, evaluation points and time-to-accuracy.

- ``wall``: measured seconds of training since the run started (carried over a resume).
- ``rst``: Reference System Time ("No Train No Gain", Kaddour et al. 2023): the time the run's
  steps take on a *reference system*, read from a cost profile measured once on it. The reading
  is a pure function of the configuration and the steps done, so it is identical across runs and
  machines, and immune to noise.
- ``sim``: the same computation with a profile of *this* machine: the numerics come from the
  (usually emulated) runtime, the time from simulating the P-stage pipeline on that profile, so a
  deep pipeline can be timed and tuned on one device.

Profile clocks time each segment by replaying the segment's own action lists
(:func:`paci_tune.sim.simulate`), so the fill and drain at evaluation points are paid for, and
the reading at global batch k is when the last stage closes batch k. A schedule the simulator
times but the runtime does not run (interleaved 1F1B, ZB-H1: :mod:`.timed`) is timed from its own
lists and cut, while the runtime computes 1F1B's numbers. With ``data_parallel = D``
the simulated layout is D replicas of the pipeline on P x D devices: each stage's step also pays
its dp group's gradient all-reduce (:mod:`paci_tune.sim.simulator`); D = 1 reads exactly as before.
PACI with ``pipeline.backward_weights: forward`` also pays, at each step that keeps a weight version
for in-flight backwards, the profile's ``copy_s`` of the stage's weights (0 for a profile without
it); ``current`` and the flush schedules pay nothing.
Evaluation is not training time: it does not advance them, and the wall clock leaves it out.
A budget in seconds is simulated ahead, so one that would take too long to simulate
(:data:`SIMULATED_PASSES_MAX`) is refused, naming ``training.seconds``, rather than never starting.
May import: :mod:`paci_tune.sim`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.layout import Layout
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..schedule import Op, schedule_of
from ..sim.profile import Profile
from ..sim.simulator import simulate

CLOCKS = ("wall", "rst", "sim")

SIMULATED_PASSES_MAX = 2_000_000
"""The most micro-batch passes (global batches x window x pipeline pieces) a budget in seconds may make a
profile clock simulate ahead: its segments are planned whole, about 25 us a pass, so this is under a minute
of planning. A budget of more is refused (:meth:`ProfileClock.batches_within`) rather than never starting."""


class Clock(Protocol):
    """What the trainer reads time from; every difference between clocks is behind these members.

    Readings are seconds of training on the clock's terms, never counting evaluation.
    """

    name: str
    """The config's ``training.clock``: ``wall``, ``rst`` or ``sim`` (recorded in the summary)."""

    measured: bool
    """True when readings are measured while the run goes and cannot be predicted: a segment then
    runs without a known length, and stage 0 checks the time budget and ``eval_every_seconds`` at
    each evaluation point. False when every reading is known before the segment runs."""

    last_busy: list[float]
    """Per stage: the clock's seconds of training compute in the last segment (empty: the clock has none)."""

    @property
    def analytic_bubble(self) -> float | None:
        """The schedule's textbook bubble on the clock's costs (None: the clock has no costs, wall)."""
        ...

    def now(self) -> float:
        """The reading now: at a segment's start, between segments, or mid-segment on a measured clock."""
        ...

    def begin_segment(self, n_batches: int | None) -> None:
        """A segment of ``n_batches`` global batches starts (``None``: its length is not known ahead)."""
        ...

    def batch_done(self, index: int) -> float:
        """The reading when the segment's ``index``-th global batch (0-based) completes at the last stage."""
        ...

    def model_done(self, index: int) -> float:
        """The reading when every stage has applied the segment's ``index``-th global batch."""
        ...

    def end_segment(self, n_batches: int) -> None:
        """The segment ran ``n_batches`` (fewer than begun when the run ended on the way)."""
        ...

    def batches_within(self, n_batches: int | None, budget: float) -> int | None:
        """How many of the next ``n_batches`` (``None``: unbounded) may run within ``budget`` seconds.

        ``None`` back: the budget is checked on the way, not ahead.
        """
        ...

    def model_ends(self, n_batches: int | None) -> Sequence[float] | None:
        """Per batch of a segment of ``n_batches`` starting now: the reading when its model is complete.

        ``None`` when it cannot be known before the segment runs.
        """
        ...

    def exclude(self, seconds: float) -> None:
        """``seconds`` this process spent evaluating inside a segment: not training time."""
        ...


class WallClock:
    """Seconds of this run's training so far, including the time before a resume (``offset``).

    Evaluation is not training: the seconds this process spent evaluating inside segments are
    taken out (:meth:`exclude`), for every schedule alike, and a drained evaluation between
    segments is never on the clock.
    """

    name = "wall"
    measured = True

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.last_busy: list[float] = []  # no per-stage figures: the runtime's timing is the wall's
        self._start = time.perf_counter()
        self._excluded = 0.0

    def now(self) -> float:
        return self.offset + time.perf_counter() - self._start - self._excluded

    @property
    def analytic_bubble(self) -> None:
        """Wall time has no costs to put in a formula."""
        return None

    def exclude(self, seconds: float) -> None:
        self._excluded += seconds

    def begin_segment(self, n_batches: int | None) -> None:
        pass

    def batch_done(self, index: int) -> float:
        return self.now()

    def model_done(self, index: int) -> float:
        return self.now()

    def end_segment(self, n_batches: int) -> None:
        pass

    def batches_within(self, n_batches: int | None, budget: float) -> int | None:
        """Wall time cannot be known ahead: run the segment, the budget is checked on the way."""
        return n_batches

    def model_ends(self, n_batches: int | None) -> None:
        """Not known ahead: evaluation points are candidates that stage 0 decides on by its clock."""
        return None


@dataclass(frozen=True)
class SegmentPlan:
    """Predicted times, from the segment's start, at which each of its global batches completes.

    ``batch_end[i]``: the last stage closes batch ``i`` (its loss is known); ``model_end[i]``: every
    stage has applied it (the model after batch ``i`` exists, what an evaluation scores).
    """

    batch_end: tuple[float, ...]
    model_end: tuple[float, ...]
    makespan: float
    busy: tuple[float, ...] = ()  # per stage: seconds of training compute in the segment
    analytic_bubble: float = 0.0  # the schedule's textbook bubble on this profile (SimResult.analytic_bubble_fraction)


_PLANS: dict[tuple[int, Layout, bool, str], tuple[Profile, dict[int, SegmentPlan]]] = {}
"""Every simulated segment of this process, by (profile, layout, sync_steps, backward_weights): a search
reads the same layouts' clocks many times (:mod:`paci_tune.tune.sharing`), each a few simulations."""


class ProfileClock:
    """``rst`` or ``sim``: readings are what ``profile`` says this pipeline's training actions take."""

    measured = False

    def __init__(
        self,
        name: str,
        profile: Profile,
        layout: Layout,
        *,
        sync_steps: bool = False,
        offset: float = 0.0,
        backward_weights: str = "forward",
    ) -> None:
        """``layout``: the run's, its cut set; ``sync_steps``: a flush that clips the whole model's norm."""
        self.name, self.profile, self.layout = name, profile, layout
        self.sync_steps, self.backward_weights = sync_steps, backward_weights
        self.reading = offset
        key = (id(profile), layout, sync_steps, backward_weights)  # the profile is kept alive beside its plans
        self._plans: dict[int, SegmentPlan] = _PLANS.setdefault(key, (profile, {}))[1]
        self._current: SegmentPlan | None = None
        self.last_busy: list[float] = []  # per stage: the last segment's simulated compute

    def now(self) -> float:
        return self.reading

    @property
    def analytic_bubble(self) -> float:
        """The layout's textbook bubble on the profile's costs (:attr:`SegmentPlan.analytic_bubble`)."""
        return self.plan(1).analytic_bubble

    def exclude(self, seconds: float) -> None:
        """Evaluation never advances a profile clock."""

    def plan(self, n_batches: int) -> SegmentPlan:
        """Simulate a drained segment of ``n_batches`` global batches (cached by length)."""
        if n_batches not in self._plans:
            res = simulate(
                self.layout,
                self.profile,
                n_batches,
                extend=False,
                sync_steps=self.sync_steps,
                backward_weights=self.backward_weights,
            )
            steps = [[end for act, _, end in st.intervals if act.op is Op.STEP] for st in res.timeline.stages]
            model = tuple(max(per[i] for per in steps) for i in range(n_batches))
            busy = tuple(st.busy for st in res.timeline.stages)
            self._plans[n_batches] = SegmentPlan(
                tuple(steps[-1]), model, res.timeline.makespan, busy, res.analytic_bubble_fraction
            )
        return self._plans[n_batches]

    def begin_segment(self, n_batches: int | None) -> None:
        assert n_batches is not None, "a profile clock's segments have a known length"
        self._current = self.plan(n_batches)

    def batch_done(self, index: int) -> float:
        """Reading when the segment's ``index``-th global batch (0-based) completes."""
        assert self._current is not None
        return self.reading + self._current.batch_end[index]

    def model_done(self, index: int) -> float:
        """Reading when every stage has applied the segment's ``index``-th global batch."""
        assert self._current is not None
        return self.reading + self._current.model_end[index]

    def end_segment(self, n_batches: int) -> None:
        """The segment ran ``n_batches`` (fewer than planned when the run ended on the way: its drain is shorter)."""
        assert self._current is not None
        done = self.plan(n_batches)
        self.reading += done.makespan
        self.last_busy = list(done.busy)
        self._current = None

    def model_ends(self, n_batches: int | None) -> list[float] | None:
        """Read off the segment's simulated timeline (``None`` for a segment of unknown length)."""
        if n_batches is None:
            return None
        return [self.reading + end for end in self.plan(n_batches).model_end]

    def batches_within(self, n_batches: int | None, budget: float) -> int:
        """The most batches (up to ``n_batches``, unbounded if ``None``; 0 if not even one) whose segment
        ends within ``budget``."""
        if n_batches is None:
            n_batches = 2**40
        left = budget - self.reading
        if self.plan(1).makespan > left:
            return 0
        self._check_budget(n_batches, budget)
        # makespan(n) >= n * floor (each batch costs every stage the same compute): a cheap upper end.
        floor = max(self.plan(1).busy, default=0.0)
        hi = min(n_batches, int(left / floor) + 1) if floor > 0 else n_batches
        if hi <= 64:
            return self._search(1, hi, left)
        if self.plan(hi).makespan <= left:
            return hi
        # A drained segment's makespan is close to fill + n * period: guess from the two ends, then
        # gallop to bracket the answer and bisect -- a few plans of the budget's length, not log2(n).
        period = (self.plan(hi).makespan - self.plan(1).makespan) / (hi - 1)
        guess = min(max(1 + int((left - self.plan(1).makespan) / period), 1), hi - 1) if period > 0 else 1
        step = 1
        if self.plan(guess).makespan <= left:
            lo = guess
            while lo + step < hi and self.plan(lo + step).makespan <= left:
                lo, step = lo + step, 2 * step
            return self._search(lo, min(lo + step, hi), left)
        top = guess
        while top - step > 1 and self.plan(top - step).makespan > left:
            top, step = top - step, 2 * step
        return self._search(max(top - step, 1), top, left)

    def _search(self, lo: int, hi: int, left: float) -> int:
        """The most batches in [lo, hi] whose segment ends within ``left`` (``lo``'s is known to), by
        doubling from ``lo`` then bisecting: makespan grows with the batch count."""
        while lo < hi and self.plan(min(2 * lo, hi)).makespan <= left:
            lo = min(2 * lo, hi)
        hi = min(2 * lo, hi)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.plan(mid).makespan <= left:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _check_budget(self, n_batches: int, budget: float) -> None:
        """Refuse a budget whose segment is too long to simulate (:data:`SIMULATED_PASSES_MAX`).

        Each batch costs every stage the same compute, so the busiest stage's seconds in one batch are a
        floor under each batch's time: ``budget / floor`` bounds the batches a budget can hold, cheaply.
        """
        per_batch = max(1, self.layout.window * self.layout.virtual_stages)
        most = SIMULATED_PASSES_MAX // per_batch
        floor = max(self.plan(1).busy, default=0.0)
        left = budget - self.reading
        if n_batches <= most or (floor > 0 and left / floor <= most):
            return
        largest = self.reading + most * floor
        allowed = (
            f"at most {largest:.6g} seconds (budget.seconds in a search) for this layout on the {self.name} clock: "
            f"a budget is simulated ahead, at most {most} global batches of {per_batch} passes, and one takes at "
            f"least {floor:.3g} s on the profile; use training.steps or a shorter budget"
        )
        raise ConfigError("training.seconds", budget, allowed)


def run_clock(cfg: RunConfig, profile: Profile, layout: Layout, offset: float = 0.0) -> ProfileClock:
    """The profile clock of run ``cfg`` on ``layout`` (its cut pinned): what its trainer reads, and what a
    search reads to time a layout against a curve another layout trained (:mod:`paci_tune.tune.sharing`)."""
    t, p = cfg.training, cfg.pipeline
    sync_steps = schedule_of(p.schedule).synchronous and bool(cfg.optimizer.grad_clip)
    return ProfileClock(
        t.clock, profile, layout, sync_steps=sync_steps, backward_weights=p.backward_weights, offset=offset
    )


def check_seconds_budget(cfg: RunConfig, profile: Profile | None) -> None:
    """Refuse, before any work, a budget in seconds too long for ``cfg``'s profile clock to simulate ahead.

    ``cfg`` as resolved (its cut pinned), ``profile`` its clock's. What the clock itself refuses at the
    first segment (:meth:`ProfileClock.batches_within`), checked where a command validates its run, so a
    refusal comes before the model is built or a worker started. A wall clock has nothing to simulate.
    """
    t = cfg.training
    if t.clock == "wall" or t.seconds is None or profile is None:
        return
    clock = run_clock(cfg, profile.for_optimizer(cfg.optimizer.timing_key), cfg.layout)
    segment = min(n for n in (t.checkpoint_every or None, t.steps, 2**40) if n is not None)  # as the trainer cuts
    if clock.plan(1).makespan <= t.seconds:
        clock._check_budget(segment, t.seconds)
