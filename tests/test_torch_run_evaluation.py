"""Evaluations of the schedules run through torch's classes, with more validation chunks than two ranks'
sends the transport leaves pending (its cap is 64 entries: 32 payloads a rank).

Interleaved 1F1B's forward path leaves rank P - 1 for rank 0: piece after piece, rank P - 1 waited on its
sends to rank 0 while rank 0 was still sending its first piece's chunks to rank 1, which waited on rank 2,
... a circle: at P = 2 the run hung at its first evaluation once the validation set had more than 64 chunks.

Oracle: paci-tune's own 1F1B runtime on the same config (every synchronous schedule is plain gradient
accumulation), whose validations at every evaluation the others must give to 1e-5; and the clock: a hang
is a timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import check_ok, read_metrics, run_cli
from helpers.configs import make_config, write_config

pytestmark = pytest.mark.slow  # torchrun processes

CHUNKS = 80  # validation chunks of one sequence: more than two ranks' 32 pending payloads each


def _validations(tmp_path: Path, schedule: str) -> list[float]:
    doc = make_config(
        training={
            "steps": 2,
            "global_batch": 8,
            "eval_every": 1,
            "eval_sequences": CHUNKS,
            "eval_microbatch_size": 1,
        },
        pipeline={"schedule": schedule, "stages": 2, "window": 4, "runtime": "distributed"},
    )
    metrics = tmp_path / f"{schedule}.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc, f"{schedule}.yaml"), "--metrics", metrics, timeout=240))
    return [r["val_loss"] for r in read_metrics(metrics) if r["event"] == "eval"]


@pytest.fixture(scope="module")
def want(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The oracle, paci-tune's own 1F1B runtime on the same config: one run for both schedules (the config
    does not depend on the schedule compared; it was trained once per test, the same run twice)."""
    return _validations(tmp_path_factory.mktemp("oracle"), "1f1b")


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_an_evaluation_of_more_chunks_than_the_transport_holds_ends_and_scores_as_1f1b(
    tmp_path: Path, want: list[float], schedule: str
) -> None:
    got = _validations(tmp_path, schedule)
    assert len(want) >= 2 and got == pytest.approx(want, abs=1e-5)
