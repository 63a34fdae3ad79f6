"""Live metrics: ``--log`` sinks on ``train`` and ``apply``, and a metrics file written as the records come.

Oracles: the run's JSON lines (read with plain ``json``) are the independent record; TensorBoard's event
files are read back with TensorBoard's own ``EventAccumulator``; W&B and MLflow are stand-in modules that
record the calls (tests/helpers/live.py), as neither is a test dependency. A killed run's file is read
while the run still goes, then after a SIGKILL; its resume must hold every step once, in the file and in
TensorBoard alike.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import check_ok, cli_command, cli_env, invoke_in, read_metrics, run_cli, summary_of, train_losses
from helpers.configs import make_config, write_best_for, write_config
from helpers.live import (
    Calls,
    assert_tensorboard_matches,
    event_files,
    fake_mlflow,
    fake_wandb,
    series,
)
from helpers.processes import kill_tree

SECRET = "s3cr3t-token-0451"
ALLOWED = "allowed: tensorboard:DIR, wandb:PROJECT or mlflow:EXPERIMENT"
SHORT = make_config(training={"steps": 6, "eval_every": 2, "checkpoint_every": 3})  # two segments, three evals


# ------------------------------------------------------------------------------ refused before any work
@pytest.mark.parametrize("value", ["tensorboard", "tensorboard:", "neptune:proj", ":runs", "wandb: "])
def test_a_malformed_log_value_exits_2_naming_what_is_allowed(tmp_path: Path, value: str) -> None:
    write_config(tmp_path, SHORT)
    r = invoke_in(tmp_path, ["train", "run.yaml", "--no-live", "--metrics", "m.jsonl", "--log", value])
    assert r.exit_code == 2, r.output
    assert f"error: --log: got {value!r}; {ALLOWED}" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("command", ["train", "apply"])
@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_missing_backend_package_exits_2_naming_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, command: str
) -> None:
    monkeypatch.setitem(sys.modules, backend, None)  # not importable here, whether installed or not
    target = write_config(tmp_path, SHORT).name if command == "train" else write_best_for(tmp_path, SHORT).name
    before = sorted(p.name for p in tmp_path.iterdir())
    r = invoke_in(tmp_path, [command, target, "--no-live", "--metrics", "m.jsonl", "--log", f"{backend}:proj"])
    assert r.exit_code == 2, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("error:"))
    assert line.startswith(f"error: --log: got '{backend}:proj'"), line
    assert f"pip install 'paci-tune[{backend}]'" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused run wrote something"


# --------------------------------------------------------------------------- what each backend is sent
def test_wandb_and_mlflow_get_each_records_scalars_at_its_step_and_no_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from paci_tune.config import load_run_config
    from paci_tune.train.run import resolve_run, run_training
    from paci_tune.train.sinks import parse_sinks

    calls = Calls()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    root, tracking = fake_mlflow(calls)
    monkeypatch.setitem(sys.modules, "mlflow", root)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", tracking)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://user:{SECRET}@mlflow.example")
    metrics = tmp_path / "m.jsonl"
    records: list[dict] = []
    run = resolve_run(load_run_config(make_config(training={"steps": 4, "eval_every": 2})))
    run_training(run, on_record=records.append, metrics=str(metrics), sinks=parse_sinks(["wandb:proj", "mlflow:exp"]))
    assert read_metrics(metrics) == records  # the file holds exactly what was emitted, in order

    (_, init), *more = calls.of("wandb", "init")
    assert not more and init["project"] == "proj" and init["config"]["schedule"] == "paci"
    assert (("*",), {"step_metric": "step"}) in calls.of("wandb", "define_metric")
    wandb: dict[str, list[tuple[int, float]]] = {}
    for (logged,), _ in calls.of("wandb", "log"):
        values = dict(logged)
        step = values.pop("step")
        for name, value in values.items():
            wandb.setdefault(name, []).append((step, value))
    mlflow: dict[str, list[tuple[int, float]]] = {}
    for (run_id, name, value), kw in calls.of("mlflow", "log_metric"):
        assert run_id == "r1"
        mlflow.setdefault(name, []).append((kw["step"], value))
    for got in (wandb, mlflow):
        assert sorted(got["train/loss"]) == series(records, "train", "loss")
        assert sorted(got["train/lr"]) == series(records, "train", "lr")
        assert sorted(got["val/loss"]) == series(records, "eval", "val_loss")
        assert sorted(got["perf/max_drift"]) == series(records, "segment", "max_drift")
    assert len(calls.of("wandb", "finish")) == 1 and calls.of("mlflow", "set_terminated") == [(("r1",), {})]

    out = capfd.readouterr()
    for text in (repr(calls.log), metrics.read_text(), out.out, out.err):
        assert SECRET not in text


def test_a_sink_that_fails_is_dropped_with_one_line_quoting_no_credential(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tracking server going away must not end a multi-hour run, nor print its URL's password."""
    from paci_tune.train.sinks import LiveSinks, parse_sinks

    calls = Calls()
    failure = ConnectionError(f"POST https://user:{SECRET}@wandb.example/graphql: refused")
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls, fail_on_log=failure))
    live = LiveSinks(parse_sinks(["wandb:proj"]))
    live.record({"event": "start", "resumed_at": 0, "schedule": "paci"})
    for step in (1, 2, 3):
        live.record({"event": "train", "step": step, "loss": 1.0, "lr": 0.1})
    live.close()
    err = capsys.readouterr().err
    assert err.count("warning: --log wandb:proj stopped (ConnectionError)") == 1, err
    assert SECRET not in err and len(calls.of("wandb", "finish")) == 1


# ------------------------------------------------------------------------------------ apply passes it on
def test_apply_passes_log_through_to_the_training_it_runs(tmp_path: Path) -> None:
    write_best_for(tmp_path, make_config(training={"steps": 2, "eval_every": 1}))
    dry = invoke_in(tmp_path, ["apply", "best.yaml", "--dry-run", "--clock", "wall", "--log", "tensorboard:tb"])
    assert dry.exit_code == 0, dry.output
    train = next(ln for ln in dry.output.splitlines() if ln.startswith("paci-tune train "))
    assert train.endswith("--log tensorboard:tb"), train

    args = ["apply", "best.yaml", "--no-live", "--clock", "wall", "--metrics", "m.jsonl", "--log", "tensorboard:tb"]
    r = invoke_in(tmp_path, args)
    assert r.exit_code == 0, r.output
    assert len(event_files(tmp_path / "tb")) == 1
    assert_tensorboard_matches(tmp_path / "tb", read_metrics(tmp_path / "m.jsonl"))


# ------------------------------------------------------------------------------------ real train runs
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["emulated", "distributed"])
def test_train_logs_to_tensorboard_what_its_metrics_file_holds(tmp_path: Path, runtime: str) -> None:
    """Loss per step, LR, validation loss and the segment figures, from the reporting rank alone."""
    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    config = write_config(tmp_path, SHORT)
    proc = run_cli(
        config,
        "--runtime",
        runtime,
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--metrics",
        metrics,
        "--log",
        f"tensorboard:{tb}",
    )
    check_ok(proc)
    records = read_metrics(metrics)
    assert len(train_losses(records)) == 6 and len(series(records, "eval", "val_loss")) == 3
    files = event_files(tb)
    assert len(files) == 1, f"one writer (the reporting rank), got {[f.name for f in files]}"
    assert_tensorboard_matches(tb, records)


LONG = make_config(
    training={"steps": 30, "eval_every": 10, "checkpoint_every": 5, "keep_checkpoints": 1},
    pipeline={"schedule": "paci", "stages": 2, "window": 4},
)


@pytest.mark.slow
def test_a_killed_run_leaves_its_records_and_its_resume_holds_each_step_once(tmp_path: Path) -> None:
    """The metrics file holds the first records while the run goes; SIGKILLed, every line it holds parses,
    steps 1..k in order; resumed into the same file and TensorBoard folder, each step is there once."""
    config, ckpt, metrics, tb = write_config(tmp_path, LONG), tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "tb"
    args = ("--checkpoint-dir", ckpt, "--metrics", metrics, "--log", f"tensorboard:{tb}")
    proc = subprocess.Popen(
        cli_command(config, *args),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while '"event": "checkpoint"' not in (text := metrics.read_text() if metrics.is_file() else ""):
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit {proc.returncode}) with no checkpoint record in its metrics file")
            assert time.monotonic() < deadline, "no checkpoint record within 180 s"
            time.sleep(0.005)
        assert '"event": "summary"' not in text, "the metrics file was written only once the run had ended"
        assert proc.poll() is None
    finally:
        kill_tree(proc)
        assert proc.stderr is not None
        proc.stderr.close()
    assert proc.returncode == -9, "the run finished before it could be killed: make it longer"
    killed = read_metrics(metrics)  # every line is a whole record
    assert killed[0]["event"] == "start" and killed[0]["resumed_at"] == 0
    steps = [r["step"] for r in killed if r["event"] == "train"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert "summary" not in {r["event"] for r in killed}
    batch = int((ckpt / "LATEST").read_text().strip().removeprefix("batch_"))

    check_ok(run_cli(config, *args, "--resume"))
    got = read_metrics(metrics)
    assert [r["resumed_at"] for r in got if r["event"] == "start"] == [0, batch]
    assert len(train_losses(got)) == 30  # steps 1..30, each once
    assert [s for s, _ in series(got, "eval", "val_loss")] == [10, 20, 30]
    summary_of(got)
    assert len(event_files(tb)) == 2  # the killed run's writer and the resumed one's, which purges past its checkpoint
    assert_tensorboard_matches(tb, got)
