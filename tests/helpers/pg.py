"""A throwaway PostgreSQL server on loopback for the multi-worker storage test.

``.ci/run`` starts one and exports its URL as ``PACI_TUNE_POSTGRES_URL``; without that, the test
starts its own here from the binaries under ``/usr/lib/postgresql/*/bin`` (as the ``postgres`` user
when run as root: the server refuses to run as root), in a temporary folder that is removed after.
``None`` from :func:`server` means no server can be had here (no binaries): the test skips and says so.
``server(password=...)`` starts one that requires it (SCRAM), for the credentials test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

ENV = "PACI_TUNE_POSTGRES_URL"


def binaries() -> Path | None:
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0
    )
    return found[-1].parent if found else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A PostgreSQL server of our own: its URL, and stop/start to take it away mid-search and back."""

    def __init__(self, bin_dir: Path, root: Path, as_user: list[str], port: int, password: str | None = None) -> None:
        self.bin_dir, self.root, self.as_user, self.port, self.password = bin_dir, root, as_user, port, password
        self.data = root / "data"
        secret = f":{quote(password, safe='')}" if password else ""
        self.url = f"postgresql+psycopg://postgres{secret}@127.0.0.1:{port}/paci"

    def run(self, *cmd: str) -> None:
        env = {**os.environ, "PGPASSWORD": self.password} if self.password else None
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, timeout=120, cwd=self.root, env=env)

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=50"
        self.run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "start",
        )

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: as if the server crashed (no clean shutdown of the sessions)."""
        self.run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def server(password: str | None = None) -> Server | None:
    """A fresh running server with an empty database ``paci``; None without binaries. With ``password``
    every connection must give it (SCRAM), the superuser ``postgres``'s."""
    bin_dir = binaries()
    if bin_dir is None:
        return None
    root = Path(tempfile.mkdtemp(prefix="paci-pg-"))  # not under pytest's 0700 folder: postgres must enter it
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    srv = Server(bin_dir, root, as_user, _port(), password)
    auth = ["-A", "trust"]
    if password:
        pwfile = root / "pwfile"
        pwfile.write_text(password + "\n")
        if as_user:
            shutil.chown(pwfile, "postgres", "postgres")
        auth = ["-A", "scram-sha-256", f"--pwfile={pwfile}"]
    srv.run(str(bin_dir / "initdb"), "-D", str(srv.data), "-U", "postgres", *auth, "--no-sync")
    srv.start()
    srv.run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres", "paci")
    return srv
