"""A run under torchrun that records each rank's compute actions (:mod:`helpers.trace_worker`).

Shared by the tests that hold torch's schedule classes to their action lists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import REPO
from helpers.cli import check_ok, cli_env, read_metrics
from helpers.configs import write_config

TRACE_WORKER = REPO / "tests" / "helpers" / "trace_worker.py"


def traced_run(tmp_path: Path, doc: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """``doc`` trained by :mod:`helpers.trace_worker` under torchrun: its records and each rank's actions."""
    p = doc["pipeline"]
    n = p["stages"] * p.get("data_parallel", 1)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        str(TRACE_WORKER),
        str(write_config(tmp_path, doc)),
        str(tmp_path),
    ]
    env = dict(cli_env(), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False)
    check_ok(proc)
    traces = [json.loads((tmp_path / f"trace{r}.json").read_text()) for r in range(n)]
    return read_metrics(tmp_path / "m.jsonl"), traces
