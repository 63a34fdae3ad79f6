"""Reading back what ``--log`` wrote, and the JSON lines it must agree with (tests/test_live_metrics.py).

The oracle is the run's metrics file, written by another path (:class:`paci_tune.train.metrics.RecordSink`'s
file), read with plain ``json``; TensorBoard's event files are read with TensorBoard's own
``EventAccumulator``, not with paci-tune's or torch's writer code. Stand-in ``wandb`` and ``mlflow`` modules
record the calls a sink makes, for the machines where those packages are not installed.
"""

from __future__ import annotations

import copy
import importlib.machinery
import math
import types
from pathlib import Path
from typing import Any

import pytest

Series = dict[str, list[tuple[int, float]]]


def event_files(folder: Path) -> list[Path]:
    """TensorBoard event files under ``folder`` (one per writer: per process that opened the sink)."""
    return sorted(folder.rglob("events.out.tfevents.*"))


def tb_scalars(folder: Path) -> Series:
    """Every scalar series in ``folder``'s event files, as TensorBoard shows it: (step, value) in step order,
    steps a resumed writer purged left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event, no sampling
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def series(records: list[dict[str, Any]], event: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of one field of one kind of record, in step order."""
    return sorted((r["step"], float(r[key])) for r in records if r.get("event") == event)


def assert_same_series(got: list[tuple[int, float]], want: list[tuple[int, float]], name: str) -> None:
    """The same steps, each once, and the same values to float32 (TensorBoard stores scalars as float32)."""
    assert [s for s, _ in got] == [s for s, _ in want], f"{name}: steps differ"
    for (step, g), (_, w) in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-30) or (math.isnan(g) and math.isnan(w)), f"{name}@{step}"


def assert_tensorboard_matches(folder: Path, records: list[dict[str, Any]]) -> Series:
    """TensorBoard's loss per step, LR, validation loss and segment figures equal the JSON lines'; the series."""
    got = tb_scalars(folder)
    for tag, event, key in (
        ("train/loss", "train", "loss"),
        ("train/lr", "train", "lr"),
        ("val/loss", "eval", "val_loss"),
        ("perf/tokens_per_s", "segment", "tokens_per_s"),
        ("perf/bubble_fraction", "segment", "bubble_fraction"),
        ("perf/max_drift", "segment", "max_drift"),
    ):
        assert_same_series(got.get(tag, []), series(records, event, key), tag)
    summary = next(r for r in records if r.get("event") == "summary")
    assert got["summary/final_val_loss"] == [(summary["steps"], pytest.approx(summary["final_val_loss"], rel=1e-6))]
    assert [s for s, _ in got["memory/peak_bytes"]] == [s for s, _ in series(records, "segment", "tokens_per_s")]
    return got


# ------------------------------------------------------------------------------ stand-in clients
class Calls:
    """What the stand-in clients were asked: ``(client, method, args, kwargs)`` in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []

    def add(self, client: str, method: str, *args: Any, **kwargs: Any) -> None:
        self.log.append((client, method, args, copy.deepcopy(kwargs)))

    def of(self, client: str, method: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for c, m, a, k in self.log if (c, m) == (client, method)]


def fake_wandb(calls: Calls, fail_on_log: Exception | None = None) -> types.ModuleType:
    """A ``wandb`` module with ``init`` / ``Settings`` and a run's ``define_metric`` / ``log`` / ``finish``."""

    class Run:
        def define_metric(self, *a: Any, **k: Any) -> None:
            calls.add("wandb", "define_metric", *a, **k)

        def log(self, *a: Any, **k: Any) -> None:
            if fail_on_log is not None:
                raise fail_on_log
            calls.add("wandb", "log", *a, **k)

        def finish(self) -> None:
            calls.add("wandb", "finish")

    def init(**k: Any) -> Run:
        calls.add("wandb", "init", **{key: v for key, v in k.items() if key != "settings"})
        return Run()

    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # importlib.util.find_spec finds it
    mod.init = init  # type: ignore[attr-defined]
    mod.Settings = lambda **k: k  # type: ignore[attr-defined]
    return mod


def fake_mlflow(calls: Calls) -> tuple[types.ModuleType, types.ModuleType]:
    """``mlflow`` and ``mlflow.tracking`` with an ``MlflowClient`` of the methods the sink uses."""

    class Client:
        def get_experiment_by_name(self, name: str) -> None:
            calls.add("mlflow", "get_experiment_by_name", name)

        def create_experiment(self, name: str) -> str:
            calls.add("mlflow", "create_experiment", name)
            return "7"

        def create_run(self, experiment_id: str) -> Any:
            calls.add("mlflow", "create_run", experiment_id)
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

        def log_param(self, *a: Any) -> None:
            calls.add("mlflow", "log_param", *a)

        def log_metric(self, *a: Any, **k: Any) -> None:
            calls.add("mlflow", "log_metric", *a, **k)

        def set_terminated(self, run_id: str) -> None:
            calls.add("mlflow", "set_terminated", run_id)

    root, tracking = types.ModuleType("mlflow"), types.ModuleType("mlflow.tracking")
    root.__spec__ = importlib.machinery.ModuleSpec("mlflow", None, is_package=True)
    tracking.MlflowClient = Client  # type: ignore[attr-defined]
    root.tracking = tracking  # type: ignore[attr-defined]
    root.__path__ = []  # type: ignore[attr-defined] - a package: ``from mlflow.tracking import`` resolves
    return root, tracking
