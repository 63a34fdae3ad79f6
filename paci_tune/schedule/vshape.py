"""The V-shaped schedules, ZB-V and DualPipeV, as per-stage action lists.

Both cut the model into ``2P`` pieces and fold them into a V over the ranks: rank ``s`` holds virtual
stage ``s`` (its chunk 0) and ``2P - 1 - s`` (its chunk 1), so rank 0 holds the first and the last
piece and rank ``P - 1`` the two middle ones, whose hop from chunk 0 to chunk 1 stays on the device.
A micro-batch's forward runs down the ranks and back up, its backward the other way. Both split each
backward into ``B`` (the input gradient, which the previous virtual stage waits for) and ``W`` (the
weight gradient, which nobody waits for) and spend the ``W`` where a rank would otherwise wait: at
equal costs the only idle left is the fill (:func:`bubble`), and every rank holds about what 1F1B's
first stage holds.

- ``zb-v`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): rank ``s`` warms up with
  ``2(P-s) - 1`` chunk-0 forwards, ``s`` pairs of a chunk-1 and a chunk-0 forward, and ``P - s``
  chunk-1 ``F B W`` triples; the steady state repeats ``F B W`` on chunk 0 then on chunk 1; the drain
  runs ``s`` pairs of ``B`` (chunk 0, chunk 1) with their ``W`` deferred, then ``P - s`` chunk-0
  ``B`` each followed by the oldest deferred chunk-0 ``W``, then the rest of the ``W``. Rank ``s``
  holds at most ``2P`` chunk activations (``2P - s`` on chunk 0, ``s + 1`` on chunk 1), each half a
  stage's: 1F1B's first stage's peak.
  It plans ``max(m, 2P - 1)`` micro-batches and drops those ``>= m`` (torch does the same), so a
  smaller window runs, with a longer bubble: removing whole micro-batches from every rank keeps each
  rank's order dependency-valid.
- ``dualpipev`` (DeepSeek-V3's DualPipe folded into a V, as in deepseek-ai/DualPipe): after a warm-up
  of forwards and zero-bubble ``B W F`` triples on chunk 1, the steady state pairs a forward of one
  chunk with the whole backward of the other (``F B W``, overlapped in torch so that one's compute
  hides the other's communication); the drain runs whole backwards, then switches to split ones
  halfway through and spends the queued ``W`` in the tail. It holds one chunk activation more than
  ZB-V, ``2P + 1``, and needs ``m >= 2P`` (torch refuses fewer).

These are, action for action, the orders torch 2.13's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` compute per rank (``tests/test_v_schedules.py`` checks it): torch's ``I`` is our
``B`` and its ``W`` ours; a full backward is ``B`` then ``W``; an overlapped forward-backward ``F``,
``B``, ``W``. May import: :mod:`.actions` and the standard library (no torch).
"""

from __future__ import annotations

from .actions import Action, Op

F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT


class _Plan:
    """One rank's list as it is planned: the next micro-batch of each (op, chunk), and what is kept."""

    def __init__(self, window: int, first_mb: int) -> None:
        self.window, self.first_mb = window, first_mb
        self.next: dict[tuple[Op, int], int] = {}
        self.out: list[Action] = []

    def add(self, op: Op, chunk: int) -> int:
        """Plan ``op`` on ``chunk`` for its next micro-batch; keep it if it is in the window."""
        mb = self.next.get((op, chunk), 0)
        self.next[op, chunk] = mb + 1
        self.keep(op, chunk, mb)
        return mb

    def keep(self, op: Op, chunk: int, mb: int) -> None:
        """Plan ``op`` of micro-batch ``mb`` (counted from the batch's first) on ``chunk``, if in the window."""
        if mb < self.window:
            self.out.append(Action(op, self.first_mb + mb, chunk))

    def count(self, op: Op, chunk: int) -> int:
        return self.next.get((op, chunk), 0)


def zb_v(stage: int, stages: int, window: int, chunks: int, first_mb: int) -> list[Action]:
    """One drained global batch of ZB-V at rank ``stage`` (torch's ``ScheduleZBVZeroBubble``)."""
    p, s = stages, stage
    n = max(2 * p - 1, window)  # planned micro-batches; those >= window are dropped
    plan = _Plan(window, first_mb)
    for _ in range(2 * (p - s) - 1):
        plan.add(F, 0)
    for _ in range(s):
        plan.add(F, 1)
        plan.add(F, 0)
    for _ in range(p - s):
        plan.add(F, 1)
        plan.add(B, 1)
        plan.add(W, 1)
    while plan.count(F, 1) < plan.count(F, 0) or plan.count(F, 0) < n:
        if plan.count(F, 0) < n:
            plan.add(F, 0)
        plan.add(B, 0)
        plan.add(W, 0)
        plan.add(F, 1)
        plan.add(B, 1)
        plan.add(W, 1)
    for _ in range(s):
        plan.add(B, 0)
        plan.add(B, 1)
    for _ in range(p - s):
        plan.add(B, 0)
        plan.add(W, 0)
    for c in (1, 0):
        while plan.count(W, c) < plan.count(B, c):
            plan.add(W, c)
    return plan.out


def dualpipe_v(stage: int, stages: int, window: int, chunks: int, first_mb: int) -> list[Action]:
    """One drained global batch of DualPipeV at rank ``stage`` (torch's ``ScheduleDualPipeV``); ``window >= 2P``."""
    p, s = stages, stage
    plan = _Plan(window, first_mb)
    queued: list[tuple[int, int]] = []  # (chunk, micro-batch) of the split backwards whose W waits

    def split(chunk: int) -> None:
        queued.append((chunk, plan.add(B, chunk)))

    def whole(chunk: int) -> None:
        plan.keep(W, chunk, plan.add(B, chunk))

    def weight() -> None:
        if queued:
            plan.keep(W, *queued.pop(0))

    def overlap(forward: int, backward: int) -> None:
        plan.add(F, forward)
        whole(backward)

    for _ in range(2 * (p - s - 1)):
        plan.add(F, 0)
    for _ in range(s + 1):
        plan.add(F, 0)
        plan.add(F, 1)
    for _ in range(p - s - 1):
        split(1)
        weight()
        plan.add(F, 1)
    for _ in range(window - 2 * p + s + 1):
        overlap(0, 1)  # on the last rank the first pair is not overlapped in torch: the same order here
        overlap(1, 0)
    for _ in range(p - s - 1):
        whole(1)
        overlap(1, 0)
    zero_bubble = False
    for i in range(s + 1):
        for c in (1, 0):
            if i == (s + 1) // 2 and s % 2 == c:
                zero_bubble = True
            (split if zero_bubble else whole)(c)
    for _ in range(p - s - 1):
        weight()
        (split if zero_bubble else whole)(0)
    for _ in range(s + 1):
        weight()
    return plan.out


def bubble(name: str, stages: int, window: int) -> float:
    """Idle fraction of one flushed batch of V schedule ``name`` on ``stages`` ranks, ``window`` micro-batches.

    Costs as :meth:`~.registry.Schedule.bubble` counts them: a chunk's ``F``, ``B`` and ``W`` each 1/2
    (a micro-batch's whole forward 1, backward 2), transfers free, so every rank works ``3m``. Rank
    ``P - 1`` cannot start before micro-batch 0 has crossed ``P - 1`` chunks, and every rank does the
    same work, so each idles at least ``(P-1)/2``: the bubble is at least ``(P-1)/(6m + P-1)``. Both
    torch orders reach that bound, their ``W`` filling the drain: DualPipeV at every ``m >= 2P`` it
    runs, ZB-V from ``m = 2P - 1`` (Qi et al.'s "zero bubble" beyond this unavoidable fill). With
    fewer micro-batches ZB-V's V is not full and each rank idles ``2P - 1 - m``. One closed form for
    both, ``name`` only says which; ``tests/test_v_schedules.py`` checks it against
    :func:`~.replay.replay` on these costs. DualPipeV overlaps one chunk's forward with the other's
    backward to hide communication, which free transfers do not have: it buys nothing here.
    """
    p, m = stages, window
    idle = max(2 * p - 1 - m, (p - 1) / 2)
    return idle / (3 * m + idle) if idle > 0 else 0.0
