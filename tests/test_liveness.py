"""Liveness of trials across workers (:mod:`paci_tune.tune.liveness`): who claimed a running trial, whether
that worker still lives, and what its owner does once another worker has reaped it.

Oracles: the operating system (a real ``sleep`` process's pid and ``/proc`` start time, this process's own
pid), Optuna's trial states read back from real storages (in memory, a journal file), and a real
``paci-tune search`` whose running trial the test reaps through the storage, as another worker would.
Each test fails on the code before liveness.py: a live pid or this process's pid kept a trial alive
forever on the same host, the heartbeat thread stopped on its first error, a reaped owner crashed on its
next write, and another host's heartbeat was judged by its wall-clock age alone.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers import REPO
from helpers.cli import cli_env
from helpers.searches import search_cmd, write_search
from optuna.trial import TrialState

from paci_tune.tune import liveness
from paci_tune.tune.liveness import MAX_SKEW_S, Heartbeat, Watch, identity, reaped_line, start_time
from paci_tune.tune.record import REAPED, Claim, TrialRecord
from paci_tune.tune.study import counted, open_storage, reap, reap_dead

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _running(study: optuna.Study, claim: Claim | None) -> optuna.Trial:
    """A running trial of ``study`` (with a parameter, so a reaped one is queued again), claimed by ``claim``."""
    trial = study.ask()
    trial.suggest_categorical("b", [1, 2])
    if claim is not None:
        claim.write(trial)
    return trial


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this host that claims nothing."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _need_proc() -> None:
    me = identity()
    if me.boot is None or me.start is None or me.pidns is None:
        pytest.skip("no /proc here: the same-host fast path needs the boot id, pid namespace and start times")


# --------------------------------------------------------------------------- (a) a live pid, not the claimant
def test_a_live_pid_that_is_not_the_claimant_is_reaped(sleeper: subprocess.Popen[bytes]) -> None:
    _need_proc()
    start = start_time(sleeper.pid)
    assert start is not None
    study = optuna.create_study()
    other = dataclasses.replace(identity(), pid=sleeper.pid, worker="a-previous-worker")
    reused = _running(study, dataclasses.replace(other, start=start + 1))  # the pid now names another process
    claimant = _running(study, dataclasses.replace(other, start=start))  # it is the claimant: alive
    assert reap_dead(study, retries=1) == [reused.number]
    retry = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs["retry_of"] for t in retry] == [reused.number]
    assert study.trials[claimant.number].state == TrialState.RUNNING


def test_a_claim_from_another_boot_or_an_old_claim_is_judged_by_its_heartbeat(
    sleeper: subprocess.Popen[bytes],
) -> None:
    """A pid means nothing across a reboot (or on a machine with the same name), and an old claim (host and
    pid only) cannot tell a live pid from a reused one: their heartbeats decide, on this host too."""
    _need_proc()
    study, grace, now = optuna.create_study(), 10.0, time.time()
    booted = dataclasses.replace(identity(), pid=sleeper.pid, boot="another-boot", worker="w")
    old = Claim(liveness.HOST, sleeper.pid, now)
    fresh = [_running(study, dataclasses.replace(c, heartbeat=now)) for c in (booted, old)]
    stale = [_running(study, dataclasses.replace(c, heartbeat=now - grace - MAX_SKEW_S - 5)) for c in (booted, old)]
    assert sorted(reap_dead(study, retries=0, grace=grace)) == [t.number for t in stale]
    assert all(study.trials[t.number].state == TrialState.RUNNING for t in fresh)


# --------------------------------------------------------------------------- (b) our pid, another worker
def test_our_own_pid_claimed_by_a_previous_worker_is_reaped() -> None:
    """After a restart the new worker can get the dead one's pid: the claim's worker id and start time tell."""
    _need_proc()
    me = identity()
    study = optuna.create_study()
    before_us = _running(study, dataclasses.replace(me, worker="the-worker-before", start=me.start - 100))
    ours = _running(study, identity())
    assert reap_dead(study, retries=1) == [before_us.number]
    assert study.trials[ours.number].state == TrialState.RUNNING
    # Our own trial is alive while its heartbeat is; one this process left behind is reaped by it (the backstop).
    Claim.beat(study._storage, ours._trial_id, time.time() - 61)
    assert reap_dead(study, retries=1, grace=60) == [ours.number]


def test_a_queued_trial_reaped_before_drawing_its_point_is_queued_again_with_it() -> None:
    """A retry, a sibling or a confirmation seed interrupted between ask and suggest (a database stopped
    there, CI of 4a713e5) has no params yet, only the point it was queued with: that point is run again."""
    _need_proc()
    me = identity()
    study = optuna.create_study()
    study.enqueue_trial({"b": 2})
    asked = study.ask()  # not drawn: no suggest_* yet
    dataclasses.replace(me, worker="the-worker-before", start=me.start - 100).write(asked)
    unqueued = study.ask()  # sampled, not drawn: nothing to run again
    dataclasses.replace(me, worker="the-worker-before", start=me.start - 100).write(unqueued)
    assert sorted(reap_dead(study, retries=1)) == [asked.number, unqueued.number]
    retry = study.get_trials(states=(TrialState.WAITING,))
    assert [(t.user_attrs["retry_of"], t.system_attrs["fixed_params"]) for t in retry] == [(asked.number, {"b": 2})]


def test_a_trial_another_worker_took_too_and_finished_ends_the_block_quietly() -> None:
    """SQLite can hand one queued trial to two workers; the one that writes second finds it finished (CI of
    4a713e5's successor: a two-worker search ended in UpdateFinishedTrialError). It drops the trial and goes on;
    another error passes."""
    study = optuna.create_study()
    trial = _running(study, identity())
    with Heartbeat(study._storage, trial._trial_id, period=0.05) as beat:
        study.tell(trial, 1.0)  # the other worker finished it
        trial.set_user_attr("late", 1)  # this worker's next write
    assert beat.taken and not beat.reaped
    assert "another worker" in liveness.taken_line(trial.number)
    other = _running(study, identity())
    with pytest.raises(RuntimeError), Heartbeat(study._storage, other._trial_id, period=0.05):
        raise RuntimeError("not a storage refusal")


# --------------------------------------------------------------------------- (c) the heartbeat survives errors
class _Flaky:
    """A real storage whose first ``failures`` heartbeat writes fail as a locked SQLite database does."""

    def __init__(self, real: optuna.storages.BaseStorage, failures: int) -> None:
        self.real, self.failures = real, failures

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise sqlite3.OperationalError("database is locked")
        self.real.set_trial_user_attr(trial_id, key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _journal_study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=open_storage(str(tmp_path / "study.log")), load_if_exists=True)


def test_a_heartbeat_whose_storage_fails_a_few_times_keeps_beating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "BACKOFF_S", 0.05)
    study = _journal_study(tmp_path)
    trial = _running(study, identity(time.time() - 100))
    flaky = _Flaky(study._storage, failures=4)
    with Heartbeat(flaky, trial._trial_id, period=0.2) as beat:  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while beat.beats < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert beat.failures == 4 and beat.beats >= 2 and not beat.lost.is_set()
    stored = TrialRecord.read(_journal_study(tmp_path).trials[0]).heartbeat
    assert stored is not None and stored > time.time() - 30  # beaten after the failures, in the real file


def test_a_heartbeat_finds_its_trial_reaped_and_the_block_ends_quietly() -> None:
    study = optuna.create_study()
    trial = _running(study, identity())
    with Heartbeat(study._storage, trial._trial_id, period=0.05) as beat:
        assert reap(study, study.trials[trial.number], retries=1)
        assert beat.lost.wait(10), "the heartbeat did not notice its trial was reaped"
        trial.set_user_attr("x", 1)  # the owner's next write: refused, and swallowed by the block
    assert beat.reaped
    with pytest.raises(ValueError), Heartbeat(study._storage, _running(study, identity())._trial_id):
        raise ValueError("a trial's own error passes")


# --------------------------------------------------------------------------- (d) a real search, reaped mid-trial
@pytest.mark.slow
@pytest.mark.whole_machine  # a wall-clock search of 2 devices: a core each
def test_a_trial_reaped_by_another_worker_is_dropped_by_its_owner_and_the_search_finishes(tmp_path: Path) -> None:
    """A real ``paci-tune search`` on a journal file; the test, as another worker, reaps its running trial.
    The owner kills that trial's process, says so in one line, and runs its quota (the retry included)."""
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump({"schedules": ["paci"], "stages": [2], "microbatch_size": [2, 4]})
    )
    config = write_search(
        tmp_path,
        budget={"clock": "wall", "seconds": 12.0, "grid": 3},
        training={"eval_every": 5},
        hardware={"runtime": "emulated", "devices": 2},
        search={"trials": 2, "sampler": "grid", "retries": 1},
        target={"value": 0.01},  # never reached: a trial runs its whole budget unless stopped
    )
    log = tmp_path / "study.log"
    env = cli_env()
    proc = subprocess.Popen(
        search_cmd(config, tmp_path, "--storage", str(log)),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    try:
        deadline = time.monotonic() + 240
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            victim = _started_trial(log, tmp_path)
        if victim is None:
            code, (_, err) = proc.poll(), proc.communicate(timeout=60) if proc.poll() is not None else ("", "")
            raise AssertionError(f"no trial started (search exit {code}): {err[-3000:]}")
        study = _paci(log)
        assert reap(study, study.trials[victim], retries=1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert reaped_line(victim) in " ".join(err.split()), err[-3000:]  # off a terminal, rich wraps at 80 columns
    assert "Traceback" not in err and "UpdateFinishedTrialError" not in err, err[-3000:]
    events = (tmp_path / "work" / "trials" / "model.paci" / f"trial-{victim:04d}" / "events.jsonl").read_text()
    assert '"summary"' not in events, "the reaped trial's process ran on to its end"
    trials = _paci(log).trials
    dead = trials[victim]
    assert dead.state == TrialState.FAIL and dead.user_attrs["fail_reason"] == REAPED
    retries = [t for t in trials if t.user_attrs.get("retry_of") == victim]
    assert len(retries) == 1 and retries[0].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert counted(trials, 2) == 2


def _paci(log: Path) -> optuna.Study:
    """The search's one study, read back from its journal file."""
    return optuna.load_study(study_name="model.paci", storage=open_storage(str(log)))


def _started_trial(log: Path, tmp: Path) -> int | None:
    """The number of a running trial whose process has written a record (its run is under way)."""
    if not log.exists():
        return None
    try:
        study = _paci(log)
    except KeyError:
        return None  # the study is not created yet
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        events = tmp / "work" / "trials" / "model.paci" / f"trial-{t.number:04d}" / "events.jsonl"
        if events.is_file() and events.stat().st_size > 0:
            return t.number
    return None


# --------------------------------------------------------------------------- (e) clock skew
def test_a_heartbeat_from_a_host_30s_behind_is_not_reaped_while_it_changes() -> None:
    clock = [1000.0]
    watch, study, grace = Watch(clock=lambda: clock[0]), optuna.create_study(), 10.0
    skewed = 30.0  # that host's clock runs 30 s behind ours: its freshest beat looks 30 s old
    trial = _running(study, Claim("a-host-behind", 4242, time.time() - skewed, worker="w"))
    for _ in range(6):  # it beats every 5 s, and the reaper looks after each beat
        assert reap_dead(study, retries=1, grace=grace, watch=watch) == []
        clock[0] += 5.0
        Claim.beat(study._storage, trial._trial_id, time.time() - skewed)
    assert reap_dead(study, retries=1, grace=grace, watch=watch) == []  # its last beat, seen
    clock[0] += grace - 1  # now it has stopped: not reaped until this reaper has watched it unchanged for grace
    assert reap_dead(study, retries=1, grace=grace, watch=watch) == []
    clock[0] += 1
    assert reap_dead(study, retries=1, grace=grace, watch=watch) == [trial.number]
    # A reaper that has watched nothing yet holds the bound: a heartbeat older than grace + MAX_SKEW_S is dead.
    gone = _running(study, Claim("a-host-behind", 4243, time.time() - grace - MAX_SKEW_S - 1, worker="w2"))
    assert reap_dead(study, retries=1, grace=grace) == [gone.number]


def test_an_unclaimed_running_trial_is_reaped_once_watched_for_grace() -> None:
    """A worker that died between asking for a trial and claiming it left it running with no claim: its
    start time is its only heartbeat."""
    clock = [0.0]
    watch, study = Watch(clock=lambda: clock[0]), optuna.create_study()
    trial = _running(study, None)
    assert reap_dead(study, retries=1, grace=10.0, watch=watch) == []
    clock[0] = 10.0
    assert reap_dead(study, retries=1, grace=10.0, watch=watch) == [trial.number]


# --------------------------------------------------------------------------- (f) a storage outage (tune/outage.py)
def _wrapped(driver_error: BaseException) -> BaseException:
    """``driver_error`` as the search meets it: SQLAlchemy's error wrapped in Optuna's StorageInternalError."""
    import sqlalchemy.exc

    try:
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, driver_error) from driver_error
        except sqlalchemy.exc.OperationalError as e:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from e
    except optuna.exceptions.StorageInternalError as e:
        return e


def test_a_lost_or_refused_connection_is_transient_and_a_wrong_password_or_database_is_not() -> None:
    """Real driver errors: a refused connection (psycopg against a port nobody listens on, through SQLAlchemy)
    and a server's administrator shutdown are retried; a wrong password or a missing database, bad data, a
    locked SQLite file (its own timeout waits) are not."""
    psycopg = pytest.importorskip("psycopg")
    import sqlalchemy
    import sqlalchemy.exc

    from paci_tune.base.processes import free_port
    from paci_tune.tune.outage import transient

    engine = sqlalchemy.create_engine(f"postgresql+psycopg://u:p@127.0.0.1:{free_port()}/db")
    with pytest.raises(sqlalchemy.exc.OperationalError) as refused:
        engine.connect()
    assert transient(refused.value) and transient(_wrapped(refused.value.orig))
    assert transient(_wrapped(psycopg.errors.AdminShutdown("terminating connection due to administrator command")))
    try:  # the pool's pre-ping found its connection cut, and could not reconnect yet
        raise optuna.exceptions.StorageInternalError("during the commit") from sqlalchemy.exc.InvalidatePoolError()
    except optuna.exceptions.StorageInternalError as e:
        assert transient(e)
    assert not transient(_wrapped(psycopg.errors.InvalidPassword('password authentication failed for user "u"')))
    assert not transient(_wrapped(psycopg.errors.InvalidCatalogName('database "db" does not exist')))
    libpq = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  password authentication'
    assert not transient(_wrapped(psycopg.OperationalError(libpq)))  # as libpq reports it at connect: no SQLSTATE
    assert not transient(_wrapped(psycopg.errors.UniqueViolation("duplicate key")))
    assert not transient(sqlite3.OperationalError("database is locked"))
    assert not transient(ValueError("connection refused"))  # not a storage error, whatever it says


def test_a_transient_storage_error_is_retried_for_a_bounded_time_and_another_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paci_tune.tune import outage

    monkeypatch.setattr(outage, "BACKOFF_S", 0.01)
    cut = _wrapped(OSError("server closed the connection unexpectedly"))
    calls: list[int] = []

    def flaky(failures: int, error: BaseException) -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "read"

    assert outage.retrying(lambda: flaky(3, cut), "a read") == "read" and len(calls) == 4
    calls.clear()
    with pytest.raises(optuna.exceptions.StorageInternalError):  # a wrong password: no retry
        outage.retrying(lambda: flaky(3, _wrapped(OSError("password authentication failed"))), "a read")
    assert len(calls) == 1
    calls.clear()
    t0 = time.monotonic()
    with pytest.raises(optuna.exceptions.StorageInternalError):  # down for good: the error, once the bound passes
        outage.retrying(lambda: flaky(10**6, cut), "a read", limit_s=0.5)
    assert 0.3 < time.monotonic() - t0 < 2.0 and len(calls) > 2
