"""ZB-H1, interleaved 1F1B (and, opted in, 1F1B) run for real through torch's own schedule classes on the
distributed runtime.

Oracles written out here or in the helpers, not taken from the code under test: plain single-process
gradient accumulation (:func:`helpers.oracles.plain_training`: every synchronous schedule computes
its gradients, so the losses must equal it to 1e-5 in fp32); each stage's action list from
:mod:`paci_tune.schedule` (checked against torch's own planner in ``test_sync_schedules``), which the
order of the compute calls torch made on each rank must equal, chunk by chunk under interleaved 1F1B;
and torch's rules for the layouts its classes refuse (``Schedule1F1B``: at least as many
micro-batches as stages; the zero-bubble and interleaved schedules: ``rounds = max(1, m // P)`` must
divide ``m``), refused up front naming the key.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO
from helpers.cli import check_error, check_ok, cli_env, read_metrics, run_cli, summary_of, train_losses
from helpers.configs import make_config, merge, write_config
from helpers.oracles import plain_training
from helpers.traces import traced_run

from paci_tune.config import load_config
from paci_tune.config.tune import load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.schedule import stage_actions
from paci_tune.tune.point import TrialParams
from paci_tune.tune.setup import bind_space
from paci_tune.tune.space import load_space


def run_doc(schedule: str, stages: int, **pipeline: Any) -> dict[str, Any]:
    """8 steps of the tiny model, a window of 4, an evaluation at step 4 inside the run (a segment cut)."""
    return make_config(
        training={"steps": 8, "global_batch": 8, "eval_every": 4, "eval_sequences": 4},
        optimizer={"lr": 3e-3},
        pipeline={"schedule": schedule, "stages": stages, "window": 4, "runtime": "distributed", **pipeline},
    )


def assert_plain_numbers(records: list[dict[str, Any]], doc: dict[str, Any]) -> None:
    losses, val_loss, _ = plain_training(doc)
    assert train_losses(records) == pytest.approx(losses, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(val_loss, abs=1e-5, rel=0)
    assert [r["step"] for r in records if r["event"] == "eval"] == [4, 8]


def expected_order(schedule: str, stage: int, stages: int, window: int, steps: int, chunks: int = 1) -> list[str]:
    return [repr(a) for a in stage_actions(schedule, stage, stages, window, 0, steps, chunks=chunks)]


# ------------------------------------------------------------------------------------ refusals


def refusal(tmp_path: Path, doc: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, doc))
    return e.value


REFUSED = [
    ("interleaved-emulated-wall", {"pipeline": {"schedule": "interleaved", "runtime": "emulated"}}, "training.clock",
     "pipeline.runtime: distributed"),
    ("interleaved-rounds", {"pipeline": {"schedule": "interleaved", "window": 5, "partition": [1, 1, 1, 1]},
                            "training": {"global_batch": 10}}, "pipeline.window", "rounds"),
    ("zb-h1-emulated-wall", {"pipeline": {"runtime": "emulated"}}, "training.clock", "pipeline.runtime: distributed"),
    ("zb-h1-rounds", {"pipeline": {"window": 5}, "training": {"global_batch": 10}}, "pipeline.window", "rounds"),
    ("zb-h1-inflight", {"pipeline": {"inflight": 1}}, "pipeline.inflight", "torch's class"),
    ("torch-1f1b-few-microbatches", {"pipeline": {"schedule": "1f1b", "torch_schedule": True, "window": 2,
                                                  "stages": 4}}, "pipeline.window", "Schedule1F1B"),
    ("torch-paci", {"pipeline": {"schedule": "paci", "torch_schedule": True}}, "pipeline.torch_schedule",
     "torch's own classes"),
    ("torch-emulated", {"pipeline": {"schedule": "1f1b", "torch_schedule": True, "runtime": "emulated"}},
     "pipeline.torch_schedule", "distributed"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "key", "why"), REFUSED, ids=[c[0] for c in REFUSED])
def test_layouts_torch_cannot_run_are_refused_up_front(
    tmp_path: Path, case: str, change: dict[str, Any], key: str, why: str
) -> None:
    err = refusal(tmp_path, merge(run_doc("zb-h1", 2), change))
    assert err.key == key and why in str(err), str(err)


def test_supported_combinations_load(tmp_path: Path) -> None:
    """zb-h1 and interleaved on the distributed runtime on the wall clock, a window of at most P or a
    multiple of it; 1f1b through torch's class on request."""
    for doc in (
        run_doc("zb-h1", 2),
        run_doc("zb-h1", 4, window=2),
        run_doc("zb-h1", 2, window=6),
        run_doc("interleaved", 2),
        run_doc("interleaved", 2, window=6, chunks=3),
        run_doc("1f1b", 2, torch_schedule=True),
    ):
        if doc["pipeline"]["window"] != 4:
            doc["training"]["global_batch"] = 2 * doc["pipeline"]["window"]
        cfg = load_config(write_config(tmp_path, doc))
        assert cfg.pipeline.runs_torch_schedule and cfg.training.clock == "wall"


def test_the_command_line_refuses_with_exit_2(tmp_path: Path) -> None:
    doc = run_doc("zb-h1", 2, window=5)
    doc["training"]["global_batch"] = 10
    proc = run_cli(write_config(tmp_path, doc), "--metrics", tmp_path / "m.jsonl")
    check_error(proc, tmp_path / "m.jsonl", "pipeline.window", "5")
    assert "rounds" in proc.stderr


# ---------------------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_zb_h1_runs_its_action_list_in_order(tmp_path: Path, stages: int) -> None:
    """Every rank's forwards, input halves B and weight halves W, and its steps, come in the order of
    its zb-h1 action list; the run's losses are plain training's."""
    doc = run_doc("zb-h1", stages)
    records, traces = traced_run(tmp_path, doc)
    for s in range(stages):
        assert traces[s] == expected_order("zb-h1", s, stages, 4, 8), f"stage {s}"
    assert any(a.startswith("W") for a in traces[0])
    assert_plain_numbers(records, doc)


@pytest.mark.slow
def test_torch_1f1b_on_request_runs_1f1b_in_order(tmp_path: Path) -> None:
    """``pipeline.torch_schedule: true`` runs 1f1b through torch's Schedule1F1B: 1F1B's order, plain numbers."""
    doc = run_doc("1f1b", 2, torch_schedule=True)
    records, traces = traced_run(tmp_path, doc)
    for s in range(2):
        assert traces[s] == expected_order("1f1b", s, 2, 4, 8), f"stage {s}"
    assert_plain_numbers(records, doc)
    assert summary_of(records)["numerics_schedule"] == "1f1b"


@pytest.mark.slow
def test_zb_h1_with_two_replicas_and_a_clip_equals_plain_training(tmp_path: Path) -> None:
    """P=2 x D=2: each stage's replicas average their gradients at the step and the clip sees the whole
    model's averaged norm, so the run is plain training on the D=1 stream with a window D times larger
    (replica r reads micro-batch j * D + r of it)."""
    doc = run_doc("zb-h1", 2, window=2, data_parallel=2)
    doc["optimizer"]["grad_clip"] = 0.05
    records, traces = traced_run(tmp_path, doc)
    for rank in range(4):
        assert traces[rank] == expected_order("zb-h1", rank % 2, 2, 2, 8), f"rank {rank}"
    single = merge(doc, {"pipeline": {"window": 4, "data_parallel": 1}})
    assert_plain_numbers(records, single)


@pytest.mark.slow
def test_interleaved_runs_each_chunks_actions_in_order(tmp_path: Path) -> None:
    """P=2, v=2 on the tiny model's 4 units (a piece each, rank s holding pieces s and s + 2): every
    rank's forwards and backwards, on their chunk, and its steps come in the order of its interleaved
    action list; the losses and evaluations are plain training's."""
    doc = run_doc("interleaved", 2, chunks=2)
    records, traces = traced_run(tmp_path, doc)
    for s in range(2):
        assert traces[s] == expected_order("interleaved", s, 2, 4, 8, chunks=2), f"stage {s}"
    assert any(a.endswith(".1") for a in traces[0])
    assert_plain_numbers(records, doc)
    summary = summary_of(records)
    assert (summary["schedule"], summary["numerics_schedule"], summary["chunks"]) == ("interleaved",) * 2 + (2,)
    assert summary["partition"] == [1, 1, 1, 1] and [st["stage"] for st in summary["stages"]] == [0, 1, 2, 3]
    assert [st["pipe_stage"] for st in summary["stages"]] == [0, 1, 0, 1]  # rank s holds pieces s and s + 2
    assert [st["updates"] for st in summary["stages"]] == [8] * 4
    assert summary["analytic_bubble_fraction"] == pytest.approx(1 / (2 * 4 + 1))


@pytest.mark.slow
def test_interleaved_on_one_rank_hands_its_pieces_messages_over_in_memory(tmp_path: Path) -> None:
    """P=1, v=2: both pieces on rank 0, whose evaluations pass from piece 0 to piece 1 without gloo (a
    process cannot send to itself); every loss and evaluation is plain training's."""
    doc = run_doc("interleaved", 1, chunks=2)
    proc = run_cli(write_config(tmp_path, doc), "--metrics", tmp_path / "m.jsonl")
    check_ok(proc)
    records = read_metrics(tmp_path / "m.jsonl")
    assert_plain_numbers(records, doc)
    assert [st["pipe_stage"] for st in summary_of(records)["stages"]] == [0, 0]


@pytest.mark.slow
def test_interleaved_with_two_replicas_and_a_clip_equals_plain_training(tmp_path: Path) -> None:
    """P=2 x D=2, v=2: each piece's replicas average their gradients and the clip sees the whole model's
    norm, summed over every piece of every rank before any piece steps; plain training on the D=1
    stream with a window D times larger."""
    doc = run_doc("interleaved", 2, window=2, data_parallel=2, chunks=2)
    doc["optimizer"]["grad_clip"] = 0.05
    records, traces = traced_run(tmp_path, doc)
    for rank in range(4):
        assert traces[rank] == expected_order("interleaved", rank % 2, 2, 2, 8, chunks=2), f"rank {rank}"
    assert_plain_numbers(records, merge(doc, {"pipeline": {"window": 4, "data_parallel": 1}}))


@pytest.mark.slow
def test_interleaved_checkpoints_move_to_and_from_other_layouts(tmp_path: Path) -> None:
    """A distributed interleaved run saves one entry per piece and starts from a checkpoint of another
    layout (``--init-from``): 4 steps of emulated 1F1B at P=2 continue as interleaved P=2 x v=2 to step 8,
    whose checkpoint continues as emulated 1F1B at P=4 to step 12 -- every loss plain training's."""
    doc = merge(run_doc("interleaved", 2, chunks=2), {"training": {"steps": 12, "eval_every": 1000}})
    want, _, _ = plain_training(doc)
    first = merge(
        doc,
        {
            "training": {"steps": 4, "checkpoint_dir": str(tmp_path / "a"), "checkpoint_every": 4},
            "pipeline": {"schedule": "1f1b", "runtime": "emulated", "chunks": None},
        },
    )
    check_ok(run_cli(write_config(tmp_path, first, "a.yaml"), "--metrics", tmp_path / "a.jsonl"))
    middle = merge(
        doc,
        {
            "training": {
                "steps": 8,
                "checkpoint_dir": str(tmp_path / "b"),
                "checkpoint_every": 4,
                "init_from": str(tmp_path / "a"),
            }
        },
    )
    check_ok(run_cli(write_config(tmp_path, middle, "b.yaml"), "--metrics", tmp_path / "b.jsonl"))
    four = {"schedule": "1f1b", "runtime": "emulated", "stages": 4, "chunks": None}
    last = merge(doc, {"training": {"init_from": str(tmp_path / "b")}, "pipeline": four})
    check_ok(run_cli(write_config(tmp_path, last, "c.yaml"), "--metrics", tmp_path / "c.jsonl"))
    got = sorted(
        (r["step"], r["loss"]) for x in "abc" for r in read_metrics(tmp_path / f"{x}.jsonl") if r["event"] == "train"
    )
    assert [step for step, _ in got] == list(range(1, 13))
    assert [loss for _, loss in got] == pytest.approx(want, abs=1e-5, rel=0)


@pytest.mark.slow
def test_interleaved_in_bf16_equals_1f1b_in_bf16(tmp_path: Path) -> None:
    """bf16 parameters with fp32 masters on v = 2 pieces per rank: the losses are paci-tune's own 1f1b's."""
    doc = merge(run_doc("interleaved", 2, chunks=2), {"training": {"steps": 6}, "pipeline": {"precision": "bf16"}})
    proc = run_cli(write_config(tmp_path, doc), "--metrics", tmp_path / "m.jsonl")
    check_ok(proc)
    records = read_metrics(tmp_path / "m.jsonl")
    assert summary_of(records)["precision"] == "bf16"
    own = own_runtime_records(tmp_path, merge(doc, {"pipeline": {"chunks": None}}))
    assert train_losses(records) == pytest.approx(train_losses(own), abs=1e-5, rel=0)


@pytest.mark.slow
def test_the_sim_vs_measured_bench_runs_in_its_quick_mode() -> None:
    """``bench/sim_vs_measured.py --quick``: calibrate, then 1f1b, zb-h1, 1f1b through torch's class and
    interleaved trained on the distributed runtime, each row's measured and simulated step time printed."""
    proc = subprocess.run(
        [sys.executable, "bench/sim_vs_measured.py", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=cli_env(),
        check=False,
    )
    check_ok(proc)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("P=2 ")]
    assert [ln.split()[1] for ln in rows] == ["1f1b", "zb-h1", "1f1b-torch", "interleaved"], proc.stdout
    assert all("sim/measured" in ln for ln in rows)


@pytest.mark.whole_machine  # binds a wall-clock space of 2 devices: a core each
def test_a_search_drops_the_zb_h1_windows_torch_cannot_run(tmp_path: Path) -> None:
    """Global batch 10 on 2 stages: b = 2 makes a = 5, whose 2 rounds do not divide it (torch's rule,
    written out in the module docstring); b = 1 makes a = 10 in 5 rounds of 2. zb-h1 is torch's class,
    and the emulated runtime times the same schedule, so both refuse the point; 1f1b keeps it."""
    space_file = tmp_path / "space.yaml"
    space_file.write_text(
        yaml.safe_dump({"schedules": ["paci", "1f1b", "zb-h1"], "stages": [2], "microbatch_size": [1, 2]})
    )
    doc = {
        **make_config(training={"global_batch": 10}, pipeline={"window": 5}),
        "target": {"value": 2.0},
        "budget": {"clock": "wall", "seconds": 1.0},
        "hardware": {"devices": 2},
        "search": {"space": str(space_file)},
    }
    space = bind_space(load_tune_config(doc))  # trials on the wall clock: the distributed runtime
    why = space.why_not(TrialParams("zb-h1", 2, 5, 2))
    assert why is not None and "rounds" in why
    assert space.why_not(TrialParams("zb-h1", 2, 10, 1)) is None and space.why_not(TrialParams("1f1b", 2, 5, 2)) is None
    assert any(d.startswith("zb-h1 P=2") and "rounds" in d for d in space.dropped)
    emulated = load_space(str(space_file), global_batch=10, n_units=4, max_stages=None, distributed=False)
    assert "rounds" in str(emulated.why_not(TrialParams("zb-h1", 2, 5, 2)))


def own_runtime_records(tmp_path: Path, doc: dict[str, Any], *args: str) -> list[dict[str, Any]]:
    """``doc`` as 1f1b on paci-tune's own distributed runtime (the same flush numbers, the same end rule)."""
    own = merge(doc, {"pipeline": {"schedule": "1f1b"}})
    proc = run_cli(write_config(tmp_path, own, "own.yaml"), *args, "--metrics", tmp_path / "own.jsonl")
    check_ok(proc)
    return read_metrics(tmp_path / "own.jsonl")


@pytest.mark.slow
def test_a_reached_target_ends_zb_h1_where_it_ends_1f1b(tmp_path: Path) -> None:
    """The target is reached at the evaluation of step 2; the news reaches stage 0 before its next
    evaluation point (torch's steps carry no flag: a pipe all-reduce at each point does), so the run
    ends at step 4, as paci-tune's own 1f1b ends, with the same losses and evaluations (no closing
    one: nothing after the target's validation is scored)."""
    doc = merge(run_doc("zb-h1", 2), {"training": {"steps": 12, "eval_every": 2, "target_val_loss": 4.1}})
    records, traces = traced_run(tmp_path, doc)
    want = own_runtime_records(tmp_path, doc)
    evals = [(r["step"], r["val_loss"]) for r in records if r["event"] == "eval"]
    want_evals = [(r["step"], r["val_loss"]) for r in want if r["event"] == "eval"]
    assert [s for s, _ in evals] == [s for s, _ in want_evals] == [2]
    assert [v for _, v in evals] == pytest.approx([v for _, v in want_evals], abs=1e-5, rel=0)
    assert train_losses(records) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
    assert summary_of(records)["steps"] == summary_of(want)["steps"] == 4
    assert traces[1] == expected_order("zb-h1", 1, 2, 4, 4)


@pytest.mark.slow
def test_zb_h1_in_bf16_equals_1f1b_in_bf16(tmp_path: Path) -> None:
    """bf16 parameters with fp32 masters: torch's weight pass sets ``.grad`` by hand, past the hook that
    folds each backward into the masters, so each W is folded as it completes. At the same threads per
    stage the losses are paci-tune's own 1f1b's (the known bf16 limitation is about thread counts)."""
    doc = merge(run_doc("zb-h1", 2), {"training": {"steps": 6}, "pipeline": {"precision": "bf16"}})
    proc = run_cli(write_config(tmp_path, doc), "--metrics", tmp_path / "m.jsonl")
    check_ok(proc)
    records = read_metrics(tmp_path / "m.jsonl")
    assert summary_of(records)["precision"] == "bf16"
    assert train_losses(records) == pytest.approx(train_losses(own_runtime_records(tmp_path, doc)), abs=1e-5, rel=0)


def test_cuda_stages_on_gloo_are_refused_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    """Two stage processes on one visible GPU share it over host-staged gloo, which paci-tune's own
    transport does and torch's schedule classes cannot: refused up front naming pipeline.backend."""
    from paci_tune.train import run as run_module

    monkeypatch.setattr(run_module, "visible_gpus", lambda: 1)
    cfg = load_config(write_config(tmp_path, run_doc("zb-h1", 2, device="auto")))
    with pytest.raises(ConfigError) as e:
        run_module._check_launch(cfg, False, None)
    assert e.value.key == "pipeline.backend" and "nccl" in str(e.value)
    run_module._check_launch(load_config(write_config(tmp_path, run_doc("1f1b", 2, device="auto"))), False, None)
