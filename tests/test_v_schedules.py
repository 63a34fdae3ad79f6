"""ZB-V and DualPipeV as action lists: well-formed in a V, in torch's order, with their bubbles and memory.

Oracles: the schedules' definitions, counted by walking the lists (each micro-batch's F, B and W
exactly once per rank and chunk, in dependency order under the V placement, rank ``s`` holding
virtual stages ``s`` and ``2P - 1 - s``); the order torch 2.13's own ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` compute for each rank (their ``_calculate_single_rank_operations``, called
without a process group); and the V's bubble on equal stages with free transfers, derived by hand:
every rank works ``3m`` (a chunk's F, B and W each 1/2) and rank ``P - 1`` cannot start before
``P - 1`` chunk forwards, so each rank idles at least ``(P-1)/2`` -- ``(P-1)/(6m + P-1)`` -- which
both reach once the V is full, ZB-V with ``m < 2P - 1`` idling ``2P - 1 - m`` instead.
"""

from __future__ import annotations

import math
import types

import pytest
from helpers.configs import make_config
from helpers.profiles import equal_profile, make_profile, unit
from helpers.schedule_lists import check_well_formed, costs

from paci_tune.config import derive_run
from paci_tune.config.layout import Layout
from paci_tune.pipeline.planning import plan_partition, predicted_memory, predicted_stage_memory
from paci_tune.schedule import Action, Op, build, dependency, inflight_per_chunk, peak_inflight, schedule_of
from paci_tune.schedule.actions import holder, virtual_stage
from paci_tune.schedule.replay import replay
from paci_tune.sim import simulate

F, B, W, S = Op.FORWARD, Op.BACKWARD, Op.WEIGHT, Op.STEP
ZB_V, DUALPIPE_V = "zb-v", "dualpipev"
TORCH_CLASS = {ZB_V: "ScheduleZBVZeroBubble", DUALPIPE_V: "ScheduleDualPipeV"}


def zb_windows(p: int) -> list[int]:
    """ZB-V's windows: from P to 3P, around 2P - 1 (where its V fills), and a few below P."""
    return sorted({m for m in (1, 2, *range(p, 3 * p + 1), 2 * p - 2, 2 * p - 1) if m >= 1})


def dualpipe_windows(p: int) -> list[int]:
    return [2 * p, 2 * p + 1, 3 * p, 4 * p]


GRID = [(ZB_V, p, m) for p in range(1, 6) for m in zb_windows(p)]
GRID += [(DUALPIPE_V, p, m) for p in range(1, 6) for m in dualpipe_windows(p)]


def v_lists(name: str, stages: int, window: int, first: int = 0, n: int = 1) -> list[list[Action]]:
    assert schedule_of(name).refusal(stages, window, 2) is None
    return build(name, stages, window, first, n, chunks=2)


# ------------------------------------------------------------------------------ the V placement


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_the_v_placement_and_its_inverse(stages: int):
    p = stages
    assert [virtual_stage(s, 0, p, "v") for s in range(p)] == list(range(p))
    assert [virtual_stage(s, 1, p, "v") for s in range(p)] == list(range(2 * p - 1, p - 1, -1))
    for placement in ("looped", "v"):
        for j in range(2 * p):
            s, c = holder(j, p, placement)
            assert virtual_stage(s, c, p, placement) == j
            assert schedule_of(ZB_V if placement == "v" else "interleaved").holder(j, p) == (s, c)
    with pytest.raises(ValueError, match="placement"):
        virtual_stage(0, 0, p, "zigzag")


def test_dependencies_follow_the_v():
    """Rank 0 holds the first and the last piece; rank P-1's chunk 0 feeds its own chunk 1."""
    p = 3
    assert dependency(Action(F, 4, 0), 0, p, 2, "v") is None  # the model's input
    assert dependency(Action(F, 4, 0), 2, p, 2, "v") == (1, Action(F, 4, 0))
    assert dependency(Action(F, 4, 1), 2, p, 2, "v") == (2, Action(F, 4, 0))  # the middle: local
    assert dependency(Action(F, 4, 1), 0, p, 2, "v") == (1, Action(F, 4, 1))
    assert dependency(Action(B, 4, 1), 0, p, 2, "v") is None  # the loss starts the backward
    assert dependency(Action(B, 4, 1), 1, p, 2, "v") == (0, Action(B, 4, 1))
    assert dependency(Action(B, 4, 0), 2, p, 2, "v") == (2, Action(B, 4, 1))
    assert dependency(Action(B, 4, 0), 0, p, 2, "v") == (1, Action(B, 4, 0))
    assert dependency(Action(W, 4, 0), 1, p, 2, "v") is None
    # the looped placement is unchanged by default
    assert dependency(Action(F, 5, 1), 0, 3, 2) == (2, Action(F, 5, 0))


# ------------------------------------------------------------------------------ the lists


@pytest.mark.parametrize(("name", "stages", "window"), GRID)
def test_v_lists_are_well_formed(name: str, stages: int, window: int):
    lists = v_lists(name, stages, window, 1, 2)
    check_well_formed(lists, stages, window, 2, 1, 2, placement="v")
    assert all(any(a.op is W for a in acts) for acts in lists), "every rank splits its backward"


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_zb_v_below_2p_minus_1_drops_the_microbatches_beyond_the_window(stages: int):
    """torch plans max(m, 2P - 1) micro-batches and drops those >= m: the full V's lists without them."""
    full = v_lists(ZB_V, stages, 2 * stages - 1)
    for m in range(1, 2 * stages - 1):
        short = v_lists(ZB_V, stages, m)
        assert short == [[a for a in acts if a.op is S or a.mb < m] for acts in full]


def test_dualpipev_refuses_fewer_than_2p_microbatches():
    assert schedule_of(DUALPIPE_V).refusal(3, 5, 2)[0] == "window"
    assert schedule_of(DUALPIPE_V).refusal(3, 6, 2) is None
    assert schedule_of(ZB_V).refusal(3, 1, 2) is None
    for name in (ZB_V, DUALPIPE_V):
        assert schedule_of(name).refusal(3, 6, 1)[0] == "chunks"


# ------------------------------------------------------------------------------ torch's own order


def torch_v_order(name: str, stages: int, window: int, rank: int) -> list[str]:
    """The compute actions torch's V class plans for ``rank``, as ``F3`` / ``B3.1`` / ``W0``: torch's
    stage index mapped to our chunk by the V placement; ``I`` is our ``B``, a full backward ``B`` then
    ``W``, an overlapped forward-backward its forward then its full backward. Calls the class's
    ``_calculate_single_rank_operations`` on a stand-in holding the attributes its ``__init__`` sets."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    fake = types.SimpleNamespace(
        pp_group_size=stages, _n_microbatches=window, n_local_stages=2, num_stages=2 * stages, _num_stages=2 * stages
    )
    try:
        plan = getattr(sched, TORCH_CLASS[name])._calculate_single_rank_operations(fake, rank)
    except (AttributeError, TypeError) as exc:  # pragma: no cover - depends on the torch version
        pytest.skip(f"torch's {TORCH_CLASS[name]} internals changed: {exc!r}")
    out: list[str] = []

    def one(act) -> None:
        s, chunk = holder(act.stage_index, stages, "v")
        assert s == rank, f"rank {rank} plans stage {act.stage_index}"
        tail = f"{act.microbatch_index}" + (f".{chunk}" if chunk else "")
        ops = {"F": "F", "I": "B", "W": "W", "B": "BW"}[act.computation_type.value]  # B: a full backward
        out.extend(op + tail for op in ops)

    for act in plan:
        if act is None:
            continue
        for sub in act.sub_actions if act.computation_type.value == "OVERLAP_F_B" else (act,):
            one(sub)
    return out


@pytest.mark.parametrize(("name", "stages", "window"), GRID)
def test_v_order_matches_torch(name: str, stages: int, window: int):
    lists = v_lists(name, stages, window)
    for s in range(stages):
        ours = [repr(a) for a in lists[s] if a.op is not S]
        assert ours == torch_v_order(name, stages, window, s), f"rank {s}"


# ------------------------------------------------------------------------------ bubble and memory


@pytest.mark.parametrize("name", [ZB_V, DUALPIPE_V])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 6])
def test_bubble_is_the_v_fill_and_equals_replay_on_unit_costs(name: str, stages: int):
    p = stages
    windows = [*zb_windows(p), 4 * p] if name == ZB_V else dualpipe_windows(p)
    for m in windows:
        tl = replay(v_lists(name, p, m), costs(2, True), chunks=2, placement="v")
        idle = max(2 * p - 1 - m, (p - 1) / 2)  # by hand (module docstring)
        assert tl.makespan == pytest.approx(3 * m + idle, abs=1e-9), f"m={m}"
        assert tl.bubble_fraction == pytest.approx(idle / (3 * m + idle), abs=1e-9), f"m={m}"
        assert schedule_of(name).bubble(p, m) == pytest.approx(tl.bubble_fraction, abs=1e-9), f"m={m}"
        if m >= 2 * p - 1 and p > 1:  # a full V: below ZB-H1's (P-1)/(3m+P-1) and 1F1B's
            assert tl.bubble_fraction < (p - 1) / (3 * m + p - 1) < (p - 1) / (m + p - 1)


@pytest.mark.parametrize("name", [ZB_V, DUALPIPE_V])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_peak_inflight_per_chunk(name: str, stages: int):
    """Rank s holds at most 2P - s micro-batches on its first chunk and s + 1 on its second, each until
    its W: 2P chunk activations at once under ZB-V (half a stage each: 1F1B's first stage's P whole
    ones), one more under DualPipeV, whose forward runs before the backward that frees one."""
    p = stages
    for m in (2 * p, 3 * p, 4 * p):
        for s, acts in enumerate(v_lists(name, p, m, 0, 2)):
            live = inflight_per_chunk(acts)
            assert max(c[0] for c in live) == 2 * p - s
            assert max(c[1] for c in live) == s + 1
            assert peak_inflight(acts) == 2 * p + (name == DUALPIPE_V)


# ------------------------------------------------------------------------------ the simulator


@pytest.mark.parametrize("name", [ZB_V, DUALPIPE_V])
@pytest.mark.parametrize("stages", [2, 4])
def test_simulating_a_v_schedule(name: str, stages: int):
    """On 2P equal units (F = 1, backward 2 split evenly into B = W = 1, free links) each rank holds
    pieces s and 2P - 1 - s; the bubble is the V's, below 1F1B's on the same units; the memory counts
    both chunks' weights and both chunks' activations in flight."""
    p, m = stages, 2 * stages
    prof = equal_profile(2 * p)
    r = simulate(Layout(name, p, 1, m, 1, None, (1,) * (2 * p), 2), prof, 1)
    flush = simulate(Layout("1f1b", p, 1, m, 1, None, (2,) * p), prof, 1)
    assert r.bubble_fraction == pytest.approx(schedule_of(name).bubble(p, m), abs=1e-9)
    assert r.analytic_bubble_fraction == pytest.approx(r.bubble_fraction, abs=1e-9)
    assert r.bubble_fraction < flush.bubble_fraction
    assert r.backward_split == "derived"
    assert r.step_time_s < flush.step_time_s
    piece = 5000 + 1000  # one micro-batch on a one-unit piece: its saved tensors and its output
    for s, st in enumerate(r.per_stage):
        assert st.chunk_units == (range(s, s + 1), range(2 * p - 1 - s, 2 * p - s))
        assert st.memory.params == 2 * 4000 and st.memory.grads == 2 * 4000  # two units' fp32 weights
        assert st.peak_inflight == 2 * p + (name == DUALPIPE_V)
        if s > 0:  # rank 0's second chunk is the last piece, which keeps only the loss
            assert st.memory.activations == st.peak_inflight * piece
        assert st.memory.total > st.memory.activations > 0


@pytest.mark.parametrize("name", [ZB_V, DUALPIPE_V])
def test_the_hop_between_a_ranks_two_chunks_is_free(name: str):
    """On one rank (P = 1) both pieces sit on the device: a slow link changes nothing. On two ranks every
    other hop crosses it: the run takes longer."""
    slow = make_profile([unit(1.0, 2.0) for _ in range(4)], p2p={"latency_s": 0.5, "bandwidth_Bps": math.inf})
    free = equal_profile(4)
    one = Layout(name, 1, 1, 4, 1, None, (2, 2), 2)
    assert simulate(one, slow, 2).makespan_s == pytest.approx(simulate(one, free, 2).makespan_s)
    two = Layout(name, 2, 1, 4, 1, None, (1, 1, 1, 1), 2)
    assert simulate(two, slow, 2).makespan_s > simulate(two, free, 2).makespan_s + 0.5


@pytest.mark.parametrize("name", [ZB_V, DUALPIPE_V])
def test_planning_cuts_a_v_into_2p_pieces_and_predicts_both_chunks(name: str):
    """The run's cut has 2P balanced pieces; its prediction per rank is the simulator's, and the walked
    peak counts both chunks' activations."""
    p, m = 2, 4
    prof = equal_profile(2 * p)
    pipeline = {"schedule": name, "stages": p, "window": m, "microbatch_size": 1, "device": "cpu"}
    cfg = derive_run(make_config(training={"global_batch": m, "clock": "sim"}, pipeline=pipeline))
    assert cfg.layout.chunks == 2
    sizes = plan_partition(cfg, [1.0] * (2 * p), prof)
    assert sizes == [1] * (2 * p)
    sim = simulate(cfg.layout.with_partition(sizes), prof, 4)
    assert predicted_memory(cfg, prof, sizes) == [st.memory.total for st in sim.per_stage]
    walked = predicted_stage_memory(cfg, prof, sizes)
    assert [st.params for st in walked] == [2 * 4000] * p
    assert all(st.activations > 5000 + 1000 for st in walked)  # more than one piece's micro-batch
