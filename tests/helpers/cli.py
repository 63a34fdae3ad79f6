"""Running paci-tune as the tests do: ``train`` in a subprocess or in this process, any command through
click's runner, and reading back what a run wrote (metrics records, its exit and its error line).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import REPO

_SCRATCH: list[Path] = []


def set_scratch(folder: Path) -> None:
    """Where the subprocesses put their temporary files from now on (tests/conftest.py: under pytest's tmp)."""
    _SCRATCH[:] = [folder]


def cpu_threads() -> str:
    """The threads a test's subprocess gets: the CPUs this test process may use (its affinity mask)."""
    from paci_tune.base.processes import cpu_count

    return str(cpu_count())


def cli_env() -> dict[str, str]:
    """The environment of a CLI subprocess: its thread count, unbuffered output, the tests' scratch TMPDIR."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", cpu_threads())
    env["PYTHONUNBUFFERED"] = "1"
    if _SCRATCH:
        env["TMPDIR"] = str(_SCRATCH[0])
    return env


def cli_command(*args: str | Path) -> list[str]:
    """The argv of ``paci-tune train ARGS --no-live``."""
    return [sys.executable, "-m", "paci_tune.cli", "train", *map(str, args), "--no-live"]


def run_cli(*args: str | Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``paci-tune train ARGS --no-live`` in a subprocess; its output captured as text."""
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=cli_env(), check=False
    )


def check_ok(proc: subprocess.CompletedProcess[str]) -> None:
    """The process exited 0; else the assertion shows the tail of its output."""
    out = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}"


def check_error(proc: Any, metrics: Path, key: str, value: str) -> None:
    """Refused input: exit 2, one ``error: KEY: got VALUE; allowed: ...`` line, no traceback, no metrics file."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith(f"error: {key}: got "), line
    assert value in line and "; allowed: " in line, line
    assert not metrics.exists(), "a failed run left a metrics file behind"


def invoke_in(folder: Path, args: list[str]) -> Any:
    """``paci-tune ARGS`` through click's runner with ``folder`` as the current directory."""
    from click.testing import CliRunner

    from paci_tune.cli import main

    old = Path.cwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        os.chdir(old)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records: list[dict[str, Any]]) -> list[float]:
    """Per-global-batch train losses in step order; checks that every step 1..N appears once."""
    train = sorted((r for r in records if r.get("event") == "train"), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)), "train records are not steps 1..N"
    return [r["loss"] for r in train]


def summary_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's one summary record, which must be its last."""
    summaries = [r for r in records if r.get("event") == "summary"]
    assert len(summaries) == 1, f"expected one summary record, got {len(summaries)}"
    assert records[-1] is summaries[0], "the summary must be the last record"
    return summaries[0]


def run_in_process(doc: dict[str, Any], *, resume: bool = False) -> list[dict[str, Any]]:
    """Run the emulated trainer in this process; return every record it emitted."""
    from paci_tune.config import load_run_config
    from paci_tune.train.loop import Trainer
    from paci_tune.train.metrics import RecordSink
    from paci_tune.train.run import resolve_run

    cfg = load_run_config(copy.deepcopy(doc))
    sink = RecordSink()
    Trainer(resolve_run(cfg), sink).run(resume=resume)
    return list(sink.records)
