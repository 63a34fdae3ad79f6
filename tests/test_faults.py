"""Faults injected into real processes and real storages; every case ends in "nothing lost".

The search cases kill the search (SIGKILL to its whole process group, mid-trial), its fork server, stop it
with Ctrl-C while two trials run side by side, restart the PostgreSQL server under it, or run two searches
on one work folder at once; each must end with the
result of an uninterrupted search of the same config (:func:`oracle`: best.yaml's recommendation and
verdict, each study's counted trials and finished points with their scores -- :func:`helpers.faults.
search_outcome`). The training cases kill one stage worker of a distributed run, fill the disk while a
checkpoint is written, and break a checkpoint (a truncated stage file, a ``LATEST`` naming a missing
folder); a resume must then train the losses of the uninterrupted run (:func:`reference`), or be refused
at once, naming the file.

Related, not repeated here: test_search.py's ``test_sigkill_mid_trial_then_resume`` (the killed search's
processes are all gone, finished trials unchanged), test_zygote.py (the fork server's own contract),
test_stage_death.py (the one-line error of a dead rank), test_postgres.py (two workers on PostgreSQL, the
server stopped for good), test_checkpoint.py (the whole launcher killed after a checkpoint).

Everything is tiny and on the simulator's clock (helpers.faults.tiny_search: about 10 s a search), the
oracles shared by the module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from helpers import REPO
from helpers.cli import check_ok, cli_command, read_metrics, run_cli, run_in_process, train_losses
from helpers.configs import NARROW_MODEL, make_config, merge, write_config
from helpers.faults import (
    err_of,
    fault_env,
    finish,
    fork_server_of,
    forked_trials,
    run_twice_at_once,
    search_outcome,
    sqlite_url,
    start,
    started_trials,
    tiny_search,
    wait_until,
)
from helpers.pg import Server, server
from helpers.processes import alive, descendants, kill_all, kill_tree, survivors_after
from helpers.searches import run, search_cmd, studies
from optuna.trial import TrialState

pytestmark = pytest.mark.slow  # every case starts processes: searches, trainings, a database server

SEARCH_S = 300.0  # a tiny search takes ~10 s alone on 2 cores; the bound is for a loaded CI machine
DEATH_BOUND_S = 60.0  # a run whose stage worker died must have ended by then (test_stage_death: 30 s, unloaded)
REFUSAL_BOUND_S = 30.0  # a broken checkpoint is refused before any training: the process's start-up only


# ------------------------------------------------------------------------------------------ searches
@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted search every search case must end at."""
    tmp = tmp_path_factory.mktemp("oracle")
    check_ok(run(search_cmd(tiny_search(tmp), tmp), timeout=SEARCH_S))
    return search_outcome(tmp / "best.yaml", sqlite_url(tmp))


def _log_tail(log: Path) -> str:
    return f"{log.read_text()[-1500:]}\n{err_of(log).read_text()[-2500:]}"


def test_search_killed_mid_trial_resumes_to_the_uninterrupted_result(tmp_path: Path, oracle: dict[str, Any]) -> None:
    """SIGKILL of the search's whole process group while a trial trains, then the same command again: the
    interrupted trial (its worker was on this host, its pid is dead) is failed as interrupted and run again,
    and the search ends where an uninterrupted one does."""
    cmd = search_cmd(tiny_search(tmp_path), tmp_path)
    log = tmp_path / "killed.log"
    proc = start(cmd, log)
    try:
        victim = wait_until(lambda: started_trials(tmp_path / "work") or None, "trial training", SEARCH_S, proc)[0]
    finally:
        kill_tree(proc)  # the group and every descendant: the search, its fork server, the trial
    assert proc.returncode == -signal.SIGKILL, _log_tail(log)
    running = {
        (s, t.number)
        for s, st in studies(sqlite_url(tmp_path)).items()
        for t in st.get_trials(states=(TrialState.RUNNING,))
    }
    # the trial seen training (unless it finished in the instant before the kill) and any beside it
    assert running, f"the kill left no trial running in the storage (the one seen training: {victim})"

    check_ok(run(cmd, timeout=SEARCH_S))
    assert search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path)) == oracle
    after = studies(sqlite_url(tmp_path))
    for schedule, number in running:
        dead = after[schedule].trials[number]
        assert dead.state == TrialState.FAIL, (schedule, number, dead.state)
        assert dead.user_attrs["fail_reason"].startswith("interrupted"), dead.user_attrs["fail_reason"]
        retries = [t for t in after[schedule].trials if t.user_attrs.get("retry_of") == number]
        assert len(retries) == 1 and retries[0].params == dead.params, "the killed trial was not run again, once"
        assert retries[0].state in (TrialState.COMPLETE, TrialState.PRUNED)


def test_search_survives_its_fork_server_killed_mid_trial(tmp_path: Path, oracle: dict[str, Any]) -> None:
    """SIGKILL of the fork server (``-m paci_tune.base.zygote``) while a trial it forked trains: the search
    goes on (a new server, or trials started the ordinary way) and ends where an uninterrupted one does --
    the trial that died with the server is not a lost point."""
    cmd = search_cmd(tiny_search(tmp_path), tmp_path)
    log = tmp_path / "search.log"
    proc = start(cmd, log)
    tree: list[int] = []
    try:

        def server_with_trial() -> int | None:
            zygote = fork_server_of(proc.pid)
            return zygote if zygote and forked_trials(zygote) and started_trials(tmp_path / "work") else None

        zygote = wait_until(server_with_trial, "forked trial training", SEARCH_S, proc)
        tree = descendants(zygote)
        os.kill(zygote, signal.SIGKILL)
        code, _ = finish(proc, log, SEARCH_S)
    finally:
        kill_tree(proc)
        kill_all(tree)
    assert code == 0, _log_tail(log)
    assert search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path)) == oracle


def test_ctrl_c_with_two_trials_running_leaves_them_running_and_resume_reaches_the_uninterrupted_result(
    tmp_path: Path, oracle: dict[str, Any]
) -> None:
    """SIGINT (Ctrl-C) to a search with ``jobs: 2`` while two trials it forked train: it exits 130, and its
    running trials are left RUNNING (stopped by its own shutdown: neither a crash nor a lost point), not told
    FAIL "crash: killed by signal 9" by a fork server closed before the lanes stopped them (tune/search.py);
    the same command again retries them and ends where an uninterrupted search does."""
    cmd = search_cmd(tiny_search(tmp_path, jobs=2), tmp_path)
    log = tmp_path / "interrupted.log"
    proc = start(cmd, log)
    tree: list[int] = []
    try:

        def two_held() -> list[int] | None:
            """Two forked trials training, held (SIGSTOP) so that neither can finish before the search's
            Ctrl-C is taken (a trial lasts about a second)."""
            zygote = fork_server_of(proc.pid)
            if not zygote or len(started_trials(tmp_path / "work")) < 2:
                return None
            held = forked_trials(zygote)
            for pid in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            if len([p for p in held if alive(p)]) >= 2:
                return held
            _resume(held)  # one had finished already: let them go, and look again
            return None

        held = wait_until(two_held, "two forked trials training", SEARCH_S, proc)
        tree = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1.0)  # the search takes its Ctrl-C while its trials are held
        _resume(held)
        code, _ = finish(proc, log, SEARCH_S)
    finally:
        kill_tree(proc)
        kill_all(tree)
    assert code == 130, _log_tail(log)
    trials = [t for st in studies(sqlite_url(tmp_path)).values() for t in st.trials]
    crashed = [(t.number, t.user_attrs.get("fail_reason")) for t in trials if t.state == TrialState.FAIL]
    assert not crashed, f"trials stopped by the search's own Ctrl-C were told failed: {crashed}"
    assert any(t.state == TrialState.RUNNING for t in trials), "no trial was left running for the resume"

    check_ok(run(cmd, timeout=SEARCH_S))
    assert search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path)) == oracle


def _resume(pids: list[int]) -> None:
    """SIGCONT to each of ``pids`` still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_two_searches_on_one_work_folder_run_each_trial_once(tmp_path: Path, oracle: dict[str, Any]) -> None:
    """The same ``paci-tune search`` command twice at once (one config, work folder, SQLite storage and
    best.yaml): both finish, every trained trial ran in one process only (one trial folder per trained
    trial), none is lost, and best.yaml is the single search's."""
    cmd = search_cmd(tiny_search(tmp_path), tmp_path)
    run_twice_at_once(cmd, tmp_path, SEARCH_S)
    assert search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path)) == oracle
    for s, st in studies(sqlite_url(tmp_path)).items():
        numbers = [t.number for t in st.trials]
        assert numbers == list(range(len(numbers))), "trial numbers must be unique and contiguous"
        trained = sorted(
            f"trial-{t.number:04d}" for t in st.trials if not {"repeat_of", "shared_from"} & set(t.user_attrs)
        )
        folders = sorted(p.name for p in (tmp_path / "work" / "trials" / f"model.{s}").iterdir() if p.is_dir())
        assert folders == trained, f"{s}: trial folders {folders}, trained trials {trained}: one ran twice, or was lost"


@pytest.fixture
def own_postgres() -> Iterator[Server]:
    """A PostgreSQL server of this test's own (helpers.pg), which it may restart; skips without one."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'paci-tune[postgres]'")
    srv = server()
    if srv is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin: cannot start a server to restart")
    try:
        yield srv
    finally:
        srv.remove()


def _restart(srv: Server) -> None:
    """``pg_ctl restart -m fast``: every session is cut, the server is back on the same port (the options of
    its start are kept in postmaster.opts)."""
    log = str(srv.root / "server.log")  # its output to the log: to a pipe, pg_ctl's caller would wait on the server
    srv.run(str(srv.bin_dir / "pg_ctl"), "-D", str(srv.data), "-l", log, "-m", "fast", "-w", "restart")


def test_search_survives_a_postgres_restart_mid_study(
    tmp_path: Path, own_postgres: Server, oracle: dict[str, Any]
) -> None:
    """The database server restarted (fast: every connection cut) while a trial trains: the search finishes,
    with the trial count and best.yaml of an uninterrupted search. A storage that cannot ride out a
    restart of a few seconds fails a whole multi-machine search at every database maintenance."""
    cmd = search_cmd(tiny_search(tmp_path), tmp_path, "--storage", own_postgres.url)
    log = tmp_path / "search.log"
    proc = start(cmd, log)
    try:
        wait_until(lambda: started_trials(tmp_path / "work") or None, "trial training", SEARCH_S, proc)
        _restart(own_postgres)
        code, _ = finish(proc, log, SEARCH_S)
    finally:
        kill_tree(proc)
    assert code == 0, _log_tail(log)
    storage = optuna.storages.RDBStorage(own_postgres.url)
    assert search_outcome(tmp_path / "best.yaml", storage) == oracle


# ------------------------------------------------------------------------------------------ training
STEPS, EVERY = 12, 4
TRAIN = make_config(
    model=NARROW_MODEL,
    training={"steps": STEPS, "eval_every": 1000, "checkpoint_every": EVERY, "keep_checkpoints": 3},
    pipeline={"schedule": "paci", "stages": 2, "window": 4},
)
"""The narrow tiny GPT, 12 steps, a checkpoint every 4 (each writes stage_0.pt, then stage_1.pt)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    """The uninterrupted run's train losses, trained in this process, and its checkpoint root (batches 4,
    8, 12). It checkpoints too: checkpoints end the segments PACI drains, so they are part of the numbers."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    records = run_in_process(merge(TRAIN, {"training": {"checkpoint_dir": str(root)}}))
    return train_losses(records), root


def _resumed_losses(metrics: Path, resumed_at: int) -> list[float]:
    """The losses of a resumed run's metrics file (the steps before the checkpoint are carried in it),
    checking it did resume at ``resumed_at``."""
    records = read_metrics(metrics)
    assert [r["resumed_at"] for r in records if r["event"] == "start"] == [0, resumed_at]
    return train_losses(records)


def _marker(path: Path) -> tuple[int, str] | None:
    """The fault's marker (helpers.faults.fault_env): the pid and the file of the faulty write, once written."""
    try:
        pid, name = path.read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid), name


def test_a_killed_stage_worker_fails_the_run_cleanly_and_resume_trains_the_same_losses(
    tmp_path: Path, reference: tuple[list[float], Path]
) -> None:
    """SIGKILL of stage 1's worker of ``--runtime distributed`` after the first checkpoint (held, by the
    injected pause, in its second checkpoint's write, so the run cannot end first): the run ends non-zero
    within DEATH_BOUND_S with nothing left running, and ``--resume`` trains the uninterrupted run's losses."""
    config, ckpt = write_config(tmp_path, TRAIN), tmp_path / "ckpt"
    env, marker = fault_env(tmp_path / "fault", "pause", at=2, rank=1)
    log = tmp_path / "killed.log"
    args = ("--runtime", "distributed", "--checkpoint-dir", ckpt)
    proc = start(cli_command(config, *args, "--metrics", tmp_path / "killed.jsonl"), log, env)
    tree: list[int] = []
    try:
        victim, _ = wait_until(lambda: _marker(marker), "stage 1 in its second checkpoint", 180, proc)
        assert (ckpt / "LATEST").read_text().strip() == f"batch_{EVERY:08d}"
        tree = descendants(proc.pid)
        assert victim in tree, f"the paused process {victim} is not one of the run's {tree}"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        code, err = finish(proc, log, DEATH_BOUND_S)
        took = time.monotonic() - killed
        survivors = survivors_after(tree, 10)
    finally:
        kill_tree(proc)
        kill_all(tree)
    assert code not in (0, None), _log_tail(log)
    assert took < DEATH_BOUND_S
    assert not survivors, f"{len(survivors)} processes outlived the failed run"
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: pipeline worker rank 1"), err[-1000:]

    metrics = tmp_path / "resumed.jsonl"
    check_ok(run_cli(config, *args, "--resume", "--metrics", metrics, timeout=240))
    assert _resumed_losses(metrics, EVERY) == pytest.approx(reference[0], abs=1e-5, rel=0)


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint_and_resume_trains_the_same_losses(
    tmp_path: Path, reference: tuple[list[float], Path]
) -> None:
    """ENOSPC on the second checkpoint's stage_1.pt (half of it written, as a full disk does): exit 1 with one
    error line naming the file and the full disk, the first checkpoint intact and still ``LATEST``, no
    temporary file left; ``--resume`` without the fault trains the uninterrupted run's losses."""
    config, ckpt = write_config(tmp_path, TRAIN), tmp_path / "ckpt"
    env, marker = fault_env(tmp_path / "fault", "enospc", at=4)  # writes 3 and 4: stage_0, stage_1 at batch 8
    proc = subprocess.run(
        cli_command(config, "--checkpoint-dir", ckpt, "--metrics", tmp_path / "full.jsonl"),
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert _marker(marker) is not None, "the fault was never injected"
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    failed = ckpt / f"batch_{2 * EVERY:08d}" / "stage_1.pt"
    assert last.startswith("error: ") and str(failed) in last and "disk is full" in last, last
    kept = ckpt / f"batch_{EVERY:08d}"
    assert (ckpt / "LATEST").read_text().strip() == kept.name
    assert not list(ckpt.rglob(".stage_*")), "a temporary stage file was left behind"
    # intact: the same bytes' worth of state as the uninterrupted run's checkpoint at that batch
    for name in ("stage_0.pt", "stage_1.pt"):
        got = torch.load(kept / name, map_location="cpu", weights_only=True)
        want = torch.load(reference[1] / kept.name / name, map_location="cpu", weights_only=True)
        for key, tensor in want["module"].items():
            assert torch.equal(got["module"][key], tensor), f"{name}: {key} differs from the uninterrupted run's"

    metrics = tmp_path / "resumed.jsonl"
    check_ok(run_cli(config, "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics))
    assert _resumed_losses(metrics, EVERY) == pytest.approx(reference[0], abs=1e-6, rel=0)


def test_a_truncated_stage_file_and_a_dangling_latest_are_refused_at_once(
    tmp_path: Path, reference: tuple[list[float], Path]
) -> None:
    """``--resume`` from a checkpoint whose newest stage file is cut in half, and from a root whose ``LATEST``
    names a folder that is not there: exit 2 within REFUSAL_BOUND_S, no traceback, the file or folder named
    on stderr -- not a crash deep in torch's loader, and not a silent fresh start."""
    config = write_config(tmp_path, TRAIN)
    truncated = shutil.copytree(reference[1], tmp_path / "truncated")
    cut = truncated / (truncated / "LATEST").read_text().strip() / "stage_1.pt"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    dangling = shutil.copytree(reference[1], tmp_path / "dangling")
    (dangling / "LATEST").write_text("batch_00000099\n")
    named = {truncated: [str(cut)], dangling: [str(dangling), "batch_00000099"]}  # LATEST, or the folder it names
    logs = {root: tmp_path / f"{root.name}.log" for root in named}
    t0 = time.monotonic()
    procs = {root: start(cli_command(config, "--checkpoint-dir", root, "--resume"), logs[root]) for root in named}
    try:
        done = {root: finish(p, logs[root], REFUSAL_BOUND_S + 30) for root, p in procs.items()}
    finally:
        for p in procs.values():
            kill_tree(p)
    took = time.monotonic() - t0
    for root, (code, err) in done.items():
        assert code == 2, f"{root.name}: exit {code}\n{_log_tail(logs[root])}"
        assert "Traceback" not in err, f"{root.name}: {err[-2000:]}"
        for name in named[root]:
            assert name in err, f"{root.name}: {name} not named in: {err[-1000:]}"
    assert took < REFUSAL_BOUND_S, f"refusing took {took:.1f} s"
