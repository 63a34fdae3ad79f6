"""The stronger synchronous schedules: interleaved 1F1B and zero-bubble ZB-H1, as per-stage action lists.

Both flush at every global batch and step all stages together, so their gradients are exactly
1F1B-flush's (plain gradient accumulation): they differ from it only in *when* each stage does its
work, which is all the simulator needs to time them.

- ``interleaved`` (Narayanan et al. 2021, Megatron-LM): the model is cut into ``v * P`` chunks and
  stage ``s`` holds chunks ``s, s + P, ...`` (:mod:`.actions`). A stage warms up with
  ``(v-1) * r + 2 (P-1-s)`` forwards, then alternates one forward and one backward, then drains.
  Forwards visit the chunks in rounds of ``r`` micro-batches (chunk ``(i // r) mod v`` for the
  ``i``-th forward), backwards the same rounds from the last chunk down. ``r`` is torch's flexible
  round: ``rounds = max(1, m // P)``, ``r = m / rounds``, which must be whole (``m = P``, ``2P``, ...
  is Megatron's ``r = P``). With equal chunks and free transfers its bubble is
  ``(P-1) / (v m + P-1)``: the fill and drain are ``v`` times shorter.
- ``zb-h1`` (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", the H1 schedule): each
  backward is split into ``B`` (the input gradient, what the previous stage waits for) and ``W``
  (the weight gradient, which nobody waits for). Stage ``s`` warms up with ``P-1-s`` forwards as
  1F1B does, alternates ``F`` and ``B``, and runs its ``i``-th ``W`` right after its ``(i+s)``-th
  ``B``: the last stage defers its first ``P-1`` weight gradients into the drain, where 1F1B would
  idle. With ``F = B = W`` and free transfers its bubble is ``(P-1)/(3m + P-1)``, a third of
  1F1B's bubble time, in the same number of micro-batches held per stage as 1F1B's first stage.

These are the orders torch 2.13's ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
(with one chunk per rank) compute; ``tests/test_sync_schedules.py`` checks that they agree. May
import: :mod:`.actions` and the standard library (no torch).
"""

from __future__ import annotations

from .actions import Action, Op


def rounds(window: int, stages: int) -> int:
    """torch's number of rounds of an interleaved schedule: ``max(1, m // P)``."""
    return max(1, window // stages)


def _one_f_one_b(
    stage: int, stages: int, window: int, chunks: int, warmup: int, weight_lag: int | None, first_mb: int
) -> list[Action]:
    """One global batch at ``stage``: ``warmup`` forwards, then forward/backward pairs, then the drain.

    Chunks are visited in rounds of ``r`` (module docstring). ``weight_lag``: None for a whole
    backward per ``B``; else ``B`` is the input gradient and the ``i``-th ``W`` follows the
    ``(i + weight_lag)``-th ``B`` (the rest at the end).
    """
    per_round = window // rounds(window, stages)
    total = chunks * window
    warmup = min(warmup, total)
    nxt = {op: [first_mb] * chunks for op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)}

    def take(op: Op, chunk: int) -> Action:
        mb = nxt[op][chunk]
        nxt[op][chunk] += 1
        return Action(op, mb, chunk)

    def fwd(i: int) -> Action:
        return take(Op.FORWARD, (i // per_round) % chunks)

    def bwd(i: int) -> Action:
        return take(Op.BACKWARD, chunks - 1 - (i // per_round) % chunks)

    out = [fwd(i) for i in range(warmup)]
    pending: list[int] = []  # chunks of the backwards whose W has not run, oldest first
    for i in range(total):
        if warmup + i < total:
            out.append(fwd(warmup + i))
        b = bwd(i)
        out.append(b)
        if weight_lag is not None:
            pending.append(b.chunk)
            if i >= weight_lag:
                out.append(take(Op.WEIGHT, pending.pop(0)))
    out += [take(Op.WEIGHT, c) for c in pending]
    return out


def interleaved(stage: int, stages: int, window: int, chunks: int, first_mb: int) -> list[Action]:
    """One global batch of interleaved 1F1B at ``stage`` (torch's ``ScheduleInterleaved1F1B``)."""
    warmup = (chunks - 1) * (window // rounds(window, stages)) + 2 * (stages - 1 - stage)
    return _one_f_one_b(stage, stages, window, chunks, warmup, None, first_mb)


def zb_h1(stage: int, stages: int, window: int, chunks: int, first_mb: int) -> list[Action]:
    """One global batch of ZB-H1 at ``stage`` (torch's ``ScheduleInterleavedZeroBubble``, one chunk)."""
    return _one_f_one_b(stage, stages, window, 1, stages - 1 - stage, stage, first_mb)
