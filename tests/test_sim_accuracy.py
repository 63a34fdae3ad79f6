"""The simulator against the real thing: a calibrated profile predicts the distributed runtime.

``paci-tune train --clock rst --profile P`` reports both numbers for the very same segments: the
measured pipeline time (``pipeline_seconds``) and the simulated one (``clock``). How close they
are is a timing claim, so it lives in ``bench/sim_vs_measured.py`` (figures in
docs/benchmarks.md: 0.83-0.93 for paci at P=2 on a quiet 2-core machine, 0.73-0.83 on a loaded
CI runner). This test holds only what no machine's load can move: the prediction is of the same
order as the run it replays (within 2x), which a unit or thread-count mistake in calibration
(a profile timed on all cores, milliseconds read as seconds) breaks every time.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import check_ok, read_metrics, run_cli, summary_of
from helpers.configs import write_config
from helpers.processes import descendants

pytestmark = pytest.mark.slow

# Long enough to amortise the runtime's start-up: its first micro-batches run several times slower
# (fresh memory for the micro-batches in flight, the optimizer's first state), a one-off cost no
# per-step profile predicts -- ~100 ms per run here, 4% of a 16-step run (which read 0.86-0.94),
# 2% of this one (0.95-1.0).
STEPS = 32
# The tiny preset at its own sequence length (what examples/tiny-gpt.yaml trains), so units take
# milliseconds rather than the microseconds of the unit-test models, where fixed per-call costs
# would dominate; synthetic byte-sized tokens so no corpus is read.
DOC: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 4},
    "data": {"source": "synthetic", "vocab_size": 256, "branching": 4, "n_train": 200_000, "n_val": 10_000},
    "training": {"global_batch": 32, "steps": STEPS, "seed": 0, "eval_every": 1000, "eval_sequences": 2},
    "optimizer": {"name": "adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 1.0, "scaling": "none"},
    "pipeline": {"schedule": "paci", "stages": 2, "window": 4, "runtime": "distributed", "device": "cpu"},
}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, profile) with the profile calibrated once, in process, at the trained micro-batch size
    (with the machine to itself, as the runs it is compared with: the module holds it, tests/conftest.py)."""
    from paci_tune.calibrate import calibrate
    from paci_tune.config import load_config

    d = tmp_path_factory.mktemp("accuracy")
    config = write_config(d, DOC)
    cfg = load_config(config)
    t0 = time.perf_counter()
    profile = calibrate(cfg, microbatch_sizes=[cfg.pipeline.microbatch_size])
    print(f"calibration: {time.perf_counter() - t0:.1f} s")
    path = d / "profile.yaml"
    profile.save(path)
    return config, path


def _ratio(config: Path, profile: Path, schedule: str, metrics: Path) -> tuple[float, str]:
    """sim/measured step time of one distributed run, and a line describing it."""
    proc = run_cli(
        config,
        "--runtime",
        "distributed",
        "--stages",
        "2",
        "--schedule",
        schedule,
        "--steps",
        str(STEPS),
        "--eval-every",
        "1000",
        "--clock",
        "rst",
        "--profile",
        profile,
        "--metrics",
        metrics,
    )
    check_ok(proc)
    s = summary_of(read_metrics(metrics))
    measured, simulated = s["pipeline_seconds"] / s["steps"], s["clock"] / s["steps"]
    ratio = simulated / measured
    line = (
        f"{schedule}: measured {measured * 1e3:.1f} ms/step, simulated {simulated * 1e3:.1f} ms/step, "
        f"sim/measured {ratio:.3f}, measured bubble {s['bubble_fraction']:.3f}"
    )
    return ratio, line


@pytest.mark.alone
@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_simulated_step_time_same_order_as_measured(
    calibrated: tuple[Path, Path], schedule: str, tmp_path: Path
) -> None:
    """One run per schedule: the simulated step time is within a factor of 2 of the measured one."""
    config, profile = calibrated
    ratio, line = _ratio(config, profile, schedule, tmp_path / "m.jsonl")
    assert 0.5 <= ratio <= 2.0, line


def _timing_spec(**changes: Any) -> dict[str, Any]:
    from paci_tune.config import load_run_config

    cfg = load_run_config(copy.deepcopy(DOC))
    spec = {
        "model": cfg.model,
        "vocab_size": 256,
        "n_classes": 256,
        "seed": 0,
        "sizes": [2],
        "device": "cpu",
        "dtype": "fp32",
        "threads": 1,
        "window": 4,
        "inflight": 2,
        "repeats": 1,
        "warmup": 0,
        "optimizer": asdict(cfg.optimizer),
    }
    return {**spec, **changes}


@pytest.mark.parametrize(
    ("changes", "timeout", "error"),
    [
        ({"model": {"preset": "no-such-preset"}}, 120.0, "no-such-preset"),  # a child fails: its error is shown
        ({}, 0.2, "silent"),  # a child says nothing in time: treated as stuck
    ],
)
def test_co_run_failure_leaves_no_process(changes: dict[str, Any], timeout: float, error: str) -> None:
    """A failing or stuck timing process is an error naming why, and no child outlives the call."""
    from paci_tune.calibrate import co_run_pattern

    before = set(descendants(os.getpid()))
    with pytest.raises(RuntimeError, match=error):
        co_run_pattern(_timing_spec(**changes), 2, idle_timeout_s=timeout)
    assert set(descendants(os.getpid())) <= before
