"""A fork server: start many short Python children without paying each one's imports.

A search starts one training process per trial, and on a small model most of a short trial's
start is the same work every time: importing torch and the trainer (about 1.8 CPU-seconds) and
torch's first use of the meta device (about 1 CPU-second), against about 25 CPU-seconds for the
whole trial. The server (``python -m paci_tune.base.zygote PARENT_PID MODULE:PRELOAD``) does that
work once, then forks a child per request, as Python's own ``forkserver`` start method does; each
child is a process of its own, as a ``subprocess`` child is:

- its own session and process group (the runner kills the group), its output in its own log;
- the environment it was asked for (only variables a started process may still change: see
  :data:`LATE_ENV`; a request that differs elsewhere is started the ordinary way by the caller);
- it dies with the server, and the server with its parent (the parent-death signal), so SIGKILL of
  the search still leaves nothing running.

The server is single-threaded and forks only from its main thread, never after a parallel region
(the preload imports and builds on the meta device; it computes nothing). Requests and answers are
JSON lines on its stdin and stdout: ``{"id", "call", "args", "env", "log", "cwd"}`` in, ``{"id",
"pid"}`` once the child has its session, then ``{"exit": pid, "code": returncode}`` when it ends
(a signal as its negative number, like :attr:`subprocess.Popen.returncode`). A child whose end the server
never reported because the server died first is :attr:`Forked.lost`: its group is killed and its own exit
status is unknown, so its caller runs it again the ordinary way rather than judge it by a SIGKILL that
was the server's fate, not the child's. May import: the standard library and :mod:`paci_tune.base.processes`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .processes import die_with_parent, kill_group, start_in_group

LATE_ENV = frozenset({"OMP_NUM_THREADS"})
"""Variables a forked child may have different from the server: read by the child itself after the fork
(the trial sets torch's threads from it). Others (glibc's tunables, ``LD_PRELOAD``, ``PYTHON*``) are read
when a process starts, so a request that changes them is not forked."""

READY_TIMEOUT_S = 120.0


def _resolve(call: str) -> Callable[..., Any]:
    module, _, name = call.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _child(request: dict[str, Any], ready: int) -> None:
    """In the forked child: become a process of its own, run the call, exit with its code (never returns)."""
    code = 1
    try:
        os.setsid()
        die_with_parent(sig=signal.SIGTERM, parent=os.getppid())
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdio
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.write(ready, b"1")
        os.close(ready)
        result = _resolve(request["call"])(*request["args"])
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fork(request: dict[str, Any]) -> int:
    """Fork a child for ``request``; return its pid once it is in its own session."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(request, w)
    os.close(w)
    os.read(r, 1)  # the child is its own group leader now (or has died trying: EOF)
    os.close(r)
    return pid


def serve(preload: str) -> None:
    """The server's loop: preload, say ready, fork on request, report each child's end; stop at EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what a Ctrl-C stops
    _resolve(preload)()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    stdin = sys.stdin.buffer
    pending = b""
    open_ = True
    children: set[int] = set()
    while open_ or children:
        readable, _, _ = select.select([stdin] if open_ else [], [], [], 0.1)
        if readable:
            chunk = os.read(stdin.fileno(), 65536)
            open_ = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    request = json.loads(line)
                    pid = _fork(request)
                    children.add(pid)
                    out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
        if not open_:  # the parent is gone or done: what still runs is killed, as its parent-death signal would
            for pid in children:
                kill_group(pid)


class Forked:
    """A child the server forked, with the part of :class:`subprocess.Popen` that :class:`.processes.Child` uses."""

    def __init__(self, server: Zygote, pid: int) -> None:
        self.server, self.pid = server, pid
        self.stdin: IO[str] | None = None

    def poll(self) -> int | None:
        return self.server.returncode(self.pid)

    @property
    def lost(self) -> bool:
        """It ended because the server died before telling its end (its exit status unknown; its group
        killed): not its own failure."""
        return self.server.lost(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait_for(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code


class Zygote:
    """The parent's side of one server (module docstring): started on first use, shut by :meth:`close`.

    Thread-safe: the search's lanes start trials from several threads. If the server cannot start or
    dies, :meth:`spawn` returns None from then on and the caller starts its child the ordinary way.
    """

    def __init__(self, preload: str, env: dict[str, str], log: Path) -> None:
        self.preload, self.env, self.log = preload, dict(env), log
        self._proc: subprocess.Popen[str] | None = None
        self._broken = False
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._next_id = 0
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> return code
        self._live: set[int] = set()
        self._lost: set[int] = set()  # pids the server died before reporting (module docstring)
        self._reader: threading.Thread | None = None

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a child with environment ``env`` can be forked here (it differs only in :data:`LATE_ENV`)."""
        keys = (set(env) | set(self.env)) - LATE_ENV
        return not self._broken and all(env.get(k) == self.env.get(k) for k in keys)

    def _start(self) -> bool:
        if self._proc is not None or self._broken:
            return not self._broken
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as logf:
            self._proc = start_in_group(
                [sys.executable, "-m", "paci_tune.base.zygote", str(os.getpid()), self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=self.env,
            )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], READY_TIMEOUT_S)
        if not ready or self._proc.stdout.readline().strip() != "ready":
            self._fail()
            return False
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()
        return True

    def _fail(self) -> None:
        self._broken = True
        if self._proc is not None:
            kill_group(self._proc.pid)
            self._proc.wait()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # a line cut short: the server died while writing it
                break
            with self._changed:
                if "exit" in msg:
                    self._codes[msg["exit"]] = msg["code"]
                    self._live.discard(msg["exit"])
                else:
                    self._pids[msg["id"]] = msg["pid"]
                    self._live.add(msg["pid"])
                self._changed.notify_all()
        with self._changed:  # the server is gone: its children go with it (their parent-death signal, and ours)
            self._broken = True
            for pid in self._live:
                # SIGKILL, not only the parent-death SIGTERM: a caller that runs the child again must not
                # have the first one still writing the same files.
                kill_group(pid)
                self._codes.setdefault(pid, -signal.SIGKILL)
                self._lost.add(pid)
            self._live.clear()
            self._changed.notify_all()

    def spawn(self, call: str, args: list[str], env: dict[str, str], log: Path) -> Forked | None:
        """Fork ``call(*args)`` with ``env`` and its output in ``log``; None where it cannot be forked here."""
        with self._lock:
            if not self.forks(env) or not self._start():
                return None
            assert self._proc is not None and self._proc.stdin is not None
            rid, self._next_id = self._next_id, self._next_id + 1
            request = {"id": rid, "call": call, "args": args, "env": env, "log": str(log), "cwd": os.getcwd()}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except OSError:
                self._fail()
                return None
        with self._changed:
            self._changed.wait_for(lambda: rid in self._pids or self._broken)
            pid = self._pids.pop(rid, None)
        return None if pid is None else Forked(self, pid)

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._codes.get(pid)

    def lost(self, pid: int) -> bool:
        """The child ``pid`` ended with the server, its own exit status never reported (:attr:`Forked.lost`)."""
        with self._changed:
            return pid in self._lost

    def wait_for(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server (it kills what still runs: the runners have ended their children); a later
        :meth:`spawn` starts a new one."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._broken = True
        if proc is None:
            self._broken = False
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        with self._changed:
            self._reader, self._broken = None, False
            self._pids.clear()
            self._codes.clear()
            self._lost.clear()


if __name__ == "__main__":
    die_with_parent(parent=int(sys.argv[1]))
    serve(sys.argv[2])
