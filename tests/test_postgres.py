"""``paci-tune search`` on a real PostgreSQL server: two workers share one study (no trial lost, none
run twice), and the one on "another host", killed with SIGKILL mid-trial, is found dead by the other
through its stale heartbeat and its trial run again; the server stopped mid-search loses no
finished trial and the search resumes when re-run.

Oracle: the database itself, read back with Optuna after the workers have exited, the trial folders
on disk (one per fresh trial), and the operating system (the killed worker's trial process gone).
The server is ``.ci/run``'s (``PACI_TUNE_POSTGRES_URL``) or one started here (:mod:`pg`); the stop
and restart test always starts its own. Tests skip, saying why, without PostgreSQL binaries or psycopg.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from helpers import REPO
from helpers.cli import check_ok, cli_env
from helpers.pg import ENV, Server, server
from helpers.searches import quota_met, run, search_cmd, write_search
from optuna.trial import TrialState

pytestmark = pytest.mark.slow


def _need_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'paci-tune[postgres]'")


def _own_server() -> Server:
    srv = server()
    if srv is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin (and no PACI_TUNE_POSTGRES_URL)")
    return srv


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    _need_psycopg()
    if os.environ.get(ENV):
        yield os.environ[ENV]
        return
    srv = _own_server()
    try:
        yield srv.url
    finally:
        srv.remove()


@pytest.fixture
def own_server() -> Iterator[Server]:
    """A server this test may stop and start again (never the one other tests share)."""
    _need_psycopg()
    srv = _own_server()
    try:
        yield srv
    finally:
        srv.remove()


OTHER_HOST = "paci-test-other-host"


def _as_other_host(cmd: list[str]) -> list[str]:
    """``cmd`` in its own UTS namespace named OTHER_HOST: to the other worker it runs on another
    machine (same pid numbers, other host name), so only the heartbeat can tell it died."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot give a worker another host name")
    probe = subprocess.run(["unshare", "--uts", "--fork", "hostname", OTHER_HOST], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here ({probe.stderr.strip()[:120]}): needs root")
    return ["unshare", "--uts", "--fork", "sh", "-c", f'hostname {OTHER_HOST} && exec "$@"', "sh", *cmd]


def _studies(storage: optuna.storages.BaseStorage, name: str) -> dict[str, optuna.Study]:
    return {s: optuna.load_study(study_name=f"{name}.{s}", storage=storage) for s in ("paci", "1f1b")}


def test_two_workers_share_a_study_and_one_killed_on_another_host_is_found_by_its_heartbeat(
    tmp_path: Path, postgres_url: str
) -> None:
    grace = 15.0
    config = write_search(tmp_path, search={"trials": 3, "heartbeat_grace": grace})
    name = f"pgkill-{os.getpid()}-{tmp_path.name}"
    cmds = [
        search_cmd(
            config, tmp_path, "--storage", postgres_url, "--study-name", name, "--out", str(tmp_path / f"best{i}.yaml")
        )
        for i in range(2)
    ]
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)
    cmds[0] = _as_other_host(cmds[0])
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds
    ]
    storage = optuna.storages.RDBStorage(postgres_url)
    victim, killed_at, deadline = None, 0.0, time.monotonic() + 240
    try:
        while victim is None:
            assert time.monotonic() < deadline, "the other-host worker never ran a trial"
            assert procs[0].poll() is None, procs[0].communicate()[1][-2000:]
            for s, st in _studies(storage, name).items() if _has_studies(storage, name) else ():
                for t in st.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                    # mid-trial: its trial has started (its folder exists), not only been asked for
                    started = (tmp_path / "work" / "trials" / f"{name}.{s}" / f"trial-{t.number:04d}").is_dir()
                    if (t.user_attrs.get("worker") or {}).get("host") == OTHER_HOST and started:
                        victim = (s, t.number, int(t.user_attrs["worker"]["pid"]))
            if victim is None:
                time.sleep(0.2)
        os.kill(victim[2], signal.SIGKILL)  # the worker itself, mid-trial; its trial process dies with it
        killed_at = time.time()
        procs[0].communicate(timeout=60)
        _, err = procs[1].communicate(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 0, err[-2000:]
    schedule, number, _ = victim
    st = _studies(storage, name)[schedule]
    dead = st.trials[number]
    assert dead.state == TrialState.FAIL and dead.user_attrs["fail_reason"] == "interrupted: its worker died"
    assert dead.datetime_complete is not None
    found_after = dead.datetime_complete.timestamp() - killed_at
    # Its last beat was at most 5 s before the kill: found no sooner than grace - 5 s (so not by a
    # pid check, which is immediate), and found within a bound (the survivor polls every 2 s).
    assert grace - 6 <= found_after <= grace + 60, f"found dead {found_after:.1f} s after the kill"
    retries = [t for t in st.trials if t.user_attrs.get("retry_of") == number]
    assert len(retries) == 1 and retries[0].params == dead.params
    assert retries[0].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert (retries[0].user_attrs.get("worker") or {}).get("pid") == procs[1].pid, "the survivor ran it again"
    workers = set()
    for s, study in _studies(storage, name).items():
        numbers = [t.number for t in study.trials]
        assert numbers == list(range(len(numbers))), "trial numbers must be unique and contiguous"
        assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], "a trial was lost"
        assert quota_met(study.trials, 3, extra=1), s  # at most (workers - 1) extra from a race at the very end
        fresh = [t for t in study.trials if not {"repeat_of", "shared_from"} & set(t.user_attrs)]  # answered: none ran
        dirs = sorted(p.name for p in (tmp_path / "work" / "trials" / f"{name}.{s}").iterdir())
        seen = [(t.number, t.state.name, sorted(t.user_attrs)) for t in study.trials]
        ran = [f"trial-{t.number:04d}" for t in sorted(fresh, key=lambda t: t.number)]
        assert dirs == ran, f"each trial ran once: {seen}"
        workers |= {t.user_attrs["worker"]["host"] for t in study.trials}
    assert len(workers) == 2, "both workers ran trials"
    folder = str(tmp_path / "work" / "trials" / f"{name}.{schedule}" / f"trial-{number:04d}")  # this test's only
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, folder)]
    assert not left, "the killed worker's trial process outlived it"


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_the_server_stopped_mid_search_loses_nothing_and_the_search_resumes(tmp_path: Path, own_server: Server) -> None:
    config = write_search(tmp_path, search={"trials": 2})
    name = "restart"
    cmd = search_cmd(config, tmp_path, "--storage", own_server.url, "--study-name", name)
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    storage = optuna.storages.RDBStorage(own_server.url)
    finished: dict[tuple[str, int], tuple[TrialState, list[float] | None]] = {}
    deadline = time.monotonic() + 240
    try:
        while len(finished) < 2:
            assert time.monotonic() < deadline, "no two trials finished in 240 s"
            assert proc.poll() is None, "the search ended before the server could be stopped"
            for s, st in _studies(storage, name).items() if _has_studies(storage, name) else ():
                for t in st.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
                    finished[(s, t.number)] = (t.state, t.values)
            time.sleep(0.2)
        own_server.stop("immediate")  # as if the database machine went down
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: the study's storage failed: "), err[-500:]
    assert not (tmp_path / "best.yaml").exists(), "no recommendation from a half-finished search"
    own_server.start()
    check_ok(run(cmd, timeout=400))
    after = _studies(optuna.storages.RDBStorage(own_server.url), name)
    for (s, number), (state, values) in finished.items():
        t = after[s].trials[number]
        assert (t.state, t.values) == (state, values), "a trial finished before the stop was lost or changed"
    for s, study in after.items():
        assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], s
        assert quota_met(study.trials, 2), s
        for t in study.trials:
            if t.state == TrialState.FAIL:  # the one the stop interrupted, found dead (same host) and re-run
                assert t.user_attrs["fail_reason"] == "interrupted: its worker died"
                drawn = t.params or t.system_attrs.get("fixed_params")  # none: stopped before drawing its point
                assert not drawn or [r for r in study.trials if r.user_attrs.get("retry_of") == t.number]
    assert (tmp_path / "best.yaml").is_file()


def _has_studies(storage: optuna.storages.BaseStorage, name: str) -> bool:
    names = {s.study_name for s in storage.get_all_studies()}
    return {f"{name}.paci", f"{name}.1f1b"} <= names
