"""Checks of a schedule's per-stage action lists shared by the schedule tests: well-formedness against
the dependency rules, and textbook unit costs for the bubble formulas."""

from __future__ import annotations

from collections import Counter

from paci_tune.schedule import Action, Op, dependency, execution_order
from paci_tune.schedule.replay import drift_per_microbatch

F, B, W, S = Op.FORWARD, Op.BACKWARD, Op.WEIGHT, Op.STEP


def check_well_formed(
    lists: list[list[Action]], stages: int, window: int, chunks: int, first: int, n: int, placement: str = "looped"
) -> None:
    """Each micro-batch's F, B (and W where split) exactly once per stage and chunk, F < B < W, a
    STEP per batch after all of that batch's work; and a global order exists that keeps every
    dependency (execution_order raises on a deadlock) with the chunks placed by ``placement``."""
    mbs = list(range(first * window, (first + n) * window))
    for s, acts in enumerate(lists):
        pos = {a: i for i, a in enumerate(acts)}
        assert len(pos) == len(acts), f"stage {s}: an action appears twice"
        split = any(a.op is W for a in acts)
        ops = (F, B, W) if split else (F, B)
        for c in range(chunks):
            for op in ops:
                assert [a.mb for a in acts if a.op is op and a.chunk == c] == mbs, f"stage {s} chunk {c} {op}"
            for m in mbs:
                assert pos[Action(F, m, c)] < pos[Action(B, m, c)], f"stage {s}: B{m}.{c} before its F"
                if split:
                    assert pos[Action(B, m, c)] < pos[Action(W, m, c)], f"stage {s}: W{m}.{c} before its B"
        assert [a.mb for a in acts if a.op is S] == list(range(first, first + n))
        for k in range(first, first + n):
            batch = [pos[a] for a in acts if a.op is not S and a.mb // window == k]
            assert max(batch) < pos[Action(S, k)], f"stage {s}: STEP({k}) before its batch's work"
            if k > first:
                assert min(batch) > pos[Action(S, k - 1)], f"stage {s}: batch {k} starts before STEP({k - 1})"
        assert set(drift_per_microbatch(acts).values()) == {0}, "a synchronous schedule crosses a step"
    order = execution_order(lists, chunks=chunks, placement=placement)
    assert Counter(order) == Counter((s, a) for s, acts in enumerate(lists) for a in acts)
    seen = set()
    for s, act in order:
        dep = dependency(act, s, stages, chunks, placement)
        assert dep is None or dep in seen, f"{act} at stage {s} runs before {dep}"
        seen.add((s, act))


def costs(chunks: int, split: bool):
    """Equal stages: F = 1, whole backward 2 (B = W = 1 when split), each chunk 1/v of that; steps free."""
    per = {F: 1.0, B: 1.0 if split else 2.0, W: 1.0, S: 0.0}
    return lambda s, a: per[a.op] if a.op is S else per[a.op] / chunks
