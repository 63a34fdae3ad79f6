"""Stage programs: lazily generated action lists with evaluations in them and an end decided on the way.

Oracles: the finite segment lists (:func:`stage_actions`, themselves checked against torch's own
schedules in ``test_schedules``), the link invariant that makes a pipeline's messages arrive in the
order they are read (what a stage sends forward is, action for action, what its neighbour
receives), and deadlock freedom under the real dependency rules (:func:`sweep`).
"""

from __future__ import annotations

import random

import pytest

from paci_tune.schedule import OWN_PROGRAM, Op, Program, execution_order, needs_snapshot, stage_actions

CASES = [
    (sched, p, a, inflight)
    for sched in OWN_PROGRAM
    for p in (1, 2, 3, 4, 8)
    for a in (1, 2, 3, 8)
    for inflight in (None, 1, 2)
]


def _lists(sched: str, p: int, a: int, inflight: int | None, first: int, end: int | None, evals: set[int]) -> list:
    return [list(Program(sched, s, p, a, first, end, inflight=inflight, eval_at=evals.__contains__)) for s in range(p)]


def _sends_match_receives(lists: list) -> None:
    for s in range(1, len(lists)):
        up = [x for x in lists[s - 1] if x.op in (Op.FORWARD, Op.EVAL)]
        down = [x for x in lists[s] if x.op in (Op.FORWARD, Op.EVAL)]
        assert up == down, f"stage {s - 1} sends {up[:12]}... but stage {s} reads {down[:12]}..."


@pytest.mark.parametrize(("sched", "p", "a", "inflight"), CASES)
def test_evaluations_change_no_training_action_and_keep_every_link_in_order(
    sched: str, p: int, a: int, inflight: int | None
) -> None:
    rng = random.Random(f"{sched}{p}{a}{inflight}")
    for first, n in ((0, 1), (0, 4), (3, 9)):
        for evals in (set(range(first, first + n)), {first + n - 1}, set(rng.sample(range(first, first + n), n // 3))):
            lists = _lists(sched, p, a, inflight, first, first + n - 1, evals)
            for s, acts in enumerate(lists):
                assert [x for x in acts if x.op is not Op.EVAL] == stage_actions(sched, s, p, a, first, n, inflight)
                assert [x.mb for x in acts if x.op is Op.EVAL] == sorted(evals)
                steps_so_far: set[int] = set()
                for i, x in enumerate(acts):
                    if x.op is Op.STEP:
                        steps_so_far.add(x.mb)
                    elif x.op is Op.EVAL:
                        assert x.mb in steps_so_far, f"stage {s} evaluates batch {x.mb} before stepping it"
                        nxt = next((y for y in acts[i + 1 :] if y.op is not Op.EVAL), None)
                        assert nxt is None or nxt.op is not Op.STEP or nxt.mb > x.mb
            _sends_match_receives(lists)
            execution_order(lists)  # raises on a deadlock


@pytest.mark.parametrize(("sched", "p", "a", "inflight"), CASES)
def test_an_end_decided_at_an_evaluation_is_a_prefix_of_the_shorter_run(
    sched: str, p: int, a: int, inflight: int | None
) -> None:
    """Every stage switches when it reaches EVAL(k) (when the decision reaches it): what it ran is a
    prefix of the program that ends at the decided batch, and nothing injected is abandoned."""
    evals = set(range(2, 40, 3))
    for decided in sorted(evals)[:4]:
        lists, end = [], None
        for s in range(p):
            prog = Program(sched, s, p, a, 2, None, inflight=inflight, eval_at=evals.__contains__)
            out = []
            for act in prog:
                out.append(act)
                if act.op is Op.EVAL and act.mb == decided:
                    end = prog.end_if_decided_at(decided)
                    prog.set_end(end, decided)
                assert len(out) < 5000, "the program did not end"
            lists.append(out)
            kept = {k for k in evals if k <= decided}
            ref = Program(sched, s, p, a, 2, end, inflight=inflight, eval_at=kept.__contains__)
            assert out == list(ref)
        assert end is not None and end >= decided
        fwd0 = [x.mb for x in lists[0] if x.op is Op.FORWARD]
        assert fwd0[-1] == (end + 1) * a - 1, "the last batch is not complete"
        _sends_match_receives(lists)
        execution_order(lists)


def test_paci_ends_after_the_batches_it_already_started_and_flush_at_once() -> None:
    # P=4: when stage 0 steps batch k it has already forwarded P-1 = 3 micro-batches of later batches:
    # with a=2 those are batch 6 and half of batch 7, with a=1 batches 6, 7 and 8.
    assert Program("paci", 0, 4, 2, 0).end_if_decided_at(5) == 7
    assert Program("paci", 0, 4, 1, 0).end_if_decided_at(5) == 8
    assert Program("1f1b", 0, 4, 2, 0).end_if_decided_at(5) == 5
    with pytest.raises(ValueError, match="decided at"):
        Program("paci", 1, 4, 2, 0).set_end(5, 5)


def test_snapshots_only_where_a_stage_steps_again_before_it_evaluates() -> None:
    """P=4, a=1: stage s steps s-1 more times between STEP(k) and its EVAL(k) (the drift bound)."""
    evals = set(range(10))
    lists = _lists("paci", 4, 1, None, 0, 11, evals)
    assert needs_snapshot(lists[0]) == set() and needs_snapshot(lists[1]) == set()
    interior = set(range(8))  # (near the segment's end the last forward anchors the rest)
    assert needs_snapshot(lists[2]) >= interior and needs_snapshot(lists[3]) >= interior
    assert all(needs_snapshot(x) == set() for x in _lists("1f1b", 4, 1, None, 0, 11, evals))
