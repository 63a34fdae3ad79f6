"""Checkpoints: a run SIGKILLed after a checkpoint and resumed gives the uninterrupted run's numbers."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO
from helpers.cli import check_ok, cli_command, cli_env, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.processes import kill_tree

STEPS, EVERY = 80, 10
DOC = make_config(
    training={"steps": STEPS, "eval_every": 40, "checkpoint_every": EVERY, "keep_checkpoints": 2},
    pipeline={"schedule": "paci", "stages": 2, "window": 4},
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict[str, Any]]:
    """The uninterrupted emulated run (it checkpoints too: checkpoints end segments, which PACI drains)."""
    d = tmp_path_factory.mktemp("reference")
    proc = run_cli(write_config(d, DOC), "--checkpoint-dir", d / "ckpt", "--metrics", d / "m.jsonl")
    check_ok(proc)
    kept = sorted(p.name for p in (d / "ckpt").glob("batch_*"))
    assert kept == [f"batch_{STEPS - EVERY:08d}", f"batch_{STEPS:08d}"], "keep_checkpoints=2 not honoured"
    return read_metrics(d / "m.jsonl")


def run_and_kill_after_first_checkpoint(config: Path, ckpt: Path, metrics: Path, *args: str) -> int:
    """Start the CLI, SIGKILL it (and everything it started) once LATEST exists; return the batch saved."""
    cmd = cli_command(config, "--checkpoint-dir", ckpt, "--metrics", metrics, *args)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "LATEST").exists():
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit {proc.returncode}) before a checkpoint: {proc.stderr.read()[-2000:]}")
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.005)
    finally:
        kill_tree(proc)
        proc.stderr.close()
    assert proc.returncode == -9, "the run finished before it could be killed: make it longer"
    saved = (ckpt / "LATEST").read_text().strip()
    folder = ckpt / saved
    assert (folder / "meta.json").is_file() and sorted(p.name for p in folder.glob("stage_*.pt")) == [
        "stage_0.pt",
        "stage_1.pt",
    ]
    killed = read_metrics(metrics)  # written as the records came: whole records up to the kill, no summary
    assert killed[0]["event"] == "start" and "summary" not in {r["event"] for r in killed}
    batch = int(saved.removeprefix("batch_"))
    assert 0 < batch < STEPS and batch % EVERY == 0
    return batch


def assert_same_run(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float) -> None:
    assert train_losses(got) == pytest.approx(train_losses(want), abs=tol, rel=0)
    evals = [(r["step"], r["val_loss"]) for r in got if r["event"] == "eval"]
    want_evals = [(r["step"], r["val_loss"]) for r in want if r["event"] == "eval"]
    assert [s for s, _ in evals] == [s for s, _ in want_evals]
    assert [v for _, v in evals] == pytest.approx([v for _, v in want_evals], abs=tol, rel=0)
    s, w = summary_of(got), summary_of(want)
    assert s["final_val_loss"] == pytest.approx(w["final_val_loss"], abs=tol, rel=0)
    assert s["steps"] == STEPS and s["max_drift"] == w["max_drift"]
    assert [st["updates"] for st in s["stages"]] == [STEPS, STEPS]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path: Path, reference):
    config, ckpt = write_config(tmp_path, DOC), tmp_path / "ckpt"
    batch = run_and_kill_after_first_checkpoint(config, ckpt, tmp_path / "killed.jsonl")

    metrics = tmp_path / "resumed.jsonl"
    proc = run_cli(config, "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics)
    check_ok(proc)
    got = read_metrics(metrics)
    starts = [r for r in got if r["event"] == "start"]
    assert [r["resumed_at"] for r in starts] == [0, batch]
    assert_same_run(got, reference, tol=1e-6)

    # resuming under a different numerics config is refused, and writes nothing
    refused = tmp_path / "refused.jsonl"
    proc = run_cli(config, "--checkpoint-dir", ckpt, "--resume", "--window", "2", "--metrics", refused)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --resume: got "), proc.stderr
    assert re.search(r"pipeline\.(window|microbatch_size)", lines[0]), lines[0]
    assert not refused.exists()


def test_resume_with_nothing_saved_starts_fresh(tmp_path: Path):
    doc = make_config(training={"steps": 6, "checkpoint_every": 3, "checkpoint_dir": str(tmp_path / "fresh")})
    fresh = run_in_process(doc)
    doc["training"]["checkpoint_dir"] = str(tmp_path / "empty")
    resumed = run_in_process(doc, resume=True)
    assert train_losses(resumed) == train_losses(fresh)
    assert summary_of(resumed)["final_val_loss"] == summary_of(fresh)["final_val_loss"]
    assert [r["resumed_at"] for r in resumed if r["event"] == "start"] == [0]


@pytest.mark.slow
def test_distributed_kill_and_resume_matches_emulated_run(tmp_path: Path, reference):
    config, ckpt = write_config(tmp_path, DOC), tmp_path / "ckpt"
    run_and_kill_after_first_checkpoint(config, ckpt, tmp_path / "killed.jsonl", "--runtime", "distributed")
    metrics = tmp_path / "resumed.jsonl"
    proc = run_cli(config, "--runtime", "distributed", "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics)
    check_ok(proc)
    assert_same_run(read_metrics(metrics), reference, tol=1e-5)
