"""A stage's program: its action list generated lazily, with evaluations in it and an end set on the way.

:func:`paci_tune.schedule.stage_actions` is a finite segment of the run; a :class:`Program` is the
same list produced one action at a time, so a run never materialises millions of actions, and so
its end can be decided while it runs (a target reached, a wall-clock budget spent). Two additions:

- **Evaluation actions.** ``EVAL(k)`` scores the model after update ``k`` (the step closing global
  batch ``k``) without draining anything. Stage 0 evaluates right after its ``STEP(k)``; stage
  ``s > 0`` right after its forward of micro-batch ``b(k)`` -- the last micro-batch stage 0 forwarded
  before its ``STEP(k)`` -- or after its own ``STEP(k)`` if that comes later, and in either case
  before its next forward. On every link the evaluation's messages therefore travel between the same
  two forwards, so the receiver finds them in order, and no stage waits for them longer than for its
  next forward's input. A stage that steps again before it evaluates scores a snapshot of its
  weights taken just before that later step (the runtimes do this; the list says when).
- **An end decided on the way.** ``set_end(J, at=k)``: decided at stage 0's ``EVAL(k)``, the run
  ends after global batch ``J``, the batch holding ``b(k)``, so every micro-batch already injected is
  finished and nothing is abandoned. What any stage has already executed is a prefix of the shorter
  program (a PACI list for fewer batches is the longer one without its last forwards), so the
  switch is safe at every stage; evaluations after ``k`` are dropped (the run's last evaluation is
  of the drained model, after the end).

The schedules built as torch's classes order them (:mod:`.registry`'s builders) have no :class:`Program`:
:func:`stage_actions` and :func:`build` give their segments. May import: :mod:`.actions`,
:mod:`.registry` and the standard library (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from .actions import Action, Op
from .registry import OWN_PROGRAM, schedule_of

EvalAt = Callable[[int], bool]
"""``eval_at(k)``: whether the model after the step closing global batch ``k`` is evaluated."""


def _never(k: int) -> bool:
    return False


class Program:
    """Stage ``stage``'s actions from global batch ``first_batch`` to ``end`` (``None``: open-ended).

    Iterating yields the actions in order; :meth:`set_end` may shorten the run while it is being
    iterated (module docstring).
    """

    def __init__(
        self,
        schedule: str,
        stage: int,
        stages: int,
        window: int,
        first_batch: int,
        end: int | None = None,
        *,
        inflight: int | None = None,
        eval_at: EvalAt | None = None,
    ) -> None:
        spec = schedule_of(schedule)
        if not spec.own_program:
            raise ValueError(f"no Program for schedule {schedule!r}; expected one of {OWN_PROGRAM}")
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} out of range for {stages} stages")
        if end is not None and end < first_batch:
            raise ValueError(f"a program must run at least one batch: first {first_batch}, end {end}")
        self.schedule, self.stage, self.stages, self.window = schedule, stage, stages, window
        self.first_batch, self.end, self.inflight = first_batch, end, inflight
        self.eval_at = eval_at or _never
        self.decided_at: int | None = None  # the EVAL at which a dynamic end was set
        self.spec = spec
        self.cap = spec.inflight_cap(stage, stages, window, inflight)
        self._cap0 = spec.inflight_cap(0, stages, window, inflight)

    # ------------------------------------------------------------------------------ the end
    def last_mb(self) -> float:
        return math.inf if self.end is None else (self.end + 1) * self.window - 1

    def anchor(self, k: int) -> float:
        """``b(k)``: the last micro-batch stage 0 forwards before its ``STEP(k)``."""
        a = self.window
        b = (k + 1) * a + self._cap0 - 2 if self.spec.asynchronous else (k + 1) * a - 1
        return min(b, self.last_mb())

    def end_if_decided_at(self, k: int) -> int:
        """The last global batch when the run is ended at stage 0's ``EVAL(k)``: the batch holding ``b(k)``."""
        return int(self.anchor(k)) // self.window

    def set_end(self, end: int, at: int) -> None:
        """End the run after global batch ``end``, decided at stage 0's ``EVAL(at)``."""
        if end != self.end_if_decided_at(at):
            raise ValueError(f"an end decided at EVAL({at}) is batch {self.end_if_decided_at(at)}, not {end}")
        self.end, self.decided_at = end, at

    def evaluates(self, k: int) -> bool:
        """Whether this program evaluates the model after batch ``k`` (an evaluation point not dropped by an end)."""
        if self.decided_at is not None and k > self.decided_at:
            return False
        return (self.end is None or k <= self.end) and self.eval_at(k)

    # ------------------------------------------------------------------------------ actions
    def __iter__(self) -> Iterator[Action]:
        if self.spec.asynchronous:
            return self._one_f_one_b()
        return self._flushing()

    def _one_f_one_b(self) -> Iterator[Action]:
        """PACI: 1F1B with ``cap`` in flight across batch boundaries; a step after every window of backwards."""
        a, s = self.window, self.stage
        fwd = bwd = self.first_batch * a
        pending: list[int] = []  # evaluations whose anchor forward is done (stage > 0)
        stepped = self.first_batch - 1
        while fwd - self.first_batch * a < self.cap - 1 and fwd <= self.last_mb():
            yield Action(Op.FORWARD, fwd)
            pending += self._anchored_at(fwd)
            fwd += 1
        while bwd <= self.last_mb():
            if fwd <= self.last_mb():
                assert not pending, f"stage {s}: EVAL{pending} would follow the forward of micro-batch {fwd}"
                yield Action(Op.FORWARD, fwd)
                pending += self._anchored_at(fwd)
                fwd += 1
                yield from self._due(pending, stepped)
            yield Action(Op.BACKWARD, bwd)
            bwd += 1
            if bwd % a == 0:
                stepped = bwd // a - 1
                yield Action(Op.STEP, stepped)
                if s == 0:
                    if self.evaluates(stepped):
                        yield Action(Op.EVAL, stepped)
                else:
                    yield from self._due(pending, stepped)
        yield from self._due(pending, stepped)

    def _flushing(self) -> Iterator[Action]:
        """1F1B-flush and GPipe: each global batch drains, and every stage then steps and may evaluate."""
        a, k = self.window, self.first_batch
        while self.end is None or k <= self.end:
            mbs = range(k * a, (k + 1) * a)
            if self.spec.whole_batch_inflight:
                yield from (Action(Op.FORWARD, m) for m in mbs)
                yield from (Action(Op.BACKWARD, m) for m in mbs)
            else:
                warm = min(self.cap - 1, a)
                yield from (Action(Op.FORWARD, m) for m in mbs[:warm])
                for i in range(a):
                    if warm + i < a:
                        yield Action(Op.FORWARD, mbs[warm + i])
                    yield Action(Op.BACKWARD, mbs[i])
            yield Action(Op.STEP, k)
            if self.evaluates(k):
                yield Action(Op.EVAL, k)
            k += 1

    def _anchored_at(self, mb: int) -> list[int]:
        """Evaluations stage ``s > 0`` runs once it has forwarded ``mb`` (their ``b(k)``) and stepped ``k``."""
        if self.stage == 0:
            return []
        a = self.window
        out = []
        if self.spec.asynchronous and mb < self.last_mb():
            k = (mb - self._cap0 + 2) // a - 1  # the k with (k+1)a + cap0 - 2 == mb, when there is one
            if (k + 1) * a + self._cap0 - 2 == mb and k >= self.first_batch and self.evaluates(k):
                out.append(k)
        elif self.spec.asynchronous and mb == self.last_mb():
            # The last forward: every evaluation whose b(k) would lie beyond it is anchored here.
            k0 = -((self._cap0 - 2 - mb) // a) - 1  # the least k with (k+1)a + cap0 - 2 >= mb
            assert self.end is not None
            out += [k for k in range(max(k0, self.first_batch), self.end + 1) if self.evaluates(k)]
        return out

    def _due(self, pending: list[int], stepped: int) -> Iterator[Action]:
        """The pending evaluations whose step this stage has taken, oldest first."""
        while pending and pending[0] <= stepped:
            k = pending.pop(0)
            if self.evaluates(k):
                yield Action(Op.EVAL, k)


def stage_actions(
    schedule: str,
    stage: int,
    stages: int,
    window: int,
    first_batch: int,
    n_batches: int,
    inflight: int | None = None,
    chunks: int = 1,
) -> list[Action]:
    """Ordered actions of one stage for global batches ``first_batch .. first_batch+n_batches-1``.

    The list of a drained segment of the run (the runtimes drain at checkpoints and at the end);
    it is :class:`~paci_tune.schedule.program.Program`'s output for that segment, without evaluations.
    A schedule with a builder of its own (:mod:`.synchronous`, :mod:`.vshape`; ``chunks`` model chunks per
    stage) comes from there instead, each batch drained, then ``STEP(k)``.
    """
    spec = schedule_of(schedule)
    if spec.builder is None:
        if chunks != 1:
            raise ValueError(f"{schedule} runs one chunk per stage, not {chunks}")
        program = Program(schedule, stage, stages, window, first_batch, first_batch + n_batches - 1, inflight=inflight)
        return list(program)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    refused = spec.refusal(stages, window, chunks)
    if refused is not None:
        raise ValueError(refused[1])
    out: list[Action] = []
    for k in range(first_batch, first_batch + n_batches):
        out += spec.builder(stage, stages, window, chunks, k * window)
        out.append(Action(Op.STEP, k))
    return out


def build(
    schedule: str,
    stages: int,
    window: int,
    first_batch: int,
    n_batches: int,
    inflight: int | None = None,
    chunks: int = 1,
) -> list[list[Action]]:
    """Every stage's action list for one segment of the run (``chunks``: model chunks per stage)."""
    return [stage_actions(schedule, s, stages, window, first_batch, n_batches, inflight, chunks) for s in range(stages)]


def needs_snapshot(actions: list[Action]) -> set[int]:
    """The ``k`` of every ``EVAL(k)`` this stage reaches after a later step: it must score a snapshot."""
    out: set[int] = set()
    last_step = -1
    for act in actions:
        if act.op is Op.STEP:
            last_step = act.mb
        elif act.op is Op.EVAL and last_step > act.mb:
            out.add(act.mb)
    return out
