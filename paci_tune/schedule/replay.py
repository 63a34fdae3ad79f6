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

from .actions import Action, Op, dependency, execution_order, step_barrier

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


def replay(
    lists: list[list[Action]],
    duration: Duration,
    latency: Latency | None = None,
    sync_steps: int | None = None,
) -> Timeline:
    """Place every action of ``lists`` in time; see the module docstring.

    ``sync_steps=a``: steps wait for every stage's backwards of their batch (global-norm clipping
    in flush schedules, see :func:`~paci_tune.schedule.actions.step_barrier`).
    """
    n = len(lists)
    free = [0.0] * n
    finished: dict[tuple[int, Action], float] = {}
    stages = [StageTimes() for _ in range(n)]
    for s, act in execution_order(lists, sync_steps):
        start = free[s]
        dep = dependency(act, s, n)
        if dep is not None:
            arrive = finished[dep] + (latency(dep[0], s, act) if latency else 0.0)
            start = max(start, arrive)
        if sync_steps:
            for other in step_barrier(act, s, n, sync_steps):
                start = max(start, finished[other])
        end = start + duration(s, act)
        finished[(s, act)] = end
        free[s] = end
        stages[s].intervals.append((act, start, end))
    return Timeline(stages)


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
