"""Child processes that cannot outlive us: process groups, parent-death, a tailed events file.

Three parts of the program run work in child processes and watch it: the distributed launcher
(torchrun and its stage workers), the search's trial runner (one training per trial) and the
calibrator (timing processes that co-run like pipeline stages). They share one mechanism,
:class:`Child`: the command runs in its own process group with its output in a log file, reports
progress as JSON lines appended to an events file, which the parent tails, and is killed with its
whole group on every exit path of the parent (an exception, Ctrl-C, a prune). The child side asks
the kernel for a signal when its parent dies (:func:`die_with_parent`), so even SIGKILL of the
parent leaves nothing running. No child gets the study's storage URL: :mod:`.credentials` takes it out of
their environment. No child puts its working folder on ``sys.path`` (``PYTHONSAFEPATH``, which its own
children -- torchrun's workers -- inherit): a ``yaml.py`` or ``torch.py`` in the folder a user runs from
would otherwise be imported by every trial and worker. May import: the standard library and :mod:`.credentials`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from .credentials import without_storage

_PR_SET_PDEATHSIG = 1

Record = dict[str, Any]


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a process paci-tune starts: without the storage URL, and with a safe import path.

    ``python -m``/``-c`` put the working folder first on ``sys.path``; ``PYTHONSAFEPATH`` (Python 3.11+)
    leaves it out, in the child and in every process it starts. A user's model module is found
    through ``PYTHONPATH`` or an installed package, as the user chose.
    """
    return {**without_storage(env), "PYTHONSAFEPATH": "1"}


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say: the bound past which a size cannot work."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def threads_per_process(n_processes: int) -> int:
    """Threads each of ``n_processes`` compute processes gets when they share this machine's CPUs."""
    return max(1, cpu_count() // max(n_processes, 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before it is used)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with gloo's connections on the loopback interface, for processes that all run on this machine.

    Gloo listens on the address the host name resolves to, often the machine's network address;
    ``GLOO_SOCKET_IFNAME=lo`` keeps it on loopback. A user's own setting wins; where there is no
    ``lo`` (not Linux) nothing is set.
    """
    out = dict(env)
    if "GLOO_SOCKET_IFNAME" not in out and Path("/sys/class/net/lo").exists():
        out["GLOO_SOCKET_IFNAME"] = "lo"
    return out


def worker_env(threads: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a compute child: its thread count, and malloc backed by huge pages.

    Huge pages: activations are freed and re-allocated every micro-batch, and 4 KiB page faults
    made backward times jitter by up to 2x on a CPU (each stall idles the neighbouring pipeline
    stage). Ignored by non-glibc systems; a user's own ``GLIBC_TUNABLES`` wins. ``threads=None``
    keeps the inherited ``OMP_NUM_THREADS`` (or torch's default).
    """
    env = dict(os.environ if base is None else base)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    return env


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only; else a no-op).

    Without it, SIGKILL of a launcher (an OOM kill, a CI timeout) orphans its workers, which keep
    training and writing for a run the user thinks is dead. ``parent``: the pid the parent had when
    it started us; if we are already orphaned, die now.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def tethered(module: str, *args: str) -> list[str]:
    """Command line running ``python -m module args`` so that it dies with this process.

    For modules we do not own (torchrun): :mod:`paci_tune.base.tether` sets the parent-death
    signal in the child itself, which is safe where a pre-exec hook in a threaded parent is not.
    """
    return [sys.executable, "-m", "paci_tune.base.tether", str(os.getpid()), module, *args]


def start_in_group(cmd: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """``cmd`` in a new session and process group of its own (what :meth:`kill_group` stops), as text."""
    return subprocess.Popen(list(cmd), start_new_session=True, text=True, **popen)


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``pid`` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


class EventTail:
    """The complete JSON lines appended to a file since the last read (a line being written waits)."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path)  # noqa: SIM115 - closed by close()
        self._pending = ""

    def read(self) -> tuple[list[Record], bool]:
        """(new records, whether anything at all was appended)."""
        chunk = self._file.read()
        self._pending += chunk
        *lines, self._pending = self._pending.split("\n")
        return [json.loads(line) for line in lines if line.strip()], bool(chunk)

    def close(self) -> None:
        self._file.close()


class Process(Protocol):
    """What :class:`Child` uses of its process: :class:`subprocess.Popen`, or a fork server's child
    (:class:`paci_tune.base.zygote.Forked`)."""

    pid: int
    stdin: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Fork = Callable[[dict[str, str], Path], Process | None]
"""Starts the child from a fork server instead (its environment, its log); None: start it the ordinary way."""


class Child:
    """A command in its own process group, watched through its log and its events file (module doc).

    Use as a context manager: leaving the block kills the group if it still runs, whatever the
    reason. ``stdin=True`` gives the child a pipe for :meth:`send` (a start barrier, a stop word).
    ``fork``: the same program forked from a server that has its imports done (:mod:`.zygote`).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        log: Path,
        events: Path,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        fork: Fork | None = None,
    ) -> None:
        self.cmd, self.log_path, self.events_path = list(cmd), Path(log), Path(events)
        self.env, self.stdin, self.fork = child_environment(os.environ if env is None else env), stdin, fork
        self.proc: Process | None = None
        self._tail: EventTail | None = None
        self._log_size = -1

    def __enter__(self) -> Child:
        self.events_path.write_text("")
        self._tail = EventTail(self.events_path)
        self.proc = self.fork(self.env, self.log_path) if self.fork is not None and not self.stdin else None
        if self.proc is not None:
            return self
        with open(self.log_path, "w") as logf:
            self.proc = start_in_group(
                self.cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
            )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.running:
            self.kill()
        if self._tail is not None:
            self._tail.close()
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the child has not started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def records(self) -> tuple[list[Record], bool]:
        """New records, and whether the child showed any sign of life (events or log output) since the last call."""
        assert self._tail is not None
        recs, appended = self._tail.read()
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        grew, self._log_size = size != self._log_size, size
        return recs, appended or grew

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (ignored if the child has gone)."""
        assert self.proc is not None and self.proc.stdin is not None, "started without stdin=True"
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=timeout)
        return None

    def kill(self, grace_s: float = 10.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL if it is not gone after ``grace_s``."""
        assert self.proc is not None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            kill_group(self.proc.pid, sig)
            if self.wait(grace_s) is not None:
                return

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def follow(
    child: Child,
    on_record: Callable[[Record], None],
    *,
    poll_s: float = 0.1,
    stop: Callable[[bool], bool] | None = None,
) -> bool:
    """Feed ``child``'s records to ``on_record`` until it exits; True if ``stop`` ended it first.

    ``stop(active)`` is asked after every poll (``active``: the child showed a sign of life since the
    previous poll); when it says so, the child's group is killed. The last records written before the
    child exited are always delivered.
    """
    while True:
        done = not child.running
        recs, active = child.records()
        for rec in recs:
            on_record(rec)
        if done:
            return False
        if stop is not None and stop(active):
            child.kill()
            return True
        time.sleep(poll_s)
