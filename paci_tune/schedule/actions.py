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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

SCHEDULES = ("paci", "1f1b", "gpipe")


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"
    EVAL = "E"  # score the model after STEP(mb) on the validation set (see :mod:`.program`)


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work at one stage: forward or backward of micro-batch ``mb``, an optimizer step
    closing global batch ``mb``, or an evaluation of the model after that step."""

    op: Op
    mb: int

    def __repr__(self) -> str:
        return f"{self.op.value}{self.mb}"


def inflight_cap(schedule: str, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
    """Most micro-batches a stage holds between forward and backward under ``schedule``.

    1F1B-style schedules keep ``P - s`` in flight at stage ``s`` (what the last stage needs to never
    wait in steady state); ``inflight`` caps that further to trade bubble for activation memory.
    GPipe holds the whole global batch.
    """
    if schedule == "gpipe":
        return window
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


def dependency(action: Action, stage: int, stages: int) -> tuple[int, Action] | None:
    """The action at a neighbouring stage that must finish before ``action`` can start.

    A forward needs the previous stage's forward of the same micro-batch (its activation); a
    backward needs the next stage's backward (its gradient); an evaluation needs the previous
    stage's evaluation (its activations). Steps and the first/last stage's boundary actions depend
    only on the stage's own order.
    """
    if action.op in (Op.FORWARD, Op.EVAL) and stage > 0:
        return stage - 1, action
    if action.op is Op.BACKWARD and stage < stages - 1:
        return stage + 1, action
    return None


def step_barrier(action: Action, stage: int, stages: int, window: int) -> list[tuple[int, Action]]:
    """With a synchronised step, STEP(k) waits for every other stage's last backward of batch k.

    Flush schedules clip the *global* gradient norm like single-process training, so a stage can
    only step once all stages' gradients of the batch exist. PACI never synchronises its steps.
    """
    if action.op is not Op.STEP:
        return []
    last = Action(Op.BACKWARD, action.mb * window + window - 1)
    return [(s, last) for s in range(stages) if s != stage]


def execution_order(lists: list[list[Action]], sync_steps: int | None = None) -> list[tuple[int, Action]]:
    """A global order of all actions that respects every stage's order and every dependency.

    Any such order gives the same numerics; this one sweeps the stages round-robin and runs each as
    far as it can (:func:`sweep`), which keeps in-flight activations close to a real pipeline's.
    ``sync_steps=a`` adds the :func:`step_barrier` dependencies of a window of ``a``. Raises
    ``RuntimeError`` if the lists deadlock (a schedule bug, never a user error).
    """
    return list(sweep([iter(x) for x in lists], sync_steps))


def sweep(programs: Sequence[Iterator[Action]], sync_steps: int | None = None) -> Iterator[tuple[int, Action]]:
    """:func:`execution_order` over stage programs that are generated as they run (one process).

    Yields ``(stage, action)``; the caller executes the action before asking for the next, and may
    shorten the programs in between (:meth:`paci_tune.schedule.program.Program.set_end`). Each
    stage's next action is drawn from its program only when the stage is about to try it. Progress is
    kept as counters (each stage forwards, backwards, steps and evaluates in increasing order), so a
    run of any length takes constant memory.
    """
    n = len(programs)
    done = {op: [-1] * n for op in Op}
    held: list[Action | None] = [None] * n
    finished = [False] * n

    def ready(s: int, act: Action) -> bool:
        dep = dependency(act, s, n)
        if dep is not None and done[dep[1].op][dep[0]] < act.mb:
            return False
        if sync_steps and act.op is Op.STEP:
            last = act.mb * sync_steps + sync_steps - 1
            return all(done[Op.BACKWARD][o] >= last for o in range(n) if o != s)
        return True

    while not all(finished):
        progressed = False
        for s in range(n):
            while not finished[s]:
                if held[s] is None:
                    held[s] = next(programs[s], None)
                    if held[s] is None:
                        finished[s] = True
                        break
                act = held[s]
                assert act is not None
                if not ready(s, act):
                    break
                held[s] = None
                yield s, act
                done[act.op][s] = act.mb
                progressed = True
        if not progressed and not all(finished):
            stuck = {s: held[s] for s in range(n) if not finished[s]}
            raise RuntimeError(f"schedule deadlocks; next actions per stage: {stuck}")
