"""A throwaway PostgreSQL server on loopback for the multi-worker storage test.

``.ci/run`` starts one and exports its URL as ``PACI_TUNE_POSTGRES_URL``; without that, the test
starts its own here from the binaries under ``/usr/lib/postgresql/*/bin`` (as the ``postgres`` user
when run as root: the server refuses to run as root), in a temporary folder that is removed after.
``None`` from :func:`start` means no server can be had here (no binaries): the test skips and says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV = "PACI_TUNE_POSTGRES_URL"


def binaries() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]) if
                   p.parts[-3].isdigit() else 0)  # fmt: skip
    return found[-1].parent if found else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start() -> tuple[str, Callable[[], None]] | None:
    """(SQLAlchemy URL, stop) of a fresh server with an empty database ``paci``; None without binaries."""
    bin_dir = binaries()
    if bin_dir is None:
        return None
    root = Path(tempfile.mkdtemp(prefix="paci-pg-"))  # not under pytest's 0700 folder: postgres must enter it
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port, data = _port(), root / "data"

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120, cwd=root)

    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync")
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=50"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "server.log"), "-w", "start")
    run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "paci")

    def stop() -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)

    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/paci", stop
