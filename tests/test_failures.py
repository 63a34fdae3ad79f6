"""What is not bad input still ends in one line: the file system, the storage, Ctrl-C, bugs.

Exit code 1 (130 for Ctrl-C), one ``error:`` line naming what failed, no traceback unless
``--debug`` asks for it, and no half-written file left behind. The failures are real where that is
cheap (a storage file that is not a database, one of another schema version, a SIGINT to a real
training process) and injected where it is not (a full disk, a permission refused at write time).
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.broken import BEST, SMALL
from helpers.cli import cli_env, invoke_in
from helpers.configs import BASE_CONFIG, make_config


def _one_error_line(r: Any, code: int, *needles: str) -> str:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == code, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


@pytest.mark.parametrize(("err", "needle"), [(errno.ENOSPC, "disk is full"), (errno.EACCES, "ermission")])
def test_a_write_the_file_system_refuses_is_one_line_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, needle: str
) -> None:
    import paci_tune.base.files as files

    (tmp_path / "best.yaml").write_text(yaml.safe_dump(BEST, sort_keys=False))

    def refuse(src: str, dst: str) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files.os, "replace", refuse)
    r = invoke_in(tmp_path, ["apply", "best.yaml", "--dry-run"])
    _one_error_line(r, 1, "best.run.yaml", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.yaml"], "a temporary file was left behind"


def _search_folder(tmp_path: Path) -> Path:
    doc = {**SMALL, "search": {**SMALL["search"], "space": "cpu-small"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path


def test_a_storage_that_is_not_a_database(tmp_path: Path) -> None:
    folder = _search_folder(tmp_path)
    (folder / "junk.db").write_bytes(b"this is not sqlite" * 100)
    r = invoke_in(folder, ["search", "c.yaml", "--no-live", "--storage", f"sqlite:///{folder / 'junk.db'}"])
    _one_error_line(r, 1, "storage", "junk.db")
    assert not (folder / "best.yaml").exists()


def test_a_storage_of_another_schema_version(tmp_path: Path) -> None:
    folder = _search_folder(tmp_path)
    url = f"sqlite:///{folder / 'old.db'}"
    optuna.create_study(storage=url, study_name="other")
    with sqlite3.connect(folder / "old.db") as c:
        c.execute("UPDATE alembic_version SET version_num = 'v0.9.0.a'")
    r = invoke_in(folder, ["search", "c.yaml", "--no-live", "--storage", url])
    _one_error_line(r, 1, "old.db", "schema")


@pytest.mark.slow
def test_ctrl_c_in_a_search_is_130_and_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import paci_tune.tune.search as search
    import paci_tune.tune.setup as setup

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(search.Search, "run", interrupted)
    monkeypatch.setattr(setup, "profile_for", lambda *a, **k: None)  # nothing to measure before the loop
    r = invoke_in(_search_folder(tmp_path), ["search", "c.yaml", "--no-live"])
    _one_error_line(r, 130, "interrupted", "resume")


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import paci_tune.train.run as run

    def bug(*a: Any, **k: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(run, "resolve_run", bug)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(BASE_CONFIG))
    line = _one_error_line(invoke_in(tmp_path, ["train", "c.yaml", "--no-live"]), 1, "ValueError", "a bug")
    assert "--debug" in line
    r = invoke_in(tmp_path, ["--debug", "train", "c.yaml", "--no-live"])
    assert r.exit_code == 1 and "Traceback" in r.stderr and "a bug" in r.stderr
    r = invoke_in(tmp_path, ["--debug", "train", "missing.yaml"])
    assert r.exit_code == 2 and "Traceback" in r.stderr


def _reported_a_step(*files: Path) -> bool:
    return any("step" in f.read_text() for f in files)


@pytest.mark.slow
def test_sigint_to_a_real_training_exits_130_without_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(make_config(training={"steps": 100_000, "eval_every": 100_000})))
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        # Ctrl-C as at a terminal: a SIGINT ignored by whatever started pytest (a background job, nohup) must
        # not be inherited by the run, which would then rightly keep ignoring it.
        proc = subprocess.Popen(
            [sys.executable, "-m", "paci_tune", "train", str(config), "--no-live"],
            cwd=tmp_path,
            env=cli_env(),
            stdout=o,
            stderr=e,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and proc.poll() is None and not _reported_a_step(out, err):
                time.sleep(0.2)  # interrupt it mid-training, once a step has been reported
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # say where it hangs: the CLI dumps its stacks on SIGUSR1
                proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = out.read_text() + err.read_text()
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text
    assert [ln for ln in err.read_text().splitlines() if ln.strip()][-1].startswith("error: interrupted")
