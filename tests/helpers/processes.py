"""The operating system as an oracle: a process's descendants, whether they live, and killing them.

The tests that stop a run (SIGKILL, SIGINT, a dead rank, a pruned trial) check that no process of
it outlives it, and clean up whatever did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
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
