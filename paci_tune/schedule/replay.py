"""Replay schedule action lists on a time axis.

Given each action's duration (measured by the emulated runtime, or predicted from a cost
profile) and a transfer latency between neighbouring stages, place every action at the earliest
time its stage is free and its dependency has arrived. This is what a real pipeline with those
costs would do, so the emulated runtime can report the bubble the schedule would have, and the
simulator can predict step times, without running P processes. May import: :mod:`.actions` and the
standard library (no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .actions import Action, Op, dependency, execution_order

Duration = Callable[[int, Action], float]
Latency = Callable[[int, int, Action], float]


@dataclass
class StageTimes:
    """One stage's placed actions and the totals derived from them."""

    intervals: list[tuple[Action, float, float]] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return sum(end - start for _, start, end in self.intervals)

    @property
    def end(self) -> float:
        return self.intervals[-1][2] if self.intervals else 0.0


@dataclass
class Timeline:
    stages: list[StageTimes]

    @property
    def makespan(self) -> float:
        return max((st.end for st in self.stages), default=0.0)

    def bubble(self, stage: int) -> float:
        """Fraction of the makespan the stage spends waiting (the pipeline bubble at that stage)."""
        span = self.makespan
        return 0.0 if span <= 0 else 1.0 - self.stages[stage].busy / span

    @property
    def bubble_fraction(self) -> float:
        """Mean over stages of the idle share of the makespan: (P-1)/(m+P-1) for 1F1B with equal costs."""
        return sum(self.bubble(s) for s in range(len(self.stages))) / max(len(self.stages), 1)


class Placer:
    """Places actions in time one at a time, in any order that respects the dependencies.

    The online form of :func:`replay`: the emulated runtime places each training action as it runs
    it, so a run of any length is timed in constant memory (finish times are dropped once the
    action that waits for them is placed). ``keep=True`` keeps every interval (for pictures and the
    simulator's statistics). Evaluation actions are not training time and are never placed.
    """

    def __init__(self, stages: int, latency: Latency | None = None, sync_steps: int | None = None,
                 keep: bool = False) -> None:  # fmt: skip
        self.n, self.latency, self.sync_steps = stages, latency, sync_steps
        self.free = [0.0] * stages
        self.busy = [0.0] * stages
        self.per_stage = [StageTimes() for _ in range(stages)] if keep else None
        self._finished: dict[tuple[int, Op, int], float] = {}
        self._barrier_waiters: dict[int, int] = {}  # batch -> stages that have placed its synchronised step

    @property
    def makespan(self) -> float:
        return max(self.free, default=0.0)

    def place(self, s: int, act: Action, duration: float) -> tuple[float, float]:
        """Start and end of ``act`` at stage ``s``: when the stage is free and its input has arrived."""
        assert act.op is not Op.EVAL, "evaluation is not training time"
        start = self.free[s]
        dep = dependency(act, s, self.n)
        if dep is not None:
            key = (dep[0], dep[1].op, dep[1].mb)
            arrive = self._finished.pop(key) if not self._kept_for_barrier(key) else self._finished[key]
            start = max(start, arrive + (self.latency(dep[0], s, act) if self.latency else 0.0))
        if self.sync_steps and act.op is Op.STEP:
            last = act.mb * self.sync_steps + self.sync_steps - 1
            start = max([start] + [self._finished[(o, Op.BACKWARD, last)] for o in range(self.n) if o != s])
            seen = self._barrier_waiters[act.mb] = self._barrier_waiters.get(act.mb, 0) + 1
            if seen == self.n:  # every stage has stepped: the barrier's finish times are no longer needed
                del self._barrier_waiters[act.mb]
                for o in range(self.n):
                    self._finished.pop((o, Op.BACKWARD, last), None)
        end = start + duration
        if self._consumed(s, act):
            self._finished[(s, act.op, act.mb)] = end
        self.free[s] = end
        self.busy[s] += end - start
        if self.per_stage is not None:
            self.per_stage[s].intervals.append((act, start, end))
        return start, end

    def _consumed(self, s: int, act: Action) -> bool:
        """Whether some later action waits for this one's finish time."""
        if act.op is Op.FORWARD:
            return s < self.n - 1
        if act.op is Op.BACKWARD:
            return s > 0 or self._is_barrier(act)
        return False

    def _is_barrier(self, act: Action) -> bool:
        return bool(self.sync_steps) and act.op is Op.BACKWARD and act.mb % self.sync_steps == self.sync_steps - 1

    def _kept_for_barrier(self, key: tuple[int, Op, int]) -> bool:
        a = self.sync_steps
        return bool(a) and key[1] is Op.BACKWARD and key[2] % a == a - 1


def replay(
    lists: list[list[Action]],
    duration: Duration,
    latency: Latency | None = None,
    sync_steps: int | None = None,
) -> Timeline:
    """Place every action of ``lists`` in time; see the module docstring.

    ``sync_steps=a``: steps wait for every stage's backwards of their batch (global-norm clipping
    in flush schedules, see :func:`~paci_tune.schedule.actions.step_barrier`). Evaluation actions
    are skipped: they cost no training time.
    """
    placer = Placer(len(lists), latency, sync_steps, keep=True)
    for s, act in execution_order(lists, sync_steps):
        if act.op is not Op.EVAL:
            placer.place(s, act, duration(s, act))
    assert placer.per_stage is not None
    return Timeline(placer.per_stage)


def drift_per_microbatch(actions: list[Action]) -> dict[int, int]:
    """Optimizer steps each micro-batch crosses between its forward and its backward on one stage.

    Drift depends only on the stage's local order, so it can be read off the action list; the
    runtimes measure it independently from the stage's update counter, and tests compare the two.
    """
    steps = 0
    at_forward: dict[int, int] = {}
    out: dict[int, int] = {}
    for act in actions:
        if act.op is Op.FORWARD:
            at_forward[act.mb] = steps
        elif act.op is Op.BACKWARD:
            out[act.mb] = steps - at_forward.pop(act.mb)
        else:
            steps += 1
    return out


def peak_inflight(actions: Sequence[Action]) -> int:
    """Most micro-batches between forward and backward at once, walking one stage's action list."""
    live = peak = 0
    for act in actions:
        if act.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif act.op is Op.BACKWARD:
            live -= 1
    return peak
