"""Training runs of interleaved 1F1B and ZB-H1: 1F1B-flush's numbers, their own schedule's clock.

Oracles: the losses of a 1f1b run of the same (P, a, b), seed and data, and plain gradient
accumulation written from scratch (helpers/oracles.py); for the clock, the textbook makespan of one
flushed global batch on equal stages with free transfers, computed here by hand from the
schedules' bubbles -- 1F1B ``(m + P - 1)(F + B)``, interleaved ``v m (F_c + B_c) + (P - 1)(F_c + B_c)``,
ZB-H1 ``m (F + B + W) + (P - 1)(F + B - W)`` (Qi et al.), plus the optimizer step -- not the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.cli import check_error, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import merge, write_config
from helpers.oracles import CONSTANT_LR, numerics_doc, plain_training
from helpers.profiles import FREE, make_profile

from paci_tune.cli import main
from paci_tune.cli.ui import summary_table
from paci_tune.config.schema import TIMED_SCHEDULES
from paci_tune.schedule import NAMES, SYNCHRONOUS, schedule_of

MB = 2  # numerics_doc: global batch 8, window 4
F, B, B_IN, B_W, OPT = 1e-3, 2e-3, 1.2e-3, 0.8e-3, 5e-4  # per unit; the split measured, B_IN + B_W = B


def split_profile(tmp_path: Path) -> Path:
    """Four equal units (the test model's), their backward's split measured, free transfers."""
    cost = {
        "forward_s": F,
        "backward_s": B,
        "backward_input_s": B_IN,
        "backward_weight_s": B_W,
        "activation_bytes": 1000,
        "saved_bytes": 5000,
    }
    units = [{"param_bytes": 4000, "optimizer_s": OPT, "microbatch": {MB: cost}} for _ in range(4)]
    path = tmp_path / "profile.yaml"
    make_profile(units, p2p=FREE, seq_len=32).save(path)
    return path


def timed_doc(tmp_path: Path, schedule: str, **training: Any) -> dict[str, Any]:
    doc = numerics_doc(schedule, 2, CONSTANT_LR)
    return merge(doc, {"training": {"clock": "rst", "profile": str(split_profile(tmp_path)), **training}})


@pytest.fixture(scope="module")
def flush_losses(tmp_path_factory: pytest.TempPathFactory) -> Callable[[float | None], list[float]]:
    """1f1b's losses on the same doc, per ``optimizer.grad_clip``, trained once per module."""
    folder, seen = tmp_path_factory.mktemp("flush"), {}

    def losses(clip: float | None) -> list[float]:
        if clip not in seen:
            doc = timed_doc(folder, "1f1b")
            doc["optimizer"]["grad_clip"] = clip
            seen[clip] = train_losses(run_in_process(doc))
        return seen[clip]

    return losses


def test_every_timed_schedule_is_synchronous_and_runs_for_real_through_torch() -> None:
    """A timed schedule trains 1F1B-flush's numbers on the emulated runtime: right only for a synchronous
    one; and it must run for real somewhere, so it has torch's class on the distributed runtime."""
    assert set(TIMED_SCHEDULES) == {n for n in NAMES if not schedule_of(n).own_program}
    assert set(TIMED_SCHEDULES) <= set(SYNCHRONOUS)
    assert {"zb-h1", "interleaved", "zb-v", "dualpipev"} <= set(TIMED_SCHEDULES)
    assert all(schedule_of(n).runs_torch("distributed", False) for n in TIMED_SCHEDULES)


@pytest.mark.parametrize(
    ("schedule", "pipeline", "clip"),
    [
        ("zb-h1", {}, None),
        ("interleaved", {"chunks": 2, "partition": [1, 1, 1, 1]}, None),
        ("zb-h1", {}, 0.5),
        ("zb-v", {"partition": [1, 1, 1, 1]}, None),
        ("dualpipev", {}, None),
    ],
    ids=["zb-h1", "interleaved-pinned-cut", "zb-h1-clipped", "zb-v-pinned-cut", "dualpipev"],
)
def test_timed_schedules_train_flush_numbers(
    tmp_path: Path,
    flush_losses: Callable[[float | None], list[float]],
    schedule: str,
    pipeline: dict[str, Any],
    clip: float | None,
) -> None:
    """Same (P, a, b), seed and data: every loss equals 1f1b's bit for bit, and plain training's within
    1e-5 (clipped: the whole model's norm, as 1f1b clips it, with its clock's synchronised steps)."""
    doc = merge(timed_doc(tmp_path, schedule), {"pipeline": pipeline})
    doc["optimizer"]["grad_clip"] = clip
    records = run_in_process(doc)
    got = train_losses(records)
    assert len(got) == 8 and got == flush_losses(clip)
    if clip is None:
        plain, plain_val, _ = plain_training(doc)
        assert got == pytest.approx(plain, abs=1e-5, rel=0)
        assert summary_of(records)["final_val_loss"] == pytest.approx(plain_val, abs=1e-5, rel=0)


def _per_batch(schedule: str) -> float:
    """Textbook time of one flushed global batch on this profile's stages (module docstring)."""
    p, m, v = 2, 4, 2
    f, b, w, b_whole = 2 * F, 2 * B_IN, 2 * B_W, 2 * B  # a stage: two units
    step = 2 * OPT
    if schedule == "1f1b":
        return (m + p - 1) * (f + b_whole) + step
    if schedule == "zb-h1":
        return m * (f + b + w) + (p - 1) * (f + b - w) + step
    fc, bc = F, B  # interleaved: a chunk is one unit
    return v * m * (fc + bc) + (p - 1) * (fc + bc) + step


def test_a_budget_fits_the_batches_each_schedules_own_timeline_allows(tmp_path: Path) -> None:
    """rst clock, 0.2 s: 1F1B-flush fits 6 batches of 31 ms, interleaved 7 of 28 ms, ZB-H1 7 of 27.8 ms --
    each run's step count and clock are its own schedule's, from the textbook makespan per batch."""
    budget = 0.2
    got = {}
    for schedule in ("1f1b", "interleaved", "zb-h1"):
        summary = summary_of(run_in_process(timed_doc(tmp_path, schedule, steps=None, seconds=budget)))
        per_batch = _per_batch(schedule)
        assert summary["steps"] == math.floor(budget / per_batch)
        assert summary["clock"] == pytest.approx(summary["steps"] * per_batch, rel=1e-9)
        assert summary["clock_step_time_s"] == pytest.approx(per_batch, rel=1e-9)
        got[schedule] = summary["steps"]
    assert got == {"1f1b": 6, "interleaved": 7, "zb-h1": 7}


def test_records_name_the_schedule_and_its_cut(tmp_path: Path) -> None:
    records = run_in_process(timed_doc(tmp_path, "interleaved"))
    start, summary = records[0], summary_of(records)
    for rec in (start, summary):
        assert (rec["schedule"], rec["chunks"], rec["numerics_schedule"]) == ("interleaved", 2, "1f1b")
        assert rec["partition"] == [1, 1, 1, 1]  # v * P pieces, stage s holding pieces s and s + P
    assert summary["analytic_bubble_fraction"] == pytest.approx(1 / (2 * 4 + 1))
    assert len(summary["stages"]) == 2  # the runtime's stages (1F1B's numbers)
    caption = str(summary_table(summary).caption)  # what `paci-tune train` prints at the end
    assert "interleaved's bubble" in caption and "rst clock" in caption and "ran 1f1b's numbers" in caption
    zb = summary_of(run_in_process(timed_doc(tmp_path, "zb-h1")))
    f, b, w = 2 * F, 2 * B_IN, 2 * B_W
    assert (zb["schedule"], zb["chunks"], zb["numerics_schedule"]) == ("zb-h1", 1, "1f1b")
    assert zb["analytic_bubble_fraction"] == pytest.approx((f + b - w) / (4 * (f + b + w) + f + b - w))


REFUSED = [
    ("zb-h1-wall", {"training": {"clock": "wall"}}, "training.clock", "'wall'",
     "timed by the simulator on the sim/rst clocks"),
    ("interleaved-emulated-wall", {"pipeline": {"schedule": "interleaved"}, "training": {"clock": "wall"}},
     "training.clock", "'wall'", "runs for real with pipeline.runtime: distributed"),
    ("interleaved-one-chunk", {"pipeline": {"schedule": "interleaved", "chunks": 1}}, "pipeline.chunks", "1",
     "2 or more chunks"),
    ("interleaved-rounds", {"pipeline": {"schedule": "interleaved", "window": 5}, "training": {"global_batch": 10}},
     "pipeline.window", "5", "rounds"),
    ("interleaved-too-many-chunks", {"pipeline": {"schedule": "interleaved", "chunks": 3}}, "pipeline.chunks", "3",
     "at most 2"),
    ("interleaved-cut-per-stage", {"pipeline": {"schedule": "interleaved", "partition": [2, 2]}},
     "pipeline.partition", "[2, 2]", "4 positive unit counts"),
    ("chunks-without-interleaved", {"pipeline": {"chunks": 2}}, "pipeline.chunks", "2", "1 chunk(s) per stage"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "key", "value", "why"), REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_values_are_refused_naming_key_value_and_reason(
    tmp_path: Path, case: str, change: dict[str, Any], key: str, value: str, why: str
) -> None:
    config = write_config(tmp_path, merge(timed_doc(tmp_path, "zb-h1"), change))
    metrics = tmp_path / "m.jsonl"
    res = CliRunner().invoke(main, ["train", str(config), "--no-live", "--metrics", str(metrics)])
    proc = SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)
    check_error(proc, metrics, key, value)
    assert why in res.stderr


@pytest.mark.slow
def test_the_command_line_trains_zb_h1_on_the_rst_clock(tmp_path: Path) -> None:
    """``paci-tune train --schedule zb-h1`` in its own process; ``--clock wall`` refused there too."""
    config = write_config(tmp_path, timed_doc(tmp_path, "1f1b"))
    proc = run_cli(config, "--schedule", "zb-h1", "--metrics", tmp_path / "m.jsonl")
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = run_cli(config, "--schedule", "zb-h1", "--clock", "wall", "--metrics", tmp_path / "w.jsonl")
    check_error(refused, tmp_path / "w.jsonl", "training.clock", "'wall'")
