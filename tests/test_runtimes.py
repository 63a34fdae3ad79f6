"""Emulated and distributed runtimes: same local action order, so the same numbers.

Every run goes through the command line in a subprocess: ``paci-tune train`` for both runtimes,
and a hand-made two-"node" torchrun launch of ``paci_tune.worker`` on the loopback interface.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO
from helpers.cli import check_ok, cli_command, cli_env, read_metrics, run_cli, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.processes import descendants, free_port, kill_all, survivors_after

pytestmark = pytest.mark.slow

# P=2 with a window of 4 (drift bound 1 at stage 0), P=3 with a window of 1 (bounds 2, 1, 0);
# evaluation at step 4 cuts each run into two drained segments.
RUNS: dict[int, dict[str, Any]] = {
    2: make_config(training={"steps": 8, "eval_every": 4}, pipeline={"schedule": "paci", "stages": 2, "window": 4}),
    3: make_config(training={"steps": 8, "eval_every": 4}, pipeline={"schedule": "paci", "stages": 3, "window": 1}),
}

SUMMARY_KEYS = {
    "tokens_per_s",
    "bubble_fraction",
    "max_drift",
    "peak_memory_bytes",
    "final_val_loss",
    "train_loss",
    "stages",
    "steps",
    "runtime",
    "schedule",
}
STAGE_KEYS = {
    "stage",
    "busy_s",
    "idle_s",
    "bubble_fraction",
    "updates",
    "max_drift",
    "mean_drift",
    "drift_bound",
}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    """The emulated runs of RUNS, through the CLI, once for the module."""
    out = {}
    for p, doc in RUNS.items():
        d = tmp_path_factory.mktemp(f"emulated{p}")
        proc = run_cli(write_config(d, doc), "--runtime", "emulated", "--metrics", d / "m.jsonl")
        check_ok(proc)
        out[p] = read_metrics(d / "m.jsonl")
    return out


def assert_same_numbers(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert train_losses(got) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
    evals = [(r["step"], r["val_loss"]) for r in got if r["event"] == "eval"]
    want_evals = [(r["step"], r["val_loss"]) for r in want if r["event"] == "eval"]
    assert [s for s, _ in evals] == [s for s, _ in want_evals] == [4, 8]
    assert [v for _, v in evals] == pytest.approx([v for _, v in want_evals], abs=1e-5, rel=0)
    assert summary_of(got)["final_val_loss"] == pytest.approx(summary_of(want)["final_val_loss"], abs=1e-5, rel=0)


def assert_drift_and_summary(records: list[dict[str, Any]], doc: dict[str, Any], runtime: str) -> None:
    p, a = doc["pipeline"]["stages"], doc["pipeline"]["window"]
    summary = summary_of(records)
    assert summary.keys() >= SUMMARY_KEYS, SUMMARY_KEYS - summary.keys()
    assert summary["runtime"] == runtime and summary["steps"] == doc["training"]["steps"]
    assert [st["stage"] for st in summary["stages"]] == list(range(p))
    for st in summary["stages"]:
        assert st.keys() >= STAGE_KEYS, STAGE_KEYS - st.keys()
        bound = math.ceil((p - st["stage"] - 1) / a)
        assert st["drift_bound"] == bound
        assert st["max_drift"] == bound, f"stage {st['stage']}: drift {st['max_drift']}, bound {bound}"
        assert st["updates"] == doc["training"]["steps"]
        assert 0.0 <= st["bubble_fraction"] <= 1.0
    assert summary["max_drift"] == math.ceil((p - 1) / a)


@pytest.mark.parametrize("stages", [2, 3])
def test_distributed_equals_emulated(tmp_path: Path, emulated, stages: int):
    doc = RUNS[stages]
    metrics = tmp_path / "m.jsonl"
    proc = run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics)
    check_ok(proc)
    got = read_metrics(metrics)
    assert_same_numbers(got, emulated[stages])
    assert_drift_and_summary(got, doc, "distributed")
    assert_drift_and_summary(emulated[stages], doc, "emulated")


def test_two_node_torchrun_launch_equals_emulated(tmp_path: Path, emulated):
    doc = RUNS[2]
    config, metrics = write_config(tmp_path, doc), tmp_path / "m.jsonl"
    port = free_port()
    env = dict(cli_env(), OMP_NUM_THREADS="1")
    procs = []
    try:
        for rank in (0, 1):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "-m",
                "paci_tune.worker",
                str(config),
                "--metrics",
                str(metrics),
            ]
            log = open(tmp_path / f"node{rank}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log))
        codes = [p.wait(timeout=240) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join((tmp_path / f"node{r}.log").read_text()[-2000:] for r in (0, 1))
    assert codes == [0, 0], logs
    got = read_metrics(metrics)
    assert_same_numbers(got, emulated[2])
    assert_drift_and_summary(got, doc, "distributed")


def test_killing_the_launcher_takes_the_workers_down(tmp_path: Path):
    """SIGKILL to ``paci-tune train --runtime distributed``'s process group (an OOM kill, a CI
    timeout, ``kill -9 -PGID``) must not leave torchrun and its workers training on in the
    background, writing checkpoints and a metrics file for a run the user believes is dead."""
    doc = make_config(training={"steps": 100_000, "eval_every": 100_000, "checkpoint_every": 5})
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    cmd = cli_command(
        write_config(tmp_path, doc), "--runtime", "distributed", "--checkpoint-dir", ckpt, "--metrics", metrics
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "LATEST").exists():  # the workers are up and training
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.05)
        tree = descendants(proc.pid)
        assert tree, "the launcher has no child processes"
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        survivors = survivors_after(tree, 15)  # generous: a parent-death signal or a watchdog acts within seconds
    finally:
        kill_all(tree)
    assert not survivors, f"{len(survivors)} torchrun/worker processes outlived the killed launcher"
