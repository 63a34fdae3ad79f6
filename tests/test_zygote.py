"""The fork server (paci_tune.base.zygote): a forked child is a process of its own, as a subprocess is.

Oracles: the kernel's view of the child (its process group and session, /proc), the exit status
the kernel reports, the files the child wrote; and, for a trial, the same trial started the
ordinary way (its validation losses, exactly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paci_tune.base.processes import Child, child_environment, follow
from paci_tune.base.zygote import LATE_ENV, Zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux")

PRELOAD = "os:getpid"  # a callable taking nothing: the unit tests need no torch


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # a zombie: dead, its parent not yet told
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def test_a_forked_child_has_its_own_group_output_environment_and_exit_code(tmp_path: Path) -> None:
    env = child_environment(os.environ)
    script = _script(
        tmp_path,
        "child.py",
        """
        import os, sys
        print("out", os.getpid(), os.getpgid(0), os.getsid(0), flush=True)
        print("err", os.environ.get("OMP_NUM_THREADS"), os.getcwd(), file=sys.stderr, flush=True)
        sys.exit(3)
    """,
    )
    with Zygote(PRELOAD, env, tmp_path / "server.log") as server:
        child = server.spawn("runpy:run_path", [script], {**env, "OMP_NUM_THREADS": "1"}, tmp_path / "child.log")
        assert child is not None
        assert child.wait(timeout=30) == 3
        out, err = (tmp_path / "child.log").read_text().splitlines()
    pid, pgid, sid = (int(v) for v in out.split()[1:])
    assert pid == child.pid and pgid == pid and sid == pid  # a session and group of its own: killpg reaches it alone
    assert err.split() == ["err", "1", os.getcwd()]


def test_an_exception_exits_1_with_its_traceback_and_a_signal_is_a_negative_code(tmp_path: Path) -> None:
    env = child_environment(os.environ)
    boom = _script(tmp_path, "boom.py", "raise RuntimeError('boom here')\n")
    sleeper = _script(tmp_path, "sleep.py", "import time\ntime.sleep(600)\n")
    with Zygote(PRELOAD, env, tmp_path / "server.log") as server:
        child = server.spawn("runpy:run_path", [boom], env, tmp_path / "boom.log")
        assert child is not None and child.wait(timeout=30) == 1
        assert "RuntimeError: boom here" in (tmp_path / "boom.log").read_text()
        slow = server.spawn("runpy:run_path", [sleeper], env, tmp_path / "sleep.log")
        assert slow is not None and slow.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(timeout=0.2)
        os.killpg(slow.pid, signal.SIGKILL)
        assert slow.wait(timeout=30) == -signal.SIGKILL


def test_an_environment_it_cannot_give_is_not_forked(tmp_path: Path) -> None:
    env = child_environment(os.environ)
    with Zygote(PRELOAD, env, tmp_path / "server.log") as server:
        assert frozenset({"OMP_NUM_THREADS"}) == LATE_ENV
        assert server.forks({**env, "OMP_NUM_THREADS": "7"})
        assert not server.forks({**env, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
        assert server.spawn("os:getpid", [], {**env, "LD_PRELOAD": "x.so"}, tmp_path / "x.log") is None


def test_a_child_runs_the_ordinary_way_when_the_server_cannot_start(tmp_path: Path) -> None:
    env = child_environment(os.environ)
    server = Zygote("no_such_module_here:nothing", env, tmp_path / "server.log")
    script = _script(tmp_path, "ok.py", "print('ran')\n")
    fork = lambda e, log: server.spawn("runpy:run_path", [script], e, log)  # noqa: E731
    with Child([sys.executable, script], log=tmp_path / "c.log", events=tmp_path / "ev.jsonl", fork=fork) as c:
        follow(c, lambda rec: None, poll_s=0.05)
        assert c.returncode == 0
    assert (tmp_path / "c.log").read_text().strip() == "ran"
    assert "No module named 'no_such_module_here'" in (tmp_path / "server.log").read_text()
    server.close()


def test_a_child_that_died_with_its_server_is_lost_not_killed_by_a_signal(tmp_path: Path) -> None:
    """SIGKILL of the server: its running child is gone (its whole group), ends as ``lost`` (its own exit
    status unknown, so a runner runs it again rather than tell a crash), and later requests are refused
    (started the ordinary way); a child the server saw end, even by SIGKILL, is not lost."""
    env = child_environment(os.environ)
    sleeper = _script(tmp_path, "sleep.py", "import time\ntime.sleep(600)\n")
    with Zygote(PRELOAD, env, tmp_path / "server.log") as server:
        killed = server.spawn("runpy:run_path", [sleeper], env, tmp_path / "killed.log")
        victim = server.spawn("runpy:run_path", [sleeper], env, tmp_path / "victim.log")
        assert killed is not None and victim is not None
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL and not killed.lost
        assert server._proc is not None
        os.kill(server._proc.pid, signal.SIGKILL)
        assert victim.wait(timeout=30) is not None and victim.lost
        assert _gone(victim.pid)
        assert server.spawn("runpy:run_path", [sleeper], env, tmp_path / "after.log") is None


def test_sigkill_of_the_parent_leaves_neither_the_server_nor_its_children(tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "sleep.py", "import time\ntime.sleep(600)\n")
    parent = _script(
        tmp_path,
        "parent.py",
        f"""
        import os, sys, time
        from pathlib import Path
        from paci_tune.base.zygote import Zygote
        z = Zygote("os:getpid", dict(os.environ), Path({str(tmp_path / "server.log")!r}))
        c = z.spawn("runpy:run_path", [{sleeper!r}], dict(os.environ), Path({str(tmp_path / "s.log")!r}))
        print(z._proc.pid, c.pid, flush=True)
        time.sleep(600)
    """,
    )
    proc = subprocess.Popen([sys.executable, parent], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    server_pid, child_pid = (int(v) for v in proc.stdout.readline().split())
    assert not _gone(child_pid, within_s=0.5)
    proc.kill()
    proc.wait()
    assert _gone(server_pid) and _gone(child_pid)


def test_a_forked_trial_trains_the_numbers_of_one_started_the_ordinary_way(tmp_path: Path) -> None:
    """The search's runner with and without its fork server: the same validation losses, exactly, and the
    thread count the runner asked for (set after the fork: OpenMP read the server's environment)."""
    import copy

    from helpers.cli import read_metrics
    from helpers.searches import SEARCH_DOC

    from paci_tune.tune.point import TrialParams
    from paci_tune.tune.runner import SubprocessRunner, TrialJob, fork_server

    doc = {k: copy.deepcopy(v) for k, v in SEARCH_DOC.items() if k not in ("target", "budget", "hardware", "search")}
    doc["training"].update({"steps": 6, "eval_every": 2})
    runs = {}
    with fork_server(tmp_path) as server:
        for name, via in (("plain", None), ("forked", server)):
            job = TrialJob(TrialParams("paci", 2, 4, 2), doc, tmp_path / name, 1.0, 2, 0.0, threads=1, server=via)
            result = SubprocessRunner(stall_seconds=120).run(job, lambda step, progress: False)
            assert result.status == "complete", (name, result.reason)
            start = next(r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["event"] == "start")
            runs[name] = (result.by_step, start["threads"])
        assert server._proc is not None  # the forked trial did come from the server
    assert runs["forked"] == runs["plain"] and runs["plain"][1] == 1 and len(runs["plain"][0]) == 3
