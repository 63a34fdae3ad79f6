"""Schedules as per-stage action lists, their timeline replay, and drift.

Oracles: the definitions of the schedules (counted by walking the lists), the textbook bubble
formula (P-1)/(m+P-1), a timeline worked out by hand, the drift bound ceil((P-s-1)/a), and the
order that torch's own ``Schedule1F1B`` / ``ScheduleGPipe`` execute.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from paci_tune.schedule import (
    OWN_PROGRAM,
    Action,
    Op,
    build,
    dependency,
    drift_bound,
    execution_order,
    inflight_cap,
    stage_actions,
)
from paci_tune.schedule.replay import drift_per_microbatch, replay

F, B, S = Op.FORWARD, Op.BACKWARD, Op.STEP
GRID = [(p, a) for p in range(1, 6) for a in range(1, 7)]


def unit_costs(stage: int, act: Action) -> float:
    """Forward 1, backward 2 (the usual 1:2 ratio), optimizer step free."""
    return {F: 1.0, B: 2.0, S: 0.0}[act.op]


def positions(actions: list[Action]) -> dict[Action, int]:
    pos = {act: i for i, act in enumerate(actions)}
    assert len(pos) == len(actions), "an action appears twice in one stage's list"
    return pos


def max_inflight(actions: list[Action]) -> int:
    """Most micro-batches held between forward and backward, walking the list."""
    held, most = 0, 0
    for act in actions:
        if act.op is F:
            held += 1
            most = max(most, held)
        elif act.op is B:
            held -= 1
            assert held >= 0, "backward before its forward"
    assert held == 0, "the list ends with micro-batches still in flight"
    return most


# ----------------------------------------------------------------------------- well-formedness


@pytest.mark.parametrize("schedule", OWN_PROGRAM)
@pytest.mark.parametrize(("stages", "window"), GRID)
def test_every_stage_runs_each_microbatch_once_and_steps_once_per_batch(schedule: str, stages: int, window: int):
    first, n_batches = 2, 3
    lists = build(schedule, stages, window, first, n_batches)
    assert len(lists) == stages
    mbs = list(range(first * window, (first + n_batches) * window))
    for s, actions in enumerate(lists):
        assert actions == stage_actions(schedule, s, stages, window, first, n_batches)
        pos = positions(actions)
        assert [a.mb for a in actions if a.op is F] == mbs
        # backwards in micro-batch order: that is what lets the k-th step close global batch k
        assert [a.mb for a in actions if a.op is B] == mbs
        assert all(pos[Action(F, m)] < pos[Action(B, m)] for m in mbs)
        assert [a.mb for a in actions if a.op is S] == list(range(first, first + n_batches))
        for k in range(first, first + n_batches):
            step = pos[Action(S, k)]
            assert step > pos[Action(B, k * window + window - 1)], f"stage {s}: STEP({k}) before its last backward"
            if k + 1 < first + n_batches:
                nxt = pos[Action(B, (k + 1) * window)]
                assert step < nxt, f"stage {s}: a backward of batch {k + 1} leaks into STEP({k})"


@pytest.mark.parametrize("schedule", OWN_PROGRAM)
@pytest.mark.parametrize(("stages", "window"), GRID)
def test_execution_order_is_a_valid_interleaving(schedule: str, stages: int, window: int):
    lists = build(schedule, stages, window, 0, 3)
    order = execution_order(lists)  # raises on deadlock
    assert Counter(order) == Counter((s, a) for s, acts in enumerate(lists) for a in acts)
    for s, actions in enumerate(lists):
        assert [a for t, a in order if t == s] == actions, "stage order not preserved"
    seen = set()
    for s, act in order:
        dep = dependency(act, s, stages)
        assert dep is None or dep in seen, f"{act} at stage {s} runs before {dep}"
        seen.add((s, act))


def test_unknown_schedule_and_stage_are_rejected():
    with pytest.raises(ValueError, match="unknown schedule"):
        stage_actions("zb", 0, 2, 2, 0, 1)
    with pytest.raises(ValueError, match="out of range"):
        stage_actions("paci", 2, 2, 2, 0, 1)


def test_deadlocked_lists_are_reported():
    # stage 0 waits in B0 for stage 1's B0; stage 1 waits in F1 for stage 0's F1, which comes after B0
    lists = [
        [Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)],
        [Action(F, 1), Action(B, 1), Action(F, 0), Action(B, 0)],
    ]
    with pytest.raises(RuntimeError, match="deadlock"):
        execution_order(lists)


# ------------------------------------------------------------------------------------- in flight


@pytest.mark.parametrize(("stages", "window"), GRID)
def test_inflight_never_exceeds_p_minus_s(stages: int, window: int):
    n_batches = stages + 2
    total = window * n_batches
    for s in range(stages):
        paci = max_inflight(stage_actions("paci", s, stages, window, 0, n_batches))
        # PACI keeps exactly P - s in flight: what the last stage needs to never wait
        assert paci == min(stages - s, total)
        f1b = max_inflight(stage_actions("1f1b", s, stages, window, 0, n_batches))
        assert f1b <= stages - s and f1b == min(stages - s, window)
        assert max_inflight(stage_actions("gpipe", s, stages, window, 0, n_batches)) == window
        assert inflight_cap("paci", s, stages, window) == stages - s


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
@pytest.mark.parametrize("cap", [1, 2])
def test_inflight_option_caps_it_further(schedule: str, cap: int):
    stages, window = 4, 4
    lists = build(schedule, stages, window, 0, 3, inflight=cap)
    execution_order(lists)
    for s, actions in enumerate(lists):
        assert max_inflight(actions) == min(cap, stages - s)


# ---------------------------------------------------------------------------- flush / no flush


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "window"), [(2, 2), (3, 4), (4, 4), (4, 2), (5, 3)])
def test_flush_schedules_drain_between_batches(schedule: str, stages: int, window: int):
    n_batches = 3
    lists = build(schedule, stages, window, 0, n_batches)
    for actions in lists:
        pos = positions(actions)
        for k in range(n_batches - 1):
            assert pos[Action(F, (k + 1) * window)] > pos[Action(S, k)], "forward of batch k+1 before STEP(k)"
    # and across stages, on the time axis: nothing of batch k+1 starts before all of batch k is done
    tl = replay(lists, unit_costs)
    spans = [(a, t0, t1) for st in tl.stages for a, t0, t1 in st.intervals]
    for k in range(n_batches - 1):
        last_b = max(t1 for a, _, t1 in spans if a.op is B and a.mb // window == k)
        first_f = min(t0 for a, t0, _ in spans if a.op is F and a.mb // window == k + 1)
        assert first_f >= last_b


@pytest.mark.parametrize(("stages", "window"), [(2, 1), (2, 4), (3, 2), (4, 4), (5, 3)])
def test_paci_never_flushes(stages: int, window: int):
    n_batches = 4
    lists = build("paci", stages, window, 0, n_batches)
    tl = replay(lists, unit_costs)
    first = {a: (t0, t1) for a, t0, t1 in tl.stages[0].intervals}
    last = {a: (t0, t1) for a, t0, t1 in tl.stages[-1].intervals}
    pos0 = positions(lists[0])
    for k in range(n_batches - 1):
        next_f, last_b = Action(F, (k + 1) * window), Action(B, k * window + window - 1)
        # locally, stage 0 injects batch k+1 before it has even finished batch k's backwards ...
        assert pos0[next_f] < pos0[last_b]
        # ... and in time, before the last stage has run batch k's final backward
        assert first[next_f][0] < last[last_b][1]


# -------------------------------------------------------------------------------------- bubble


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n_batches", [1, 3])
def test_flush_bubble_is_textbook(schedule: str, stages: int, m: int, n_batches: int):
    tl = replay(build(schedule, stages, m, 0, n_batches), unit_costs)
    assert tl.makespan == pytest.approx(n_batches * (m + stages - 1) * 3.0, abs=1e-12)
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1), abs=1e-12)
    for s in range(stages):
        assert tl.stages[s].busy == pytest.approx(n_batches * m * 3.0)


@pytest.mark.parametrize(("stages", "window"), [(2, 4), (4, 1), (4, 4), (5, 3)])
def test_paci_bubble_is_fill_and_drain_only(stages: int, window: int):
    n_mb = 400 - 400 % window
    tl = replay(build("paci", stages, window, 0, n_mb // window), unit_costs)
    # one fill and one drain for the whole run: the pipeline of N micro-batches, (N+P-1)(F+B)
    expected_span = (n_mb + stages - 1) * 3.0
    assert tl.makespan == pytest.approx(expected_span, abs=1e-9)
    assert tl.bubble_fraction == pytest.approx(1.0 - n_mb * 3.0 / expected_span, abs=1e-12)
    assert tl.bubble_fraction < 0.02
    lo, hi = 0.25 * tl.makespan, 0.75 * tl.makespan
    for s, st in enumerate(tl.stages):
        middle = [(t0, t1) for _, t0, t1 in st.intervals if lo <= t0 <= hi]
        assert len(middle) > 50
        gaps = [b0 - a1 for (_, a1), (b0, _) in itertools.pairwise(middle)]
        assert max(gaps) == pytest.approx(0.0, abs=1e-9), f"stage {s} idles in the steady state"


def test_hand_worked_1f1b_timeline_with_unequal_stages():
    """P=2, m=2, 1F1B. Stage 0: F=1, B=2. Stage 1: F=3, B=4. Worked out by hand:

    stage 0: F0 [0,1]  F1 [1,2]  (waits)  B0 [8,10]  (waits)  B1 [15,17]
    stage 1:           F0 [1,4]  B0 [4,8]  F1 [8,11]  B1 [11,15]
    """
    costs = {0: {F: 1.0, B: 2.0, S: 0.0}, 1: {F: 3.0, B: 4.0, S: 0.0}}
    lists = build("1f1b", 2, 2, 0, 1)
    assert lists == [
        [Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1), Action(S, 0)],
        [Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1), Action(S, 0)],
    ]
    tl = replay(lists, lambda s, a: costs[s][a.op])
    assert tl.makespan == 17.0
    got = [[(repr(a), t0, t1) for a, t0, t1 in st.intervals if a.op is not S] for st in tl.stages]
    assert got == [
        [("F0", 0, 1), ("F1", 1, 2), ("B0", 8, 10), ("B1", 15, 17)],
        [("F0", 1, 4), ("B0", 4, 8), ("F1", 8, 11), ("B1", 11, 15)],
    ]
    # busy 6 and 14 of 17: bubbles 11/17 and 3/17, mean 7/17
    assert tl.bubble(0) == pytest.approx(11 / 17)
    assert tl.bubble(1) == pytest.approx(3 / 17)
    assert tl.bubble_fraction == pytest.approx(7 / 17)

    # the same with a transfer latency of 1 on every hop:
    # stage 1: F0 [2,5] B0 [5,9] F1 [9,12] B1 [12,16]; stage 0: B0 [10,12] B1 [17,19]
    tl = replay(lists, lambda s, a: costs[s][a.op], latency=lambda src, dst, a: 1.0)
    assert tl.makespan == 19.0
    assert [(t0, t1) for a, t0, t1 in tl.stages[1].intervals if a.op is not S] == [(2, 5), (5, 9), (9, 12), (12, 16)]


# --------------------------------------------------------------------------------------- drift


def steps_crossed(actions: list[Action]) -> dict[int, int]:
    """Independent count: STEP actions strictly between F(m) and B(m) in the list."""
    pos = positions(actions)
    steps = [i for i, a in enumerate(actions) if a.op is S]
    return {a.mb: sum(pos[Action(F, a.mb)] < i < pos[Action(B, a.mb)] for i in steps) for a in actions if a.op is F}


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("window", [1, 2, 3, 4])
def test_paci_drift_reaches_its_bound(stages: int, window: int):
    n_batches = stages + 3
    for s, actions in enumerate(build("paci", stages, window, 1, n_batches)):
        drift = drift_per_microbatch(actions)
        assert drift == steps_crossed(actions)
        bound = math.ceil((stages - s - 1) / window)
        assert drift_bound(s, stages, window) == bound
        assert max(drift.values()) == bound, f"stage {s}: {Counter(drift.values())}"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "window"), GRID)
def test_flush_schedules_have_no_drift(schedule: str, stages: int, window: int):
    for actions in build(schedule, stages, window, 0, 3):
        assert set(drift_per_microbatch(actions).values()) == {0}


# ------------------------------------------------------------------------- torch's own 1F1B


class _RecordingStage:
    """Stands in for a PipelineStage: records compute calls; has no neighbours, so no comms."""

    def __init__(self, stages: int, index: int) -> None:
        self.num_stages, self.stage_index = stages, index
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.log: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith(("get_fwd_", "get_bwd_")):
            return lambda *args, **kwargs: []  # no p2p ops: torch's _batch_p2p([]) touches no process group
        raise AttributeError(name)

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.log.append(f"F{mb}")

    def backward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.log.append(f"B{mb}")

    def perform_reduce_grad(self, *args, **kwargs) -> None:
        pass

    def clear_runtime_states(self) -> None:
        pass


def torch_order(cls_name: str, stages: int, n_mb: int, stage: int) -> list[str]:
    """The compute order torch's schedule class executes at ``stage``, recorded without a process group.

    Relies on torch internals (``_step_microbatches``); skips rather than fails if they change.
    """
    sched_mod = pytest.importorskip("torch.distributed.pipelining.schedules")
    rec = _RecordingStage(stages, stage)
    try:
        sched = getattr(sched_mod, cls_name)(rec, n_mb)
        sched._initialize_stage = lambda *args, **kwargs: None
        sched._update_losses = lambda *args, **kwargs: None
        sched._step_microbatches()
    except (AttributeError, TypeError) as exc:  # pragma: no cover - depends on the torch version
        pytest.skip(f"torch's {cls_name} internals changed, cannot record its order: {exc!r}")
    return rec.log


@pytest.mark.parametrize(("torch_cls", "schedule"), [("Schedule1F1B", "1f1b"), ("ScheduleGPipe", "gpipe")])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_order_matches_torch_pipelining(torch_cls: str, schedule: str, stages: int, extra: int):
    n_mb = stages + extra  # Schedule1F1B needs at least one micro-batch per stage
    for s in range(stages):
        ours = [repr(a) for a in stage_actions(schedule, s, stages, n_mb, 0, 1) if a.op is not S]
        assert ours == torch_order(torch_cls, stages, n_mb, s), f"stage {s}"
