"""Bad input ends ``paci-tune train`` with exit code 2 and one line naming key and value.

Never a traceback, and never a metrics file from a run that did not happen.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import check_error, run_cli
from helpers.configs import make_config, write_config


def _text_data(path: str) -> dict[str, Any]:
    doc = make_config()
    doc["data"] = {"source": "text", "path": path}
    return doc


# (id, config document or None for "no file", extra arguments, key, value as printed)
CASES: list[tuple[str, dict[str, Any] | None, list[str], str, str]] = [
    ("unknown-key", make_config(training={"stepz": 4}), [], "training.stepz", "4"),
    ("wrong-type", make_config(training={"steps": "ten"}), [], "training.steps", "ten"),
    ("too-many-stages", make_config(), ["--stages", "50"], "pipeline.stages", "50"),
    ("window-not-divisor", make_config(), ["--global-batch", "10", "--window", "4"], "pipeline.window", "4"),
    ("missing-data-file", _text_data("/nonexistent/corpus.txt"), [], "data.path", "/nonexistent/corpus.txt"),
    ("unknown-preset", make_config(model={"preset": "gpt5"}), [], "model.preset", "gpt5"),
    ("missing-config", None, [], "config", "missing.yaml"),
    ("resume-without-dir", make_config(), ["--resume"], "training.checkpoint_dir", "None"),
    ("bad-partition", make_config(pipeline={"partition": [1, 1]}), [], "pipeline.partition", "[1, 1]"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "doc", "args", "key", "value"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_emulated(tmp_path: Path, case: str, doc, args: list[str], key: str, value: str):
    config = tmp_path / "missing.yaml" if doc is None else write_config(tmp_path, doc)
    metrics = tmp_path / "metrics.jsonl"
    proc = run_cli(config, *args, "--metrics", metrics)
    check_error(proc, metrics, key, value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "args", "key", "value"),
    [
        ("too-many-stages", ["--stages", "50"], "pipeline.stages", "50"),
        ("resume-without-dir", ["--resume"], "training.checkpoint_dir", "None"),
    ],
)
def test_bad_input_distributed_is_caught_before_launch(tmp_path: Path, case: str, args, key: str, value: str):
    metrics = tmp_path / "metrics.jsonl"
    proc = run_cli(write_config(tmp_path, make_config()), "--runtime", "distributed", *args, "--metrics", metrics)
    check_error(proc, metrics, key, value)


@pytest.mark.slow
def test_nccl_on_cpu_is_caught_before_launch(tmp_path: Path):
    metrics = tmp_path / "metrics.jsonl"
    config = write_config(tmp_path, make_config(pipeline={"backend": "nccl"}))
    proc = run_cli(config, "--runtime", "distributed", "--metrics", metrics)
    check_error(proc, metrics, "pipeline.backend", "nccl")


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["emulated", pytest.param("distributed", marks=pytest.mark.slow)])
def test_cuda_requested_without_cuda(tmp_path: Path, runtime: str):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    metrics = tmp_path / "metrics.jsonl"
    config = write_config(tmp_path, make_config())
    proc = run_cli(config, "--runtime", runtime, "--device", "cuda", "--metrics", metrics)
    check_error(proc, metrics, "pipeline.device", "cuda")


@pytest.mark.slow
def test_bad_option_value_is_a_usage_error(tmp_path: Path):
    metrics = tmp_path / "metrics.jsonl"
    proc = run_cli(write_config(tmp_path, make_config()), "--steps", "ten", "--metrics", metrics)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"--steps.*ten", proc.stderr), proc.stderr
    assert not metrics.exists()


def test_errors_cross_a_process_boundary_whole() -> None:
    """A bench's process pool or a trial's child pickles the error: it must arrive with its fields, not as a
    TypeError from a constructor that Exception's default pickling calls with one argument."""
    import pickle

    from paci_tune.errors import ConfigError, Failure

    err = pickle.loads(pickle.dumps(ConfigError("lr_schedule.warmup", 0.3, "a key of the section")))
    assert (type(err), err.key, err.value, err.allowed) == (
        ConfigError,
        "lr_schedule.warmup",
        0.3,
        "a key of the section",
    )
    assert str(err) == "lr_schedule.warmup: got 0.3; allowed: a key of the section"
    fail = pickle.loads(pickle.dumps(Failure("writing best.yaml", "disk full")))
    assert (fail.what, fail.reason, str(fail)) == ("writing best.yaml", "disk full", "writing best.yaml: disk full")
