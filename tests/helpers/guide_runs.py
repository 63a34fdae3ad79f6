"""The guide's models (helpers.guide_models) as the tests run them: a run document at the tests' size,
plain training as the oracle, and the distributed runtime through the CLI. Shared by the frozen,
tied and simulated-tie tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO
from helpers.cli import check_ok, cli_env, read_metrics, summary_of, train_losses
from helpers.configs import write_config
from helpers.guide_models import PYTHONPATH, SMALL
from helpers.oracles import CONSTANT_LR, numerics_doc, plain_training


def model(entry: str = "build_frozen", **kwargs: Any) -> dict[str, Any]:
    """``model:`` naming one of the guide's models at the tests' size."""
    return {"entry": f"helpers.guide_models:{entry}", "kwargs": {**SMALL, **kwargs}, "block_size": SMALL["block_size"]}


def doc_for(schedule: str, partition: list[int], steps: int = 4, entry: str = "build_frozen", **kw: Any) -> dict:
    """numerics_doc's run (constant LR, a = 4) of a guide model cut as ``partition``."""
    pipeline = {k: kw.pop(k) for k in ("precision", "data_parallel", "window") if k in kw}
    doc = numerics_doc(schedule, len(partition), CONSTANT_LR, partition=partition, **pipeline)
    doc["training"]["steps"] = steps
    doc["model"] = model(entry, **kw)
    return doc


def assert_plain(doc: dict[str, Any], records: list[dict[str, Any]]) -> float:
    """The run's losses and final validation loss equal plain training's; the largest loss difference."""
    want, want_val, _ = plain_training(doc)
    got = train_losses(records)
    assert got == pytest.approx(want, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)
    return max(abs(g - w) for g, w in zip(got, want, strict=True))


def guide_env() -> dict[str, str]:
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHONPATH, env.get("PYTHONPATH")) if p)
    return env


def run_distributed(tmp_path: Path, doc: dict[str, Any]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paci_tune.cli",
            "train",
            str(write_config(tmp_path, doc)),
            "--no-live",
            "--runtime",
            "distributed",
            "--metrics",
            str(tmp_path / "m.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=guide_env(),
        check=False,
    )
    check_ok(proc)
    return read_metrics(tmp_path / "m.jsonl")
