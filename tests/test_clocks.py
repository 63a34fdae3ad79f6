"""Clocks (wall, rst, sim) in the training loop, and refusing runs that will not fit in memory.

Oracles: the rst reading is a pure function of the profile and the steps, so it must repeat
exactly; its value must equal an independent replay of the same action lists with the profile's
costs; and a run's predicted memory is checked against a hand computation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import run_cli, run_in_process, summary_of
from helpers.configs import make_config, write_config
from helpers.profiles import make_profile, unit

from paci_tune.schedule import Op, build
from paci_tune.schedule.replay import replay

# BASE_CONFIG's model: tiny preset, 2 blocks -> 4 units; micro-batch 2 (global batch 8, a=4).
N_UNITS, MB = 4, 2
FWD, BWD, OPT = 1e-3, 2e-3, 5e-4


def hand_profile(tmp_path: Path, saved: int = 5000) -> Path:
    path = tmp_path / "profile.yaml"
    units = [unit(FWD, BWD, mb=MB, saved=saved, opt=OPT) for _ in range(N_UNITS)]
    make_profile(units, p2p={"latency_s": 1e-4, "bandwidth_Bps": 1e9}, seq_len=32).save(path)
    return path


def rst_doc(tmp_path: Path, **training: object) -> dict:
    return make_config(
        training={"steps": 6, "eval_every": 3, "clock": "rst", "profile": str(hand_profile(tmp_path)), **training},
        pipeline={"schedule": "paci", "stages": 2, "window": 4, "partition": [2, 2]},
    )


def clock_readings(records: list[dict]) -> list[tuple[str, float]]:
    return [(r["event"], r["clock"]) for r in records if r["event"] in ("train", "eval", "summary")]


def test_rst_readings_repeat_exactly(tmp_path: Path) -> None:
    doc = rst_doc(tmp_path)
    first, second = clock_readings(run_in_process(doc)), clock_readings(run_in_process(doc))
    assert first == second
    assert all(t > 0 for _, t in first)


def test_rst_reading_is_the_replayed_schedule(tmp_path: Path) -> None:
    """One drained segment of 6 batches (evaluating never drains): it costs the makespan of replaying
    its action lists, and an evaluation reads when every stage has applied its batch."""
    records = run_in_process(rst_doc(tmp_path))
    lists = build("paci", 2, 4, 0, 6)
    cost = {Op.FORWARD: 2 * FWD, Op.BACKWARD: 2 * BWD, Op.STEP: 2 * OPT}
    act_bytes = 1000  # unit()'s activation bytes at the measured micro-batch size
    timeline = replay(lists, lambda s, a: cost[a.op], lambda src, dst, a: 1e-4 + act_bytes / 1e9)
    assert summary_of(records)["clock"] == pytest.approx(timeline.makespan, rel=1e-9)
    step_end = {(s, a.mb): end for s, st in enumerate(timeline.stages) for a, _, end in st.intervals if a.op is Op.STEP}
    evals = [r["clock"] for r in records if r["event"] == "eval"]
    assert evals == pytest.approx([max(step_end[(0, 2)], step_end[(1, 2)]), timeline.makespan], rel=1e-9)


def test_rst_time_budget_is_deterministic_and_respected(tmp_path: Path) -> None:
    doc = rst_doc(tmp_path, steps=None, seconds=0.1, eval_every=2)
    a, b = run_in_process(doc), run_in_process(doc)
    sa, sb = summary_of(a), summary_of(b)
    assert sa["steps"] == sb["steps"] >= 2
    assert sa["clock"] <= 0.1
    lrs = [r["lr"] for r in a if r["event"] == "train"]
    assert lrs == [r["lr"] for r in b if r["event"] == "train"]  # LR decays over the rst budget


@pytest.mark.slow
def test_rst_needs_a_profile(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, make_config(training={"clock": "rst"}))
    proc = run_cli(cfg)
    assert proc.returncode == 2
    assert "training.profile" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_profile_of_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.yaml"
    make_profile([unit(FWD, BWD, mb=MB) for _ in range(N_UNITS + 3)], seq_len=32).save(path)
    cfg = write_config(tmp_path, make_config(training={"clock": "rst", "profile": str(path)}))
    proc = run_cli(cfg)
    assert proc.returncode == 2 and "training.profile" in proc.stderr


@pytest.mark.slow
def test_run_that_cannot_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    """Each in-flight micro-batch pins 1 TiB by this profile: refused before training starts."""
    huge = hand_profile(tmp_path, saved=2**40)
    metrics = tmp_path / "m.jsonl"
    cfg = write_config(tmp_path, make_config(training={"profile": str(huge)}))
    proc = run_cli(cfg, "--metrics", metrics)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "pipeline.microbatch_size" in line and "predicted" in line and "GiB" in line
    assert not metrics.exists()


def test_wall_clock_runs_report_their_clock(tmp_path: Path) -> None:
    s = summary_of(run_in_process(make_config()))
    assert s["clock_name"] == "wall" and s["clock"] > 0


def test_evaluation_on_a_grid_of_the_rst_clock(tmp_path: Path) -> None:
    """With eval_every_seconds each evaluation is the first batch boundary at or past a grid point."""
    doc = rst_doc(tmp_path, steps=12, eval_every=1000)
    records = run_in_process(doc)
    per_batch = [r["clock"] for r in records if r["event"] == "train"]
    grid = per_batch[-1] / 3.5  # three grid points inside the run
    batch_time = per_batch[-1] / len(per_batch)
    doc["training"]["eval_every_seconds"] = grid
    records = run_in_process(doc)
    evals = [r["clock"] for r in records if r["event"] == "eval"]
    assert len(evals) == 4  # three grid points, then the final evaluation
    for k, t in enumerate(evals[:3], start=1):
        assert t >= k * grid - 1e-12
        assert t - k * grid < 3 * batch_time  # the batch that crosses it, plus the segment's drain
