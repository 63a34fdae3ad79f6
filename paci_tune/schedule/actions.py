"""Pipeline schedules as data: each stage's ordered list of actions.

This module is the single source of truth for what a schedule *is*. The emulated runtime, the
distributed runtime, ``SchedulePACI`` and the simulator all read these lists; nothing else
encodes a schedule. Numerics depend only on each stage's local order of actions, which is why two
runtimes that execute the same lists produce the same losses. May import: the standard library only
(no torch).

Micro-batches are numbered globally over the run. Global batch ``k`` is micro-batches
``k*a .. k*a + a - 1`` where ``a`` is the accumulation window. A ``STEP`` action carries the
index of the global batch whose gradients it applies: at every stage the backwards run in
micro-batch order, so the k-th local optimizer step always closes global batch k.

Schedules:

- ``gpipe``: per global batch, all forwards then all backwards, then every stage steps.
- ``1f1b``: per global batch, one-forward-one-backward with ``P - s`` micro-batches in flight at
  stage ``s``, then the pipeline drains (flush) and every stage steps.
- ``paci``: the same 1F1B steady state but the pipeline never flushes inside a segment: stage 0
  keeps injecting micro-batches of the next global batch, and each stage applies its optimizer
  after every ``a`` of its own backwards, with no coordination between stages.

The synchronous schedules of :mod:`.synchronous` (interleaved 1F1B, ZB-H1) add two things an action
can say: its model ``chunk`` (with ``v`` chunks per device, chunk ``c`` of stage ``s`` is virtual
stage ``c * P + s`` of ``v * P`` in model order, Megatron's and torch's looped placement), and the
``W`` op: the weight-gradient half of a backward whose ``B`` then computes only the input gradient.
Every schedule of the runtimes has one chunk and no ``W``, and reads exactly as before.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

SCHEDULES = ("paci", "1f1b", "gpipe")


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or only its input gradient where the list has W actions
    STEP = "S"
    EVAL = "E"  # score the model after STEP(mb) on the validation set (see :mod:`.program`)
    WEIGHT = "W"  # the weight-gradient half of a split backward (zero-bubble schedules)


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work at one stage: forward, backward (or its weight half ``W``) of micro-batch ``mb``
    on model chunk ``chunk``, an optimizer step closing global batch ``mb``, or an evaluation of the
    model after that step. ``repr``: ``F3``, and ``F3.1`` on chunk 1."""

    op: Op
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        base = f"{self.op.value}{self.mb}"
        return base if self.chunk == 0 else f"{base}.{self.chunk}"


def inflight_cap(schedule: str, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
    """Most micro-batches a stage holds between forward and backward under ``schedule``.

    1F1B-style schedules keep ``P - s`` in flight at stage ``s`` (what the last stage needs to never
    wait in steady state); ``inflight`` caps that further to trade bubble for activation memory.
    GPipe holds the whole global batch. ZB-H1 (:mod:`.synchronous`) keeps each micro-batch until its
    ``W``: ``min(P, m)`` at every stage, 1F1B's first stage's count.
    """
    if schedule == "gpipe":
        return window
    if schedule == "zb-h1":
        return max(min(stages, window), 1)
    cap = stages - stage
    if inflight is not None:
        cap = min(cap, inflight)
    if schedule == "1f1b":
        cap = min(cap, window)
    return max(cap, 1)


def drift_bound(stage: int, stages: int, window: int) -> int:
    """PACI's bound on optimizer updates a micro-batch crosses at stage ``s``: ceil((P-s-1)/a)."""
    return math.ceil((stages - stage - 1) / window)


def copies_bound(schedule: str, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
    """Most weight copies a stage holds for in-flight backwards with ``pipeline.backward_weights: forward``.

    A copy exists only for a version an in-flight micro-batch still references after a step; with
    ``k`` micro-batches in flight those span at most ``ceil((k-1)/a)`` versions older than the
    current one (PACI's drift bound, ``ceil((P-s-1)/a)`` at the default cap). Synchronous schedules
    never step with a micro-batch in flight: 0.
    """
    if schedule != "paci":
        return 0
    k = inflight_cap(schedule, stage, stages, window, inflight)
    return math.ceil((k - 1) / window)


def dependency(action: Action, stage: int, stages: int, chunks: int = 1) -> tuple[int, Action] | None:
    """The action at a neighbouring (virtual) stage that must finish before ``action`` can start.

    A forward needs the previous virtual stage's forward of the same micro-batch (its activation); a
    backward needs the next virtual stage's backward (its gradient); an evaluation needs the previous
    stage's evaluation (its activations). With ``chunks = v`` the virtual stage of chunk ``c`` at
    stage ``s`` is ``c * P + s`` (module docstring), so the neighbour of the last stage's chunk ``c``
    is the first stage's chunk ``c + 1``. Steps, weight gradients (after their own ``B``) and the
    first/last virtual stage's boundary actions depend only on the stage's own order.
    """
    j = action.chunk * stages + stage
    if action.op in (Op.FORWARD, Op.EVAL) and j > 0:
        return (j - 1) % stages, Action(action.op, action.mb, (j - 1) // stages)
    if action.op is Op.BACKWARD and j < chunks * stages - 1:
        return (j + 1) % stages, Action(action.op, action.mb, (j + 1) // stages)
    return None


def execution_order(
    lists: list[list[Action]],
    sync_steps: int | None = None,
    chunks: int = 1,
    step_groups: Sequence[Sequence[int]] = (),
) -> list[tuple[int, Action]]:
    """A global order of all actions that respects every stage's order and every dependency.

    Any such order gives the same numerics; this one sweeps the stages round-robin and runs each as
    far as it can (:func:`sweep`), which keeps in-flight activations close to a real pipeline's.
    ``sync_steps`` (any true value) makes every STEP(k) wait until each other stage has done
    everything before its own STEP(k): all of batch k's gradients exist (global-norm clipping, as
    single-process training clips; PACI never synchronises its steps).
    ``chunks``: model chunks per stage (:func:`dependency`). ``step_groups``: sets of stages whose
    STEP(k)s wait the same way for each other only (a collective among them: tied parameters' holders,
    :func:`step_partners`). Raises ``RuntimeError`` if the lists deadlock (a schedule bug, never a user error).
    """
    return list(sweep([iter(x) for x in lists], sync_steps, chunks, step_groups))


def step_partners(stages: int, sync_steps: int | None, step_groups: Sequence[Sequence[int]]) -> list[frozenset[int]]:
    """Per stage, the other stages its STEP(k) waits for: all of them with ``sync_steps``, else those
    sharing a step group with it (none for a stage in no group: PACI's and most flush stages' case)."""
    if sync_steps:
        return [frozenset(range(stages)) - {s} for s in range(stages)]
    return [frozenset(o for g in step_groups if s in g for o in g) - {s} for s in range(stages)]


def sweep(
    programs: Sequence[Iterator[Action]],
    sync_steps: int | None = None,
    chunks: int = 1,
    step_groups: Sequence[Sequence[int]] = (),
) -> Iterator[tuple[int, Action]]:
    """:func:`execution_order` over stage programs that are generated as they run (one process).

    Yields ``(stage, action)``; the caller executes the action before asking for the next, and may
    shorten the programs in between (:meth:`paci_tune.schedule.program.Program.set_end`). Each
    stage's next action is drawn from its program only when the stage is about to try it. Progress is
    kept as counters (on each chunk, each stage forwards, backwards, steps and evaluates in increasing
    order), so a run of any length takes constant memory. ``arrived[s]``: the last STEP stage ``s``
    has reached, every action before it done (what a synchronised step waits for).
    """
    n = len(programs)
    partners = step_partners(n, sync_steps, step_groups)
    done = {(op, c): [-1] * n for op in Op for c in range(chunks)}
    held: list[Action | None] = [None] * n
    finished = [False] * n
    arrived = [-1] * n

    def ready(s: int, act: Action) -> bool:
        dep = dependency(act, s, n, chunks)
        if dep is not None and done[dep[1].op, dep[1].chunk][dep[0]] < act.mb:
            return False
        if act.op is Op.STEP:
            return all(arrived[o] >= act.mb for o in partners[s])
        return True

    while not all(finished):
        progressed = False
        for s in range(n):
            while not finished[s]:
                if held[s] is None:
                    drawn = held[s] = next(programs[s], None)
                    if drawn is None:
                        finished[s] = True
                        break
                    if drawn.op is Op.STEP:
                        arrived[s] = drawn.mb
                act = held[s]
                assert act is not None
                if not ready(s, act):
                    break
                held[s] = None
                yield s, act
                done[act.op, act.chunk][s] = act.mb
                progressed = True
        if not progressed and not all(finished):
            stuck = {s: held[s] for s in range(n) if not finished[s]}
            raise RuntimeError(f"schedule deadlocks; next actions per stage: {stuck}")
