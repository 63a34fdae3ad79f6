"""Locks between processes: one writer per checkpoint folder, one calibration per work folder's profile.

Oracles: another real process holding the lock (flock is per process: one test process cannot
stand for two); the refusal names that process's pid and host; the lock dies with its holder; a
second ``paci-tune train`` on a folder a first one trains into exits 2 before training; of two
processes that need one profile, one measures it (its log line) and the other waits and reads it
(the file it wrote is not written again).
"""

from __future__ import annotations

import errno
import fcntl
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import cli_command, cli_env, run_cli, run_in_process
from helpers.configs import make_config, write_config
from helpers.processes import kill_tree

from paci_tune.base import locks
from paci_tune.errors import ConfigError, Failure
from paci_tune.train import checkpoint

HOLD = textwrap.dedent(
    """
    import sys
    from paci_tune.base.locks import try_lock
    got = try_lock(sys.argv[1])
    print("held" if hasattr(got, "release") else "refused", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    """
)


def hold_in_child(path: Path) -> subprocess.Popen[str]:
    """Another process holding the lock at ``path`` until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


# ----------------------------------------------------------------------------------- the lock itself
def test_holder_is_named_and_the_lock_dies_with_it(tmp_path: Path):
    path = tmp_path / "x.lock"
    child = hold_in_child(path)
    try:
        got = locks.try_lock(path)
        assert isinstance(got, locks.Holder)
        assert (got.pid, got.host) == (child.pid, socket.gethostname())
        assert f"pid {child.pid} on host {socket.gethostname()}" in got.describe()
    finally:
        child.kill()  # SIGKILL: no clean-up runs, the kernel drops the flock with the process
        child.wait(timeout=30)
    got = locks.try_lock(path)
    assert isinstance(got, locks.Lock) and got.held
    assert locks.holder(path).pid == locks.Holder.me().pid
    again = locks.try_lock(path)  # re-entrant within one process
    assert again is got
    again.release()
    got.release()
    assert locks.holder(path) == locks.Holder(), "a released lock still names its holder"


def test_a_file_system_without_flock_runs_unlocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with checkpoint.hold(tmp_path / "ckpt") as lock:
        assert not lock.held


def test_waiting_says_whom_and_gives_up_after_the_timeout(tmp_path: Path):
    path = tmp_path / "p.lock"
    child = hold_in_child(path)
    told: list[locks.Holder] = []
    try:
        with pytest.raises(Failure) as e:
            locks.wait_lock(path, timeout_s=0.3, on_wait=told.append, poll_s=0.05)
        assert [h.pid for h in told] == [child.pid]
        assert f"pid {child.pid}" in str(e.value) and str(path) in str(e.value)
    finally:
        release(child)
    with locks.wait_lock(path, timeout_s=5) as lock:
        assert lock.held


# ------------------------------------------------------------------------------ checkpoint folders
def test_a_checkpoint_folder_held_by_another_process_is_refused(tmp_path: Path):
    root = tmp_path / "ckpt"
    doc = make_config(training={"steps": 2, "checkpoint_every": 1, "checkpoint_dir": str(root)})
    child = hold_in_child(root / checkpoint.LOCK)
    try:
        from paci_tune.config import load_run_config
        from paci_tune.train.run import check_outputs

        for refuse in (lambda: check_outputs(load_run_config(doc), None), lambda: run_in_process(doc)):
            with pytest.raises(ConfigError) as e:
                refuse()
            assert e.value.key == "training.checkpoint_dir" and e.value.value == str(root)
            assert f"pid {child.pid} on host {socket.gethostname()}" in str(e.value), str(e.value)
        assert not list(root.glob("batch_*")) and not (root / "LATEST").exists()
    finally:
        release(child)
    run_in_process(doc)  # free again
    assert (root / "LATEST").read_text().strip() == "batch_00000002"


def _start_long_run(tmp_path: Path, root: Path, *args: str) -> subprocess.Popen[str]:
    """A ``paci-tune train`` into ``root`` that trains far longer than the test; returned once it holds
    the folder and has written a checkpoint (so it is training, past every check)."""
    doc = make_config(training={"steps": 100_000, "checkpoint_every": 2, "keep_checkpoints": 1})
    config = write_config(tmp_path, doc, "long.yaml")
    proc = subprocess.Popen(
        cli_command(config, "--checkpoint-dir", root, *args),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (root / "LATEST").exists():
        if proc.poll() is not None:
            assert proc.stderr is not None
            pytest.fail(f"the first run ended (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "the first run wrote no checkpoint within 240 s"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["emulated", "distributed"])
def test_second_train_on_one_checkpoint_folder_exits_2_naming_the_first(tmp_path: Path, runtime: str):
    """The first run holds the folder -- under the distributed runtime its launcher does, for workers that
    therefore do not refuse each other (it trains and checkpoints) -- and the second is refused before training."""
    root = tmp_path / "ckpt"
    first = _start_long_run(tmp_path, root, "--runtime", runtime)
    try:
        assert locks.holder(root / checkpoint.LOCK).pid == first.pid  # the CLI process: the launcher
        metrics = tmp_path / "second.jsonl"
        second = run_cli(write_config(tmp_path, make_config()), "--checkpoint-dir", root, "--metrics", metrics)
        assert first.poll() is None, "the first run stopped"
    finally:
        kill_tree(first)
        assert first.stderr is not None
        first.stderr.close()
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in second.stderr and len(lines) == 1, second.stderr
    assert lines[0].startswith(f"error: training.checkpoint_dir: got '{root}'"), lines[0]
    assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0], lines[0]
    assert not metrics.exists()
    assert int((root / "LATEST").read_text().strip().removeprefix("batch_")) % 2 == 0  # the first's, untouched


# ------------------------------------------------------------------------------- profile calibration
CALIBRATE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from pathlib import Path
    from helpers.configs import make_config
    from paci_tune.calibrate.cache import measured_profile
    from paci_tune.config import load_run_config

    measured_profile(load_run_config(make_config()), microbatch_sizes=[2], path=Path(sys.argv[1]), log=print)
    print("done", flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_calibrating_one_work_folder_measure_once(tmp_path: Path):
    """The second starts while the first measures (its lock names it): it waits, then reads the first's profile."""
    profile = tmp_path / "work" / "profile.yaml"
    lock = profile.with_name(".profile.yaml.lock")

    def start() -> subprocess.Popen[str]:
        cmd = [sys.executable, "-c", CALIBRATE, str(profile)]
        out = subprocess.PIPE
        return subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, text=True)

    first = start()
    deadline = time.monotonic() + 120
    while not (lock.exists() and locks.holder(lock).pid == first.pid):
        assert first.poll() is None, first.stdout.read() if first.stdout else ""
        assert time.monotonic() < deadline, "the first process did not start measuring within 120 s"
        time.sleep(0.05)
    second = start()
    outs = [p.communicate(timeout=300)[0] for p in (first, second)]
    for p, out in zip((first, second), outs, strict=True):
        assert p.returncode == 0 and out.rstrip().endswith("done"), out[-3000:]
    measured = [out.count("measuring the model once") for out in outs]
    assert measured == [1, 0], outs
    assert f"waiting for pid {first.pid} on host {socket.gethostname()}" in outs[1], outs[1]
    assert profile.is_file()
