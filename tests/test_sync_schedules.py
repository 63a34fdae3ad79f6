"""Interleaved 1F1B and ZB-H1 as action lists: well-formed, in torch's order, with their analytic bubbles.

Oracles: the schedules' definitions, counted by walking the lists (each micro-batch's F, B and W
exactly once per stage and chunk, in dependency order); the order torch 2.13's own
``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` compute for each rank (their
``_calculate_single_rank_operations``, called without a process group); and the textbook bubbles on
equal stages with free transfers:

- 1F1B, F = 1, B = 2: ``(P-1)/(m+P-1)``;
- interleaved with ``v`` chunks, each chunk ``F = 1/v``, ``B = 2/v``: the fill and drain are ``v``
  times shorter, ``(P-1)/(v m + P-1)`` (Narayanan et al. 2021), for ``m`` a multiple of ``P``;
- ZB-H1 with ``F = B = W = 1`` (the whole backward ``B + W = 2`` as in 1F1B): Qi et al. give the
  bubble time ``(P-1)(F + B - W) = (P-1)``, a third of 1F1B's ``(P-1)(F + B + W) = 3 (P-1)``, so
  the fraction is ``(P-1)/(3m + P-1)``, for ``m >= P``.
"""

from __future__ import annotations

import types

import pytest
from helpers.schedule_lists import check_well_formed, costs

from paci_tune.schedule import (
    Action,
    Op,
    build,
    dependency,
    peak_inflight,
    schedule_of,
    stage_actions,
)
from paci_tune.schedule.replay import replay

F, B, W, S = Op.FORWARD, Op.BACKWARD, Op.WEIGHT, Op.STEP
INTERLEAVED_GRID = [(p, m, v) for p in (1, 2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p, p + 1) if m >= 1]
ZB_GRID = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 6, 8)]


def lists_of(schedule: str, stages: int, window: int, chunks: int, first: int = 0, n: int = 2) -> list[list[Action]]:
    refused = schedule_of(schedule).refusal(stages, window, chunks)
    if refused:
        pytest.skip(refused[1])
    return build(schedule, stages, window, first, n, chunks=chunks)


@pytest.mark.parametrize(("stages", "window", "chunks"), INTERLEAVED_GRID)
def test_interleaved_lists_are_well_formed(stages: int, window: int, chunks: int):
    check_well_formed(lists_of("interleaved", stages, window, chunks, 1, 2), stages, window, chunks, 1, 2)


@pytest.mark.parametrize(("stages", "window"), ZB_GRID)
def test_zb_h1_lists_are_well_formed(stages: int, window: int):
    lists = lists_of("zb-h1", stages, window, 1, 1, 2)
    check_well_formed(lists, stages, window, 1, 1, 2)
    assert all(any(a.op is W for a in acts) for acts in lists), "every stage splits its backward"


def test_the_virtual_stages_chain_across_stages():
    """Chunk c of stage s is virtual stage c*P + s: the last stage's chunk 0 feeds the first stage's chunk 1."""
    assert dependency(Action(F, 5, 1), 0, 3, 2) == (2, Action(F, 5, 0))
    assert dependency(Action(F, 5, 1), 2, 3, 2) == (1, Action(F, 5, 1))
    assert dependency(Action(B, 5, 0), 2, 3, 2) == (0, Action(B, 5, 1))
    assert dependency(Action(B, 5, 1), 2, 3, 2) is None  # the model's last chunk starts the backward
    assert dependency(Action(W, 5, 0), 1, 3, 2) is None  # a weight gradient waits for its own B only


# ------------------------------------------------------------------------------ torch's own order


def torch_rank_order(cls_name: str, stages: int, window: int, chunks: int, rank: int) -> list[str]:
    """The compute actions torch's schedule class plans for ``rank``, as ``F3`` / ``B3.1`` / ``W0``.

    Calls the class's ``_calculate_single_rank_operations`` on a stand-in holding the attributes it
    reads (set as the class's ``__init__`` sets them); skips if those internals changed.
    """
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    n_rounds = max(1, window // stages)
    fake = types.SimpleNamespace(
        n_local_stages=chunks, pp_group_size=stages, _n_microbatches=window, microbatches_per_round=window // n_rounds
    )
    try:
        plan = getattr(sched, cls_name)._calculate_single_rank_operations(fake, rank)
    except (AttributeError, TypeError) as exc:  # pragma: no cover - depends on the torch version
        pytest.skip(f"torch's {cls_name} internals changed: {exc!r}")
    ops = {"F": "F", "B": "B", "I": "B", "W": "W"}
    out = []
    for act in plan:
        if act is None:
            continue
        chunk = act.stage_index // stages
        out.append(f"{ops[act.computation_type.value]}{act.microbatch_index}" + (f".{chunk}" if chunk else ""))
    return out


@pytest.mark.parametrize(("stages", "window", "chunks"), INTERLEAVED_GRID)
def test_interleaved_order_matches_torch(stages: int, window: int, chunks: int):
    lists = lists_of("interleaved", stages, window, chunks, 0, 1)
    for s in range(stages):
        ours = [repr(a) for a in lists[s] if a.op is not S]
        assert ours == torch_rank_order("ScheduleInterleaved1F1B", stages, window, chunks, s), f"stage {s}"


@pytest.mark.parametrize(("stages", "window"), ZB_GRID)
def test_zb_h1_order_matches_torch_zero_bubble_with_one_chunk(stages: int, window: int):
    lists = lists_of("zb-h1", stages, window, 1, 0, 1)
    for s in range(stages):
        ours = [repr(a) for a in lists[s] if a.op is not S]
        assert ours == torch_rank_order("ScheduleInterleavedZeroBubble", stages, window, 1, s), f"stage {s}"


# ------------------------------------------------------------------------------------ bubbles


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("mult", [1, 2, 3])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_bubble_is_textbook(stages: int, mult: int, chunks: int):
    m, n = mult * stages, 2
    tl = replay(build("interleaved", stages, m, 0, n, chunks=chunks), costs(chunks, False), chunks=chunks)
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (chunks * m + stages - 1), abs=1e-9)
    assert tl.makespan == pytest.approx(n * (3 * m + 3 * (stages - 1) / chunks), abs=1e-9)


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_zb_h1_bubble_is_a_third_of_1f1b(stages: int, extra: int):
    m, n = (stages + extra if extra < 2 else 3 * stages), 2  # windows torch's rounds divide: P, P + 1, 3P
    zb = replay(build("zb-h1", stages, m, 0, n), costs(1, True))
    flush = replay(build("1f1b", stages, m, 0, n), costs(1, False))
    assert flush.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1), abs=1e-9)
    assert zb.bubble_fraction == pytest.approx((stages - 1) / (3 * m + stages - 1), abs=1e-9)
    idle_zb, idle_flush = zb.makespan - 3 * m * n, flush.makespan - 3 * m * n
    assert idle_zb == pytest.approx(idle_flush / 3, abs=1e-9), "ZB-H1's bubble time is a third of 1F1B's"


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_zb_h1_holds_as_many_microbatches_as_1f1b_at_its_peak(stages: int):
    """A micro-batch stays in flight until its W. Each ZB-H1 stage holds min(P, m), 1F1B's stage s
    min(P - s, m): the most over the stages, what sizes the devices, is the same."""
    for m in (stages, 2 * stages):
        zb = [peak_inflight(acts) for acts in build("zb-h1", stages, m, 0, 2)]
        flush = [peak_inflight(acts) for acts in build("1f1b", stages, m, 0, 2)]
        assert zb == [min(stages, m)] * stages
        assert flush == [min(stages - s, m) for s in range(stages)]
        assert max(zb) == max(flush)


def test_synchronised_steps_wait_for_every_weight_gradient():
    """With a global-norm step barrier, no STEP(k) starts before the last W of batch k on any stage."""
    lists = build("zb-h1", 3, 3, 0, 2)
    tl = replay(lists, costs(1, True), sync_steps=3)
    for k in range(2):
        last_w = max(t1 for st in tl.stages for a, _, t1 in st.intervals if a.op is W and a.mb // 3 == k)
        steps = [t0 for st in tl.stages for a, t0, _ in st.intervals if a.op is S and a.mb == k]
        assert min(steps) >= last_w


# ------------------------------------------------------------------------------------ refusals


def test_layouts_the_schedules_cannot_run_are_refused_with_the_reason():
    def refusal(name: str, stages: int, window: int, chunks: int) -> tuple[str, str] | None:
        return schedule_of(name).refusal(stages, window, chunks)

    key, why = refusal("interleaved", 4, 8, 1)
    assert key == "chunks" and "2 or more chunks" in why
    key, why = refusal("interleaved", 4, 9, 2)  # 2 rounds do not divide 9 micro-batches
    assert key == "window" and "rounds" in why
    assert refusal("interleaved", 4, 6, 2) is None  # one round of 6
    key, why = refusal("zb-h1", 4, 8, 2)
    assert key == "chunks" and "1 chunk per stage" in why
    with pytest.raises(ValueError, match="rounds"):
        stage_actions("interleaved", 0, 4, 9, 0, 1, chunks=2)
    with pytest.raises(ValueError, match="one chunk"):
        stage_actions("1f1b", 0, 4, 8, 0, 1, chunks=2)
