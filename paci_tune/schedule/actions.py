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

The synchronous schedules of :mod:`.synchronous` and :mod:`.vshape` add two things an action can
say: its model ``chunk``, and the ``W`` op: the weight-gradient half of a backward whose ``B`` then
computes only the input gradient. Where a device's chunks sit in model order is the schedule's
*placement* (:func:`virtual_stage`): ``looped`` (interleaved 1F1B, Megatron's and torch's), chunk
``c`` of stage ``s`` is virtual stage ``c * P + s`` of ``v * P``; ``v`` (ZB-V, DualPipeV), stage ``s``
holds virtual stages ``s`` and ``2P - 1 - s``. Every schedule of the runtimes has one chunk and no
``W``, and reads exactly as before.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class Op(str, enum.Enum):  # noqa: UP042 -- StrEnum would change what str() of a member prints
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


def drift_bound(stage: int, stages: int, window: int) -> int:
    """PACI's bound on optimizer updates a micro-batch crosses at stage ``s``: ceil((P-s-1)/a)."""
    return math.ceil((stages - stage - 1) / window)


PLACEMENTS = ("looped", "v")
"""How a schedule's chunks sit in model order (module docstring)."""


def virtual_stage(stage: int, chunk: int, stages: int, placement: str = "looped") -> int:
    """The position in model order of ``chunk`` of stage ``stage`` under ``placement``."""
    if placement == "v":
        return stage if chunk == 0 else 2 * stages - 1 - stage
    if placement != "looped":
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    return chunk * stages + stage


def holder(virtual: int, stages: int, placement: str = "looped") -> tuple[int, int]:
    """``(stage, chunk)`` holding virtual stage ``virtual``: :func:`virtual_stage`'s inverse."""
    if placement == "v":
        return (virtual, 0) if virtual < stages else (2 * stages - 1 - virtual, 1)
    if placement != "looped":
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    return virtual % stages, virtual // stages


def dependency(
    action: Action, stage: int, stages: int, chunks: int = 1, placement: str = "looped"
) -> tuple[int, Action] | None:
    """The action at a neighbouring (virtual) stage that must finish before ``action`` can start.

    A forward needs the previous virtual stage's forward of the same micro-batch (its activation); a
    backward needs the next virtual stage's backward (its gradient); an evaluation needs the previous
    stage's evaluation (its activations). The virtual stages are ``chunks * P`` in model order, placed
    on the stages by ``placement`` (:func:`virtual_stage`): looped, the last stage's chunk ``c`` feeds
    the first stage's chunk ``c + 1``; in a V, the last stage's chunk 0 feeds its own chunk 1. Steps,
    weight gradients (after their own ``B``) and the first/last virtual stage's boundary actions
    depend only on the stage's own order.
    """
    j = virtual_stage(stage, action.chunk, stages, placement)
    if action.op in (Op.FORWARD, Op.EVAL) and j > 0:
        s, c = holder(j - 1, stages, placement)
        return s, Action(action.op, action.mb, c)
    if action.op is Op.BACKWARD and j < chunks * stages - 1:
        s, c = holder(j + 1, stages, placement)
        return s, Action(action.op, action.mb, c)
    return None


def execution_order(
    lists: list[list[Action]],
    sync_steps: int | None = None,
    chunks: int = 1,
    step_groups: Sequence[Sequence[int]] = (),
    placement: str = "looped",
) -> list[tuple[int, Action]]:
    """A global order of all actions that respects every stage's order and every dependency.

    Any such order gives the same numerics; this one sweeps the stages round-robin and runs each as
    far as it can (:func:`sweep`), which keeps in-flight activations close to a real pipeline's.
    ``sync_steps`` (any true value) makes every STEP(k) wait until each other stage has done
    everything before its own STEP(k): all of batch k's gradients exist (global-norm clipping, as
    single-process training clips; PACI never synchronises its steps).
    ``chunks``: model chunks per stage, placed by ``placement`` (:func:`dependency`). ``step_groups``:
    sets of stages whose STEP(k)s wait the same way for each other only (a collective among them: tied
    parameters' holders, :func:`step_partners`). Raises ``RuntimeError`` if the lists deadlock (a
    schedule bug, never a user error).
    """
    return list(sweep([iter(x) for x in lists], sync_steps, chunks, step_groups, placement))


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
    placement: str = "looped",
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
        dep = dependency(act, s, n, chunks, placement)
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
