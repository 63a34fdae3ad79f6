"""Advisory locks between processes: one writer per checkpoint folder, one calibration per profile.

A lock is ``flock`` on a lock file, so it dies with its holder (a crashed or SIGKILLed process
leaves no stale lock behind, unlike a pid file). The holder writes who it is -- host, pid, start
time -- into the file, so whoever is refused or waits can say whom it waits for. A file system
without ``flock`` (some NFS mounts) gives no lock at all rather than a crash: the holder is told
(:attr:`Lock.held` is False) and goes on unprotected, as before locks existed.

Within one process a lock is re-entrant (a count per path): ``flock`` on a second descriptor of
the same file would conflict with the process's own first one. May import: the standard library,
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from ..errors import Failure

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
"""What ``flock`` answers on a file system that does not support it: run without the lock."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its holder wrote it in the lock file (empty when not written yet)."""

    host: str = ""
    pid: int = 0
    since: str = ""

    def describe(self) -> str:
        if not self.pid:
            return "another process (it has not written its name yet)"
        return f"pid {self.pid} on host {self.host} (since {self.since})"

    def line(self) -> str:
        return f"{self.host} {self.pid} {self.since}\n"

    @classmethod
    def parse(cls, text: str) -> Holder:
        parts = text.split(maxsplit=2)
        try:
            return cls(parts[0], int(parts[1]), parts[2].strip()) if len(parts) == 3 else cls()
        except ValueError:
            return cls()

    @classmethod
    def me(cls) -> Holder:
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return cls(socket.gethostname(), os.getpid(), now)


class Lock:
    """A lock this process holds (or, on a file system without ``flock``, holds nothing: ``held`` False)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd, self._count = path, fd, 1

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let go (the last of this process's nested holds): the file is emptied, then unlocked."""
        self._count -= 1
        if self._count > 0:
            return
        _HELD.pop(self.path, None)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a stale name never outlives the hold
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_HELD: dict[Path, Lock] = {}
"""This process's holds by lock file, for re-entry."""


def holder(path: str | Path) -> Holder:
    """Who holds the lock at ``path`` by its file's word (empty: nobody wrote one)."""
    try:
        return Holder.parse(Path(path).read_text(errors="replace"))
    except OSError:
        return Holder()


def try_lock(path: str | Path) -> Lock | Holder:
    """The lock at ``path`` now, or who holds it; never waits. Creates the file (and its folder)."""
    p = Path(path).resolve()  # one key per file, however it is named (two descriptors would conflict)
    mine = _HELD.get(p)
    if mine is not None:
        mine._count += 1
        return mine
    fd = _open(p)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return holder(p)
        if e.errno in _UNSUPPORTED:
            lock = _HELD[p] = Lock(p, None)  # no flock here: go on without the lock (module docstring)
            return lock
        raise Failure(f"taking the lock {p}", e.strerror or str(e)) from e
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, Holder.me().line().encode(), 0)
    except OSError:
        pass  # the lock holds without the name; a refusal then says "another process"
    lock = _HELD[p] = Lock(p, fd)
    return lock


def _open(p: Path) -> int:
    """The lock file, created if need be; read-only when another user's (flock needs no write access:
    the lock holds, only the holder's name is not written)."""
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(p, os.O_RDWR | os.O_CREAT, 0o666)  # no O_TRUNC: the holder's name is in it
        except PermissionError:
            return os.open(p, os.O_RDONLY)
    except OSError as e:
        raise Failure(f"taking the lock {p}", e.strerror or str(e)) from e


def wait_lock(
    path: str | Path,
    *,
    timeout_s: float,
    on_wait: Callable[[Holder], None] | None = None,
    poll_s: float = 0.5,
) -> Lock:
    """The lock at ``path``, waiting up to ``timeout_s`` for its holder; ``on_wait(holder)`` once when it must wait.

    Raises :class:`~paci_tune.errors.Failure` naming the holder when the time runs out.
    """
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        got = try_lock(path)
        if isinstance(got, Lock):
            return got
        if not told and on_wait is not None:
            on_wait(got)
            told = True
        if time.monotonic() >= deadline:
            raise Failure(
                f"waiting for the lock {path}",
                f"{got.describe()} still holds it after {timeout_s:.0f} s (remove nothing: it is released "
                "when that process ends)",
            )
        time.sleep(poll_s)
