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

from .actions import Action, Op, dependency, execution_order, step_partners, virtual_stage

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
    simulator's statistics). Evaluation actions are not training time and are never placed. With
    ``sync_steps`` or ``step_groups`` the order must be :func:`~.actions.sweep`'s with the same
    arguments (see ``_arrival`` below).
    """

    def __init__(
        self,
        stages: int,
        latency: Latency | None = None,
        sync_steps: int | None = None,
        keep: bool = False,
        chunks: int = 1,
        step_groups: Sequence[Sequence[int]] = (),
        lead: Duration | None = None,
        placement: str = "looped",
    ) -> None:
        self.n, self.latency, self.sync_steps, self.chunks, self.lead = stages, latency, sync_steps, chunks, lead
        self.placement = placement
        self.partners = step_partners(stages, sync_steps, step_groups)
        self.free = [0.0] * stages
        self.busy = [0.0] * stages
        self.per_stage = [StageTimes() for _ in range(stages)] if keep else None
        self._finished: dict[tuple[int, Op, int, int], float] = {}
        # A synchronised STEP(k) at stage s waits until every other stage has finished all it does
        # before its own STEP(k). The caller's order is :func:`~.actions.sweep`'s, which holds STEP(k)
        # back until every stage has reached it: a stage that has not placed its STEP(k) yet is
        # then free at exactly that moment; one that has placed it left its arrival here. A step group
        # (tied parameters' holders) waits the same way among its stages, each arriving ``lead`` into
        # its step (its own all-reduce before the collective one: :meth:`place`).
        self._arrival: dict[tuple[int, int], float] = {}  # (stage, batch) -> its arrival at STEP(batch)

    @property
    def makespan(self) -> float:
        return max(self.free, default=0.0)

    def place(self, s: int, act: Action, duration: float) -> tuple[float, float]:
        """Start and end of ``act`` at stage ``s``: when the stage is free and its input has arrived.

        A STEP of a stage with partners (``sync_steps``, ``step_groups``) also waits for them: its
        first ``lead(s, step)`` seconds (0 without ``lead``; a data-parallel all-reduce before a tied
        one) are the stage's own, what follows starts once every partner has done its own lead.
        """
        assert act.op is not Op.EVAL, "evaluation is not training time"
        start = self.free[s]
        dep = dependency(act, s, self.n, self.chunks, self.placement)
        if dep is not None:
            arrive = self._finished.pop((dep[0], dep[1].op, dep[1].mb, dep[1].chunk))
            start = max(start, arrive + (self.latency(dep[0], s, act) if self.latency else 0.0))
        if self.partners[s] and act.op is Op.STEP:
            lead = [self.lead(o, act) if self.lead else 0.0 for o in range(self.n)]
            others = [self._arrival.get((o, act.mb), self.free[o] + lead[o]) for o in self.partners[s]]
            self._arrival[(s, act.mb)] = self.free[s] + lead[s]
            start = max(start, max(others) - lead[s])
            synced = [o for o in range(self.n) if self.partners[o]]
            if all((o, act.mb) in self._arrival for o in synced):
                for o in synced:  # every synchronised stage has stepped: the arrivals are no longer needed
                    del self._arrival[(o, act.mb)]
        end = start + duration
        if self._consumed(s, act):
            self._finished[(s, act.op, act.mb, act.chunk)] = end
        self.free[s] = end
        self.busy[s] += end - start
        if self.per_stage is not None:
            self.per_stage[s].intervals.append((act, start, end))
        return start, end

    def _consumed(self, s: int, act: Action) -> bool:
        """Whether an action at a neighbouring virtual stage waits for this one's finish time."""
        j = virtual_stage(s, act.chunk, self.n, self.placement)
        if act.op is Op.FORWARD:
            return j < self.chunks * self.n - 1
        if act.op is Op.BACKWARD:
            return j > 0
        return False


def replay(
    lists: list[list[Action]],
    duration: Duration,
    latency: Latency | None = None,
    sync_steps: int | None = None,
    chunks: int = 1,
    step_groups: Sequence[Sequence[int]] = (),
    lead: Duration | None = None,
    placement: str = "looped",
) -> Timeline:
    """Place every action of ``lists`` in time; see the module docstring.

    ``sync_steps=a``: steps wait for every stage's gradients of their batch (global-norm clipping
    in flush schedules, see :func:`~paci_tune.schedule.actions.step_partners`). ``chunks``: model
    chunks per stage, placed by ``placement`` (:func:`~.actions.virtual_stage`: ``looped`` for
    interleaved 1F1B, ``v`` for ZB-V and DualPipeV). ``step_groups``: stages whose steps meet in a collective
    (tied parameters' holders), ``lead(s, step)`` the part of a step before it (:meth:`Placer.place`).
    Evaluation actions are skipped: they cost no training time.
    """
    placer = Placer(len(lists), latency, sync_steps, True, chunks, step_groups, lead, placement)
    for s, act in execution_order(lists, sync_steps, chunks, step_groups, placement):
        if act.op is not Op.EVAL:
            placer.place(s, act, duration(s, act))
    assert placer.per_stage is not None
    return Timeline(placer.per_stage)


def drift_per_microbatch(actions: list[Action]) -> dict[int, int]:
    """Optimizer steps each micro-batch crosses between its forward and its backward on one stage.

    Drift depends only on the stage's local order, so it can be read off the action list; the
    runtimes measure it independently from the stage's update counter, and tests compare the two.
    Read on chunk 0 (the schedules with several chunks are synchronous: no drift on any chunk).
    """
    steps = 0
    at_forward: dict[int, int] = {}
    out: dict[int, int] = {}
    for act in actions:
        if act.op is Op.STEP:
            steps += 1
        elif act.chunk:
            continue
        elif act.op is Op.FORWARD:
            at_forward[act.mb] = steps
        elif act.op is Op.BACKWARD:
            out[act.mb] = steps - at_forward.pop(act.mb)
    return out


def releases_at(actions: Sequence[Action]) -> Op:
    """The op after which a micro-batch's activations are freed on this list: its ``W`` where the
    backward is split (the weight gradient still reads the layers' inputs), else its backward."""
    return Op.WEIGHT if any(act.op is Op.WEIGHT for act in actions) else Op.BACKWARD


def inflight_per_chunk(actions: Sequence[Action]) -> list[tuple[int, ...]]:
    """Micro-batches in flight on each chunk after every forward, walking one stage's action list.

    A micro-batch is in flight on a chunk from its forward until :func:`releases_at` (its ``W``
    under a zero-bubble schedule). The memory model weighs each chunk's count by that chunk's
    activation bytes and takes the largest sum; :func:`peak_inflight` is the plain count.
    """
    release = releases_at(actions)
    live = [0] * (max((act.chunk for act in actions), default=0) + 1)
    out: list[tuple[int, ...]] = []
    for act in actions:
        if act.op is Op.FORWARD:
            live[act.chunk] += 1
            out.append(tuple(live))
        elif act.op is release:
            live[act.chunk] -= 1
    return out


def peak_inflight(actions: Sequence[Action]) -> int:
    """Most micro-batches in flight at once (all chunks together), walking one stage's action list."""
    return max((sum(live) for live in inflight_per_chunk(actions)), default=0)
