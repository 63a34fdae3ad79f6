"""No file paci-tune is handed runs code, or reaches a storage, the user did not choose.

best.yaml is the file people send each other: ``apply`` (``--dry-run`` included) imports the model it
names only when ``--trust-entry`` names the same one (paci_tune/tune/trust.py), and ``report`` opens the
storage it names only when the user names it or it is the search's own file beside it
(paci_tune/report/gather.py). Each case runs the real command line in a subprocess on a best.yaml
whose model is code with a visible effect -- ``subprocess:getoutput`` writing a file, or a module that
writes one when imported -- and whose storage is a folder that does not exist or a server on a local
port this test listens on; the oracle is that nothing of it happens: no file, no folder, no connection.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO
from helpers.broken import BEST
from helpers.cli import cli_env
from helpers.configs import merge
from helpers.guide_models import SMALL

GUIDE_ENTRY = "helpers.guide_models:build"


def _env(*paths: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment with ``paths`` (and the tests' helpers) importable, PACI_TUNE_STORAGE unset."""
    env = cli_env()
    env.pop("PACI_TUNE_STORAGE", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _cli(folder: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m paci_tune.cli ARGS`` in ``folder``; it must end within a minute (refusals take seconds)."""
    cmd = [sys.executable, "-m", "paci_tune.cli", *args]
    return subprocess.run(cmd, cwd=folder, env=env or _env(), capture_output=True, text=True, timeout=120)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts)


def _write_best(folder: Path, run: dict[str, Any] | None = None, **top: Any) -> Path:
    """helpers.broken's valid best.yaml with keys of ``run``'s sections (its whole model) and top-level keys
    replaced."""
    doc = copy.deepcopy(BEST)
    doc["run"] = _with_run(doc["run"], run or {})
    doc.update(top)
    path = folder / "best.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _with_run(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``run`` merged in, its ``model`` whole: one model is a preset or an entry, never both."""
    out = merge(base, run)
    if "model" in run:
        out["model"] = copy.deepcopy(run["model"])
    return out


def _hostile(folder: Path, how: str) -> tuple[dict[str, Any], Path]:
    """A ``model:`` section whose entry, once imported or called, writes ``folder/out/FILE``; and that path."""
    out = folder / "out"
    out.mkdir()
    marker = out / "FILE"
    if how == "call":  # the reviewer's case: a standard-library function, called with best.yaml's kwargs
        return {"entry": "subprocess:getoutput", "block_size": 8, "kwargs": {"cmd": f"id > {marker}"}}, marker
    (out / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\ndef build():\n    return []\n")
    return {"entry": "evil:build", "block_size": 8}, marker


def _refused(proc: subprocess.CompletedProcess[str], key: str, value: str) -> None:
    """Exit 2 with one line naming the key, the value and the flag to pass."""
    line = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"error: {key}: got '{value}'" in line and f"--trust-entry {value}" in line, line


@pytest.mark.parametrize("how", ["call", "import"])
@pytest.mark.parametrize("command", [["--dry-run"], ["--no-live"]], ids=["dry-run", "train"])
def test_apply_imports_no_entry_a_best_yaml_alone_names(tmp_path: Path, how: str, command: list[str]) -> None:
    model, marker = _hostile(tmp_path, how)
    _write_best(tmp_path, {"model": model})
    before = _files(tmp_path)
    start = time.monotonic()
    proc = _cli(tmp_path, "apply", "best.yaml", *command, env=_env(marker.parent))
    assert time.monotonic() - start < 60
    assert not marker.exists(), "the model best.yaml names ran"
    assert _files(tmp_path) == before, "apply wrote something before refusing"
    _refused(proc, "best.yaml.run.model.entry", model["entry"])


def test_apply_imports_no_entry_of_the_warm_up_a_best_yaml_names(tmp_path: Path) -> None:
    """A built-in model's run, warm-started from a warm-up (not here) whose model is code: apply would train
    that warm-up first; it is refused like the run's own entry."""
    model, marker = _hostile(tmp_path, "import")
    gone = tmp_path / "gone" / "batch_00000004"
    warm_run = _with_run(BEST["run"], {"model": model, "training": {"steps": 4, "checkpoint_dir": str(gone.parent)}})
    warm = {"note": "warmed", "checkpoint": str(gone), "step": 4, "source": "warm-up", "val_loss": 3.9, "run": warm_run}
    _write_best(tmp_path, {"training": {"init_from": str(gone)}}, warm_start=warm)
    proc = _cli(tmp_path, "apply", "best.yaml", "--no-live", "--clock", "wall", env=_env(marker.parent))
    assert not marker.exists() and not (tmp_path / "best-warm-start").exists()
    _refused(proc, "best.yaml.warm_start.run.model.entry", "evil:build")


def test_apply_runs_the_entry_the_command_line_names(tmp_path: Path) -> None:
    """The guide's model (tests/helpers/guide_models.py) applied with --trust-entry naming it: the dry run
    writes the run, the run trains; another entry named is refused, naming both."""
    _write_best(tmp_path, {"model": {"entry": GUIDE_ENTRY, "kwargs": SMALL, "block_size": SMALL["block_size"]}})
    other = _cli(tmp_path, "apply", "best.yaml", "--dry-run", "--trust-entry", "helpers.guide_models:build_tuple")
    _refused(other, "best.yaml.run.model.entry", GUIDE_ENTRY)
    assert "--trust-entry names 'helpers.guide_models:build_tuple'" in " ".join(other.stderr.split())
    assert _files(tmp_path) == ["best.yaml"]
    trusted = ("--trust-entry", GUIDE_ENTRY, "--clock", "wall", "--steps", "2")
    dry = _cli(tmp_path, "apply", "best.yaml", "--dry-run", *trusted)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "best.run.yaml").read_text())["model"]["entry"] == GUIDE_ENTRY
    ran = _cli(tmp_path, "apply", "best.yaml", "--no-live", "--metrics", "m.jsonl", *trusted)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert '"event": "summary"' in (tmp_path / "m.jsonl").read_text()


def test_report_opens_no_storage_and_imports_nothing_a_best_yaml_names(tmp_path: Path) -> None:
    """A SQLite file in a folder that does not exist: nothing is created, the report is best.yaml's alone and
    says which storage it did not open; the model best.yaml names is not imported."""
    model, marker = _hostile(tmp_path, "import")
    url = f"sqlite:///{tmp_path / 'new' / 'dir' / 'x.db'}"
    _write_best(tmp_path, {"model": model}, provenance={"study_name": "run", "storage": url})
    proc = _cli(tmp_path, "report", "best.yaml", "--out", "rep", env=_env(marker.parent))
    assert not (tmp_path / "new").exists() and not marker.exists()
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = next(ln for ln in proc.stderr.splitlines() if ln.startswith("note: "))
    assert url in note and f"--storage {url}" in note
    assert (tmp_path / "rep" / "index.html").is_file()


def test_report_creates_no_storage_it_is_given(tmp_path: Path) -> None:
    """--storage or PACI_TUNE_STORAGE naming a SQLite or journal file that is not there: exit 2 naming it, and
    neither the file nor its folder is made."""
    _write_best(tmp_path)
    for url, key in (
        (f"sqlite:///{tmp_path / 'a' / 'x.db'}", "--storage"),
        (f"journal:///{tmp_path / 'b' / 'x.log'}", "--storage"),
        (str(tmp_path / "c" / "x.log"), "PACI_TUNE_STORAGE"),
    ):
        env = {"PACI_TUNE_STORAGE": url} if key == "PACI_TUNE_STORAGE" else {}
        args = ["report", "best.yaml", "--out", "rep"] + ([] if env else ["--storage", url])
        proc = _cli(tmp_path, *args, env=_env(**env))
        assert _files(tmp_path) == ["best.yaml"], f"{url}: the report created it"
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"error: {key}: got '{url}'" in " ".join(proc.stderr.split())


def test_report_sends_no_password_to_the_server_a_best_yaml_names(tmp_path: Path) -> None:
    """best.yaml names a PostgreSQL server (here: a socket this test listens on) and PGPASSWORD is set, as the
    README tells users to: the report connects nowhere."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.settimeout(0.5)
        url = f"postgresql://paci@127.0.0.1:{server.getsockname()[1]}/paci"
        _write_best(tmp_path, provenance={"study_name": "run", "storage": url})
        proc = _cli(tmp_path, "report", "best.yaml", "--out", "rep", env=_env(PGPASSWORD="secret"))
        with pytest.raises(TimeoutError):
            server.accept()  # nothing knocked
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--storage {url}" in proc.stderr
