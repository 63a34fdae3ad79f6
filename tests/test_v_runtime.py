"""ZB-V and DualPipeV run for real through torch's own classes on the distributed runtime (CPU, gloo).

Both fold ``2P`` model pieces into a V over the ranks: rank ``s`` holds pieces ``s`` and ``2P - 1 - s``,
so rank 0 holds the first piece and the last (the loss) while the reporter is rank ``P - 1``.

Oracles, none taken from the code under test:

- the same config trained at P = 1 (one stage, 1f1b, same seed, data and global batch): every
  synchronous schedule is plain gradient accumulation, so per-step losses, validations and the final
  parameters (read back per model unit from the checkpoints) agree to 1e-5 in fp32;
- :func:`helpers.oracles.plain_training` (single-process gradient accumulation) where data
  parallelism changes the stream's layout;
- the order torch 2.13 plans for each rank (``_calculate_single_rank_operations`` of
  ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``, called without a process group, its stage
  indices turned into chunks by torch's own V mapping): the compute calls torch made on each rank,
  a whole backward written as its ``B`` then its ``W``, must come in that order (and so in the order of
  paci-tune's own V lists, :mod:`paci_tune.schedule.vshape`, which reproduce it);
- paci-tune's own 1f1b runtime, for what no oracle writes out (a reached target's end, bf16).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import check_ok, read_metrics, run_cli, summary_of, train_losses
from helpers.configs import make_config, merge, write_config
from helpers.oracles import plain_training
from helpers.traces import traced_run
from torch.distributed.pipelining import schedules as torch_schedules

from paci_tune.schedule import schedule_of, stage_actions
from paci_tune.train.checkpoint import find, units_of

V_SCHEDULES = ["zb-v", "dualpipev"]


def run_doc(schedule: str, stages: int, **pipeline: Any) -> dict[str, Any]:
    """8 steps, a window of 4, an evaluation at step 4 inside the run; at P = 4 the tiny GPT with 6 blocks
    (8 units: a piece each) and a window of 8 (DualPipeV needs ``m >= 2P``)."""
    doc = make_config(
        training={"steps": 8, "global_batch": 8, "eval_every": 4, "eval_sequences": 4},
        optimizer={"lr": 3e-3},
        pipeline={"schedule": schedule, "stages": stages, "window": 4, "runtime": "distributed", **pipeline},
    )
    if stages == 4:
        doc = merge(doc, {"model": {"n_layer": 6}, "pipeline": {"window": 8}})
    return doc


def torch_order(schedule: str, rank: int, stages: int, window: int, steps: int) -> list[str]:
    """What torch's class plans for ``rank``, batch after batch, each closed by its step: torch's ``I`` is
    ``B``, a full backward ``B`` then ``W``, an overlapped forward-backward its two parts in order."""
    planner = torch_schedules.get_schedule_class(schedule_of(schedule).torch_class)
    fake = types.SimpleNamespace(pp_group_size=stages, num_stages=2 * stages, _n_microbatches=window)
    plan = planner._calculate_single_rank_operations(fake, rank)
    to_rank = torch_schedules.generate_stage_to_rank_mapping(stages, 2 * stages, style="v")
    ct = torch_schedules._ComputationType
    ops = {ct.FORWARD: "F", ct.BACKWARD_INPUT: "B", ct.BACKWARD_WEIGHT: "W", ct.FULL_BACKWARD: "BW"}
    flat = []
    for a in plan:
        if a is not None:
            flat += list(a.sub_actions) if a.computation_type == ct.OVERLAP_F_B else [a]
    out = []
    for k in range(steps):
        for a in flat:
            assert to_rank[a.stage_index] == rank
            chunk = 0 if a.stage_index < stages else 1  # torch's V: rank s holds s and 2P - 1 - s
            out += [
                f"{op}{k * window + a.microbatch_index}" + (f".{chunk}" if chunk else "")
                for op in ops[a.computation_type]
            ]
        out.append(f"S{k}")
    return out


def one_stage_run(tmp_path: Path, doc: dict[str, Any], name: str) -> tuple[list[dict[str, Any]], Path]:
    """``doc`` at P = 1 (1f1b, emulated: one stage, plain gradient accumulation), checkpointed at its end."""
    ckpt = tmp_path / f"{name}-ckpt"
    one = merge(
        doc,
        {
            "pipeline": {"schedule": "1f1b", "stages": 1, "runtime": "emulated", "chunks": None},
            "training": {"checkpoint_dir": str(ckpt)},
        },
    )
    proc = run_cli(write_config(tmp_path, one, f"{name}.yaml"), "--metrics", tmp_path / f"{name}.jsonl")
    check_ok(proc)
    return read_metrics(tmp_path / f"{name}.jsonl"), ckpt


def evals(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in records if r["event"] == "eval"]


def assert_same_units(got: Path, want: Path) -> None:
    """The two checkpoints hold the same value for every parameter of every model unit, to 1e-5."""
    _, a = units_of(find(got))
    _, b = units_of(find(want))
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key]["value"] - b[key]["value"]).abs().max().item()
        assert diff <= 1e-5, f"unit {key[0]} {key[1]}: differs by {diff}"


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_registry_places_the_v_as_torch_does(schedule: str, stages: int) -> None:
    """The transport sends piece ``j`` to the rank the registry's ``holder`` names; torch's class sends it
    to its own V mapping's rank. They must agree, and ``virtual_stage`` must invert ``holder``."""
    spec = schedule_of(schedule)
    torch_map = torch_schedules.generate_stage_to_rank_mapping(stages, 2 * stages, style="v")
    assert spec.placement == "v" and spec.chunks_of(None) == 2
    for j in range(2 * stages):
        rank, chunk = spec.holder(j, stages)
        assert rank == torch_map[j] and spec.virtual_stage(rank, chunk, stages) == j


@pytest.mark.slow
@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("stages", [4])  # P = 2: tests/test_every_schedule.py, with every other schedule
def test_a_v_schedule_trains_what_one_stage_trains_in_torchs_order(tmp_path: Path, schedule: str, stages: int) -> None:
    """``2P`` pieces of a unit each, rank s holding s and 2P - 1 - s: every loss, both validations (step 4
    inside the run, step 8 drained) and the final parameters are the P = 1 run's; every rank's compute
    calls and steps come in the order torch plans; rank 0, with the loss, relays it to the reporter."""
    doc = merge(run_doc(schedule, stages), {"training": {"checkpoint_dir": str(tmp_path / "v-ckpt")}})
    records, traces = traced_run(tmp_path, doc)
    want, want_ckpt = one_stage_run(tmp_path, doc, "one")
    assert train_losses(records) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
    assert [s for s, _ in evals(records)] == [s for s, _ in evals(want)] == [4, 8]
    assert [v for _, v in evals(records)] == pytest.approx([v for _, v in evals(want)], abs=1e-5, rel=0)
    assert_same_units(tmp_path / "v-ckpt", want_ckpt)
    window = doc["pipeline"]["window"]
    for s in range(stages):
        assert traces[s] == torch_order(schedule, s, stages, window, 8), f"rank {s}"
        assert traces[s] == [repr(a) for a in stage_actions(schedule, s, stages, window, 0, 8, chunks=2)]
    summary = summary_of(records)
    assert (summary["schedule"], summary["numerics_schedule"], summary["chunks"]) == (schedule, schedule, 2)
    assert summary["partition"] == [1] * (2 * stages)
    assert [st["pipe_stage"] for st in summary["stages"]] == [*range(stages), *reversed(range(stages))]
    assert [st["updates"] for st in summary["stages"]] == [8] * (2 * stages)
    assert summary["max_drift"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_a_v_schedule_with_two_replicas_and_a_clip_equals_plain_training(tmp_path: Path, schedule: str) -> None:
    """P=2 x D=2: each piece's replicas average their gradients, the clip sees the whole model's norm over
    both pieces of every rank, and each replica's rank 0 relays its losses to its rank 1, whose replicas
    sum them: plain training on the D=1 stream with a window D times larger."""
    doc = run_doc(schedule, 2, data_parallel=2)
    doc["optimizer"]["grad_clip"] = 0.05
    records, traces = traced_run(tmp_path, doc)
    for rank in range(4):
        assert traces[rank] == torch_order(schedule, rank % 2, 2, 4, 8), f"rank {rank}"
    single = merge(doc, {"pipeline": {"window": 8, "data_parallel": 1}})
    losses, val_loss, _ = plain_training(single)
    assert train_losses(records) == pytest.approx(losses, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(val_loss, abs=1e-5, rel=0)


def own_runtime_records(tmp_path: Path, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """``doc`` as 1f1b on paci-tune's own distributed runtime (the same flush numbers, the same end rule)."""
    own = merge(doc, {"pipeline": {"schedule": "1f1b", "chunks": None}})
    proc = run_cli(write_config(tmp_path, own, "own.yaml"), "--metrics", tmp_path / "own.jsonl")
    check_ok(proc)
    return read_metrics(tmp_path / "own.jsonl")


@pytest.mark.slow
def test_a_reached_target_ends_dualpipev_where_it_ends_1f1b(tmp_path: Path) -> None:
    """The target is reached at the evaluation of step 2, scored on rank 0 (the last piece) and reported
    by rank 1: the news reaches stage 0 by the pipe's all-reduce at the next point, so the run ends at
    step 4 as paci-tune's own 1f1b does, with the same losses and the one evaluation."""
    doc = merge(run_doc("dualpipev", 2), {"training": {"steps": 12, "eval_every": 2, "target_val_loss": 4.1}})
    records, traces = traced_run(tmp_path, doc)
    want = own_runtime_records(tmp_path, doc)
    assert [s for s, _ in evals(records)] == [s for s, _ in evals(want)] == [2]
    assert [v for _, v in evals(records)] == pytest.approx([v for _, v in evals(want)], abs=1e-5, rel=0)
    assert train_losses(records) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
    assert summary_of(records)["steps"] == summary_of(want)["steps"] == 4
    assert traces[1] == torch_order("dualpipev", 1, 2, 4, 4)


@pytest.mark.slow
def test_dualpipev_in_bf16_equals_1f1b_in_bf16(tmp_path: Path) -> None:
    """bf16 parameters with fp32 masters under DualPipeV's mix of whole backwards (autograd's ``.grad``,
    through the fold hook) and split ones (``W`` sets ``.grad`` by hand, folded as it completes): the
    losses are paci-tune's own 1f1b's."""
    doc = merge(run_doc("dualpipev", 2), {"training": {"steps": 6}, "pipeline": {"precision": "bf16"}})
    proc = run_cli(write_config(tmp_path, doc), "--metrics", tmp_path / "m.jsonl")
    check_ok(proc)
    records = read_metrics(tmp_path / "m.jsonl")
    assert summary_of(records)["precision"] == "bf16"
    assert train_losses(records) == pytest.approx(train_losses(own_runtime_records(tmp_path, doc)), abs=1e-5, rel=0)
