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
from dataclasses import dataclass

SCHEDULES = ("paci", "1f1b", "gpipe")


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work at one stage: forward or backward of micro-batch ``mb``, or an optimizer
    step closing global batch ``mb``."""

    op: Op
    mb: int

    def __repr__(self) -> str:
        return f"{self.op.value}{self.mb}"


def inflight_cap(schedule: str, stage: int, n_stages: int, window: int, inflight: int | None = None) -> int:
    """Most micro-batches a stage holds between forward and backward under ``schedule``.

    1F1B-style schedules keep ``P - s`` in flight at stage ``s`` (what the last stage needs to never
    wait in steady state); ``inflight`` caps that further to trade bubble for activation memory.
    GPipe holds the whole global batch.
    """
    if schedule == "gpipe":
        return window
    cap = n_stages - stage
    if inflight is not None:
        cap = min(cap, inflight)
    if schedule == "1f1b":
        cap = min(cap, window)
    return max(cap, 1)


def drift_bound(stage: int, n_stages: int, window: int) -> int:
    """PACI's bound on optimizer updates a micro-batch crosses at stage ``s``: ceil((P-s-1)/a)."""
    return math.ceil((n_stages - stage - 1) / window)


def _one_f_one_b(mbs: list[int], cap: int, window: int | None) -> list[Action]:
    """1F1B over ``mbs`` with at most ``cap`` in flight; a STEP after every ``window`` backwards."""
    warm = min(cap - 1, len(mbs))
    out = [Action(Op.FORWARD, m) for m in mbs[:warm]]
    fwd, bwd = warm, 0
    while bwd < len(mbs):
        if fwd < len(mbs):
            out.append(Action(Op.FORWARD, mbs[fwd]))
            fwd += 1
        out.append(Action(Op.BACKWARD, mbs[bwd]))
        bwd += 1
        if window is not None and mbs[bwd - 1] % window == window - 1:
            out.append(Action(Op.STEP, mbs[bwd - 1] // window))
    return out


def stage_actions(
    schedule: str,
    stage: int,
    n_stages: int,
    window: int,
    first_batch: int,
    n_batches: int,
    inflight: int | None = None,
) -> list[Action]:
    """Ordered actions of one stage for global batches ``first_batch .. first_batch+n_batches-1``.

    A run is cut into segments at evaluation and checkpoint points; every schedule (PACI too) ends
    a segment drained, so evaluation and checkpoints see a consistent set of weights.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} out of range for {n_stages} stages")
    cap = inflight_cap(schedule, stage, n_stages, window, inflight)
    batches = range(first_batch, first_batch + n_batches)
    if schedule == "paci":
        mbs = [m for k in batches for m in range(k * window, (k + 1) * window)]
        return _one_f_one_b(mbs, cap, window)
    out: list[Action] = []
    for k in batches:
        mbs = list(range(k * window, (k + 1) * window))
        if schedule == "gpipe":
            out += [Action(Op.FORWARD, m) for m in mbs] + [Action(Op.BACKWARD, m) for m in mbs]
        else:
            out += _one_f_one_b(mbs, cap, None)
        out.append(Action(Op.STEP, k))
    return out


def build(
    schedule: str,
    n_stages: int,
    window: int,
    first_batch: int,
    n_batches: int,
    inflight: int | None = None,
) -> list[list[Action]]:
    """Every stage's action list for one segment of the run."""
    return [stage_actions(schedule, s, n_stages, window, first_batch, n_batches, inflight) for s in range(n_stages)]


def dependency(action: Action, stage: int, n_stages: int) -> tuple[int, Action] | None:
    """The action at a neighbouring stage that must finish before ``action`` can start.

    A forward needs the previous stage's forward of the same micro-batch (its activation); a
    backward needs the next stage's backward (its gradient). Steps and the first/last stage's
    boundary actions depend only on the stage's own order.
    """
    if action.op is Op.FORWARD and stage > 0:
        return stage - 1, action
    if action.op is Op.BACKWARD and stage < n_stages - 1:
        return stage + 1, action
    return None


def step_barrier(action: Action, stage: int, n_stages: int, window: int) -> list[tuple[int, Action]]:
    """With a synchronised step, STEP(k) waits for every other stage's last backward of batch k.

    Flush schedules clip the *global* gradient norm like single-process training, so a stage can
    only step once all stages' gradients of the batch exist. PACI never synchronises its steps.
    """
    if action.op is not Op.STEP:
        return []
    last = Action(Op.BACKWARD, action.mb * window + window - 1)
    return [(s, last) for s in range(n_stages) if s != stage]


def execution_order(lists: list[list[Action]], sync_steps: int | None = None) -> list[tuple[int, Action]]:
    """A global order of all actions that respects every stage's order and every dependency.

    Any such order gives the same numerics; this one sweeps the stages round-robin and runs each as
    far as it can, which keeps in-flight activations close to a real pipeline's. ``sync_steps=a``
    adds the :func:`step_barrier` dependencies of a window of ``a``. Raises ``RuntimeError`` if the
    lists deadlock (a schedule bug, never a user error).
    """
    n = len(lists)
    pos = [0] * n
    done: set[tuple[int, Action]] = set()
    order: list[tuple[int, Action]] = []
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for s in range(n):
            while pos[s] < len(lists[s]):
                act = lists[s][pos[s]]
                dep = dependency(act, s, n)
                if dep is not None and dep not in done:
                    break
                if sync_steps and any(d not in done for d in step_barrier(act, s, n, sync_steps)):
                    break
                done.add((s, act))
                order.append((s, act))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][pos[s]] for s in range(n) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks; next actions per stage: {stuck}")
    return order
