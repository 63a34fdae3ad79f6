"""Shared helpers for the trainer tests: tiny run configs, running the CLI, reading metrics."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# A model and data small enough that a training step takes milliseconds on a 2-core CPU.
# Every hyper-parameter the oracles use is spelled out, so no test depends on a default.
BASE_CONFIG: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32},
    "data": {"source": "synthetic", "vocab_size": 64, "branching": 4, "n_train": 50_000, "n_val": 5_000},
    "training": {"global_batch": 8, "steps": 6, "seed": 0, "eval_every": 1000, "eval_sequences": 4},
    "optimizer": {"name": "adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 1.0, "scaling": "none"},
    "pipeline": {"schedule": "paci", "stages": 2, "window": 4, "runtime": "emulated", "device": "cpu"},
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (section by section)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """BASE_CONFIG with some keys of some sections replaced: ``make_config(training={"steps": 3})``."""
    return merge(BASE_CONFIG, sections)


def write_config(directory: Path, doc: dict[str, Any], name: str = "run.yaml") -> Path:
    path = Path(directory) / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


_SCRATCH: list[Path] = []


# ------------------------------------------------------------------ tests side by side (pytest-xdist)
# Side by side (``-n auto``, opt-in) the suite runs one worker per CPU, each pinned to its own CPUs: the affinity
# mask its children inherit, by which paci-tune sizes its thread counts, so the trainers, ranks and
# trials of two tests side by side never oversubscribe a core (unpinned, two workers of 2-thread
# trainers on 2 cores spent 40 % more CPU time than one worker and finished no sooner). Two markers
# give a test more: ``whole_machine`` -- every CPU, shared with the other worker (a wall-clock run
# of several devices needs a core each); ``alone`` -- every CPU and no other test beside it (it
# compares timings of this machine). For ``alone``, every other test holds a shared lock on one
# file and the ``alone`` one an exclusive lock; a turnstile taken before either keeps a waiting
# ``alone`` test from being starved by a stream of shared ones.

_ALL_CPUS: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None or not hasattr(os, "sched_setaffinity"):
        return
    _ALL_CPUS[:] = sorted(os.sched_getaffinity(0))
    mine = _ALL_CPUS[int(worker.removeprefix("gw")) % int(count) :: int(count)]
    if mine:
        _pin(mine)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Side by side, modules go to the workers in this order (``--no-loadscope-reorder`` keeps it):
    those holding an ``alone`` test, then for each other worker the module of quick tests with the
    most of them, then those with a ``slow`` test, then the rest. An ``alone`` module waits for the
    test beside it to end, its own CPU idle meanwhile: beside a quick module that is a second; beside
    a slow one it was 81 s (a bench's quick mode), late in the run a docs check of 90 s. And long
    modules early leave the short ones to even out the workers' ends. Serially the order is pytest's own."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return

    def modules(marker: str) -> set[Any]:
        return {item.module for item in items if item.get_closest_marker(marker) is not None}

    alone, slow = modules("alone"), modules("slow")
    sizes: dict[Any, int] = {}
    for item in items:
        if item.module not in alone | slow:
            sizes[item.module] = sizes.get(item.module, 0) + 1
    others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
    beside = set(sorted(sizes, key=sizes.__getitem__, reverse=True)[:others]) if alone else set()
    items.sort(key=lambda item: (item.module not in alone, item.module not in beside, item.module not in slow))


def _pin(cpus: list[int]) -> None:
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


@contextlib.contextmanager
def machine(config: pytest.Config, *, alone: bool, whole: bool = True) -> Iterator[None]:
    """Hold the machine: shared (``alone=False``) or to this test alone, among the xdist workers of
    this run, on every CPU (``whole``) or this worker's own. A no-op without xdist. Never nest two
    holds in one process (flock would deadlock)."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        yield
        return
    root = Path(tempfile.gettempdir()) / f"paci-tune-tests-{worker['testrunuid']}"
    root.mkdir(exist_ok=True)
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    with open(root / "turnstile", "a") as turn, open(root / "machine", "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            if whole and _ALL_CPUS and own != _ALL_CPUS:
                _pin(_ALL_CPUS)
            yield
        finally:
            if whole and own and own != _ALL_CPUS:
                _pin(own)
            fcntl.flock(lock, fcntl.LOCK_UN)


_MODULE_ALONE: list[bool] = []


@pytest.fixture(scope="module", autouse=True)
def _machine_of_this_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module with an ``alone`` test holds the machine alone from its first test to its last, its
    module fixtures included (a calibration is a timing too). Held test by test, the worker beside
    slipped a test of its own in between, and the next ``alone`` test waited for it (38 s measured)."""
    here = [item for item in request.session.items if item.module is request.module]
    if not any(item.get_closest_marker("alone") is not None for item in here):
        yield
        return
    with machine(request.config, alone=True):
        _MODULE_ALONE.append(True)
        try:
            yield
        finally:
            _MODULE_ALONE.clear()


@pytest.fixture(autouse=True)
def _cpus_of_this_test(request: pytest.FixtureRequest) -> Iterator[None]:
    if _MODULE_ALONE:  # the module holds every CPU to itself already
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    whole = alone or request.node.get_closest_marker("whole_machine") is not None
    with machine(request.config, alone=alone, whole=whole):
        yield


def cpu_threads() -> str:
    """The threads a test's subprocess gets: the CPUs this test process may use (its affinity mask)."""
    from paci_tune.base.processes import cpu_count

    return str(cpu_count())


@pytest.fixture(scope="session", autouse=True)
def _scratch_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Subprocesses put their temporary files (the launcher's work folder, torchrun's) under pytest's tmp."""
    _SCRATCH.append(tmp_path_factory.mktemp("subprocess-tmp"))


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", cpu_threads())
    env["PYTHONUNBUFFERED"] = "1"
    if _SCRATCH:
        env["TMPDIR"] = str(_SCRATCH[0])
    return env


def cli_command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "paci_tune.cli", "train", *map(str, args), "--no-live"]


def run_cli(*args: str | Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``paci-tune train ARGS --no-live`` in a subprocess; its output captured as text."""
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=cli_env(), check=False
    )


def check_ok(proc: subprocess.CompletedProcess[str]) -> None:
    out = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records: list[dict[str, Any]]) -> list[float]:
    """Per-global-batch train losses in step order; checks that every step 1..N appears once."""
    train = sorted((r for r in records if r.get("event") == "train"), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)), "train records are not steps 1..N"
    return [r["loss"] for r in train]


def summary_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    summaries = [r for r in records if r.get("event") == "summary"]
    assert len(summaries) == 1, f"expected one summary record, got {len(summaries)}"
    assert records[-1] is summaries[0], "the summary must be the last record"
    return summaries[0]


def run_in_process(doc: dict[str, Any], *, resume: bool = False) -> list[dict[str, Any]]:
    """Run the emulated trainer in this process; return every record it emitted."""
    from paci_tune.config import load_run_config
    from paci_tune.train.loop import Trainer
    from paci_tune.train.metrics import RecordSink

    cfg = load_run_config(copy.deepcopy(doc))
    sink = RecordSink()
    Trainer(cfg, sink).run(resume=resume)
    return list(sink.records)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children before grandchildren."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan reaped by init disappears; a dead child of a live
    parent lingers as Z until waited for)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def survivors_after(pids: list[int], grace_s: float) -> list[int]:
    """The ``pids`` still alive after waiting up to ``grace_s`` for them all to go."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def kill_all(pids: list[int]) -> None:
    """SIGKILL whichever of ``pids`` is still alive (a test's clean-up)."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process started with ``start_new_session=True``, its group and all its descendants."""
    pids = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
