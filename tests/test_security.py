"""Trust boundaries: no file paci-tune loads runs code, and no password leaves the process that opens the storage.

Oracles: the file system (the marker file a pickled payload creates when it is unpickled -- shown
live first with torch's unsafe loader), the run that wrote the fixture checkpoints before loading
became weights-only (``tests/data/checkpoints``, its losses recorded beside them), SQLAlchemy's own
URL parser, the operating system (the command line and environment of every process the search
started, read from ``/proc`` while it runs) and a real PostgreSQL server that requires the password,
so a storage opened without it is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO
from helpers.cli import cli_env, run_cli, run_in_process, train_losses
from helpers.searches import search_cmd, write_search

from paci_tune.base.credentials import STORAGE_ENV, remember, scrub, shown, without_password, without_storage
from paci_tune.errors import ConfigError
from paci_tune.train import checkpoint

FIXTURES = REPO / "tests" / "data" / "checkpoints"


# ------------------------------------------------------------------------------------------ checkpoints
class _Payload:
    """Unpickled, it creates ``marker``: what a crafted checkpoint would run instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _crafted(tmp: Path, marker: Path) -> Path:
    """A copy of the fp32 fixture's checkpoint root whose ``stage_0.pt`` also carries a :class:`_Payload`."""
    root = tmp / "crafted"
    shutil.copytree(FIXTURES / "paci-fp32" / "ckpt", root)
    stage = root / "batch_00000002" / "stage_0.pt"
    state = torch.load(stage, weights_only=True)
    state["extra"] = _Payload(marker)
    torch.save(state, stage)
    return root


def test_the_crafted_payload_is_live(tmp_path: Path) -> None:
    """The oracle works: torch's unsafe loader runs the payload (so its marker's absence below means refusal)."""
    marker = tmp_path / "ran"
    root = _crafted(tmp_path, tmp_path / "ran")
    torch.load(root / "batch_00000002" / "stage_0.pt", weights_only=False)
    assert marker.exists()


def _refused(proc: subprocess.CompletedProcess[str], key: str, path: Path, marker: Path) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: {key}: got '{path}'"), lines[0]
    assert "never contains" in lines[0] and "posix.system" in lines[0], lines[0]
    assert not marker.exists(), "the payload ran"


@pytest.mark.slow
@pytest.mark.parametrize("route", ["init_from", "resume", "warm_start"])
def test_a_checkpoint_that_would_run_code_is_refused_before_any_work(tmp_path: Path, route: str) -> None:
    marker = tmp_path / "ran"
    root = _crafted(tmp_path, marker)
    stage = root / "batch_00000002" / "stage_0.pt"
    run_yaml = FIXTURES / "paci-fp32" / "run.yaml"
    if route == "init_from":
        proc = run_cli(run_yaml, "--init-from", root, "--checkpoint-dir", tmp_path / "new")
        _refused(proc, "training.init_from", stage, marker)
    elif route == "resume":
        _refused(run_cli(run_yaml, "--checkpoint-dir", root, "--resume"), "--resume", stage, marker)
    else:
        config = write_search(tmp_path, search={"warm_start": {"checkpoint": str(root)}})
        proc = subprocess.run(
            search_cmd(config, tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env=cli_env(),
            check=False,
        )
        _refused(proc, "search.warm_start.checkpoint", stage, marker)
        assert not (tmp_path / "work" / "study.db").exists(), "the storage was opened before the refusal"


def test_the_loaders_themselves_refuse_it(tmp_path: Path) -> None:
    """Past the up-front check (a file swapped in later, a worker reading it): every load is weights-only."""
    marker = tmp_path / "ran"
    root = _crafted(tmp_path, marker)
    folder = root / "batch_00000002"
    with pytest.raises(ConfigError, match="never contains"):
        checkpoint.units_of(folder)  # --init-from and warm starts (resharded)
    with pytest.raises(ConfigError, match="never contains"):
        checkpoint.load(root, [0, 1])  # --resume
    with pytest.raises(ConfigError, match=r"posix\.system"):
        checkpoint.check_files(folder, "training.init_from")
    assert not marker.exists()


def test_a_stage_file_torch_did_not_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "paci-fp32" / "ckpt", root)
    stage = root / "batch_00000002" / "stage_1.pt"
    stage.write_bytes(stage.read_bytes()[:100])  # truncated
    with pytest.raises(ConfigError, match=r"not a file torch\.save wrote") as e:
        checkpoint.check_files(root / "batch_00000002", "training.init_from")
    assert e.value.value == str(stage)


@pytest.mark.parametrize("fixture", ["paci-fp32", "1f1b-bf16"])
@pytest.mark.parametrize("route", ["init_from", "resume"])
def test_checkpoints_written_before_weights_only_loading_continue_the_run_that_wrote_them(
    tmp_path: Path, fixture: str, route: str
) -> None:
    """The fixtures (PACI in fp32 with its drift state; 1F1B in bf16 with fp32 masters) were written at
    step 2 of a 4-step run; from them, steps 3 and 4 give that run's losses."""
    here = FIXTURES / fixture
    doc = yaml.safe_load((here / "run.yaml").read_text())
    want = json.loads((here / "uninterrupted.json").read_text())
    root = tmp_path / "ckpt"
    shutil.copytree(here / "ckpt", root)
    if route == "init_from":
        doc["training"].update(init_from=str(root), checkpoint_dir=str(tmp_path / "new"))
        records = run_in_process(doc)
        got = {r["step"]: r["loss"] for r in records if r.get("event") == "train"}
    else:
        doc["training"]["checkpoint_dir"] = str(root)
        got = dict(enumerate(train_losses(run_in_process(doc, resume=True)), 1))
    tol = 1e-5 if "fp32" in fixture else 2e-3  # bf16: another CPU's kernels may round a product differently
    for step in (3, 4):
        assert got[step] == pytest.approx(want["train_loss"][str(step)], rel=tol, abs=tol), (step, got)


def test_a_checkpoint_of_the_old_draw_resumes_only_a_run_that_draws_as_it_did(tmp_path: Path) -> None:
    """The fixtures predate ``data.draw`` (they drew micro-batches, the default): resuming one with
    ``draw: sequence`` would silently change the data mid-run, so it is refused naming ``data.draw``;
    starting a new run from its weights (``init_from``) reads no data of it and is allowed."""
    here = FIXTURES / "paci-fp32"
    doc = yaml.safe_load((here / "run.yaml").read_text())
    doc["data"]["draw"] = "sequence"
    root = tmp_path / "ckpt"
    shutil.copytree(here / "ckpt", root)
    doc["training"]["checkpoint_dir"] = str(root)
    with pytest.raises(ConfigError, match=r"data\.draw: checkpoint has 'microbatch', this run has 'sequence'"):
        run_in_process(doc, resume=True)
    doc["training"].update(init_from=str(root), checkpoint_dir=str(tmp_path / "new"))
    assert [r["step"] for r in run_in_process(doc) if r.get("event") == "train"] == [3, 4]


# ------------------------------------------------------------------------------------------ credentials
URLS = [
    "postgresql+psycopg://u:p%40ss%2Fw%3Ard@127.0.0.1:5432/db",
    "postgresql://user:plain@db.example:6543/paci?sslmode=require",
    "mysql+pymysql://root:pw@h/db",
    "postgresql://u@h/db",
    "sqlite:////tmp/x.db",
]


@pytest.mark.parametrize("url", URLS)
def test_a_url_is_shown_and_kept_as_sqlalchemy_reads_it_without_its_password(url: str) -> None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    assert shown(url) == parsed.render_as_string(hide_password=True)
    kept = make_url(without_password(url))
    assert kept.password is None
    assert (kept.drivername, kept.username, kept.host, kept.port, kept.database, dict(kept.query)) == (
        parsed.drivername,
        parsed.username,
        parsed.host,
        parsed.port,
        parsed.database,
        dict(parsed.query),
    )


def test_a_password_in_the_query_is_hidden_too_and_scrubbed_wherever_it_turns_up() -> None:
    url = "postgresql://u@h/db?password=q%26z-secret&sslmode=require"
    assert "secret" not in shown(url) and "secret" not in without_password(url)
    assert "sslmode=require" in without_password(url)
    remember("postgresql://u:Zx9-remembered%40@h/db")
    text = "driver said: could not connect to postgresql://u:Zx9-remembered%40@h/db (Zx9-remembered@)"
    assert "Zx9" not in scrub(text)


def test_no_child_process_gets_the_storage_url(tmp_path: Path) -> None:
    from paci_tune.base.processes import Child

    assert STORAGE_ENV not in without_storage({STORAGE_ENV: "postgresql://u:pw@h/db", "A": "1"})
    code = f"import os, sys; sys.stdout.write(os.environ.get({STORAGE_ENV!r}, 'absent'))"
    env = {**os.environ, STORAGE_ENV: "postgresql://u:pw@h/db"}
    with Child([sys.executable, "-c", code], log=tmp_path / "log", events=tmp_path / "events", env=env) as child:
        while child.running:
            time.sleep(0.05)
    assert (tmp_path / "log").read_text() == "absent"


def test_nothing_in_the_package_unpickles() -> None:
    """Static: every torch.load is weights-only, and the ranks share records as JSON, not pickles."""
    pkg = REPO / "paci_tune"
    for f in pkg.rglob("*.py"):
        text = f.read_text()
        for needle in (
            "weights_only=False",
            "pickle.load",
            "all_gather_object(",
            "broadcast_object_list(",
            "recv_object_list(",
            "yaml.unsafe_load",
            "yaml.full_load",
            "np.load(",
        ):
            assert needle not in text, f"{f.relative_to(REPO)} uses {needle}"
        for line in text.splitlines():
            if "yaml.load(" in line:
                assert "Loader=_SAFE_LOADER" in line, f"{f.relative_to(REPO)}: {line.strip()}"
        if "torch.load(" in text:
            assert f.relative_to(pkg).as_posix() == "train/checkpoint.py", f
    from paci_tune.base import files

    assert not issubclass(files._SAFE_LOADER, yaml.constructor.FullConstructor), "YAML is read with a safe loader"


# ------------------------------------------------------------------------------------------ PostgreSQL
PASSWORD = "Sec/ret:p@ss%word-7f3a"
HTML_NAME = "<img src=x onerror=alert(1)>"


def _forms(password: str) -> list[str]:
    from urllib.parse import quote

    return [password, quote(password, safe="")]


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                status = (p / "status").read_text()
            except OSError:
                continue
            ppid = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("PPid:")), 0)
            parents[int(p.name)] = ppid
    out, frontier = [], {root}
    while frontier:
        kids = {pid for pid, pp in parents.items() if pp in frontier}
        out += sorted(kids)
        frontier = kids
    return out


def _read(pid: int, what: str) -> str:
    try:
        return (Path("/proc") / str(pid) / what).read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _clean(text: str, where: str) -> None:
    for form in _forms(PASSWORD):
        assert form not in text, f"the password is in {where}"


@pytest.fixture
def password_server():
    from helpers.pg import server

    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'paci-tune[postgres]'")
    srv = server(password=PASSWORD)
    if srv is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
    try:
        yield srv
    finally:
        srv.remove()


@pytest.mark.slow
def test_a_search_on_postgresql_never_shows_writes_or_hands_on_its_password(tmp_path: Path, password_server) -> None:
    from sqlalchemy.engine import make_url

    url = password_server.url
    config = write_search(tmp_path, search={"trials": 2})
    cmd = search_cmd(config, tmp_path, "--storage", url, "--study-name", HTML_NAME)
    env = cli_env()
    env.pop("PGPASSWORD", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        while proc.poll() is None:  # every process the search started, while it runs
            for pid in _descendants(proc.pid):
                seen.add(pid)
                _clean(_read(pid, "cmdline"), f"the command line of process {pid}")
                _clean(_read(pid, "environ"), f"the environment of process {pid}")
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert len(seen) >= 2, "no trial process was seen running"
    _clean(out + err, "the search's output")
    assert "***" in err, "the opening line shows the URL with its password hidden"
    best = tmp_path / "best.yaml"
    _clean(best.read_text(), "best.yaml")
    kept = make_url(yaml.safe_load(best.read_text())["provenance"]["storage"])
    assert kept.password is None and (kept.host, kept.port, kept.database) == (
        "127.0.0.1",
        password_server.port,
        "paci",
    )
    for f in (tmp_path / "work").rglob("*"):
        if f.is_file():
            _clean(f.read_bytes().decode(errors="replace"), str(f))

    # The URL in the environment instead of on the command line: the same search resumes (nothing left to run).
    again = subprocess.run(
        search_cmd(config, tmp_path, "--study-name", HTML_NAME),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, STORAGE_ENV: url},
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    _clean(again.stdout + again.stderr, "the resumed search's output")

    def report(out: str, extra_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "paci_tune.cli", "report", str(best), "--out", str(tmp_path / out), *args]
        return subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**env, **extra_env}, check=False
        )

    # best.yaml alone opens no server (its author's choice, not the user's): libpq's password goes nowhere.
    stored = yaml.safe_load(best.read_text())["provenance"]["storage"]
    alone = report("rep0", {"PGPASSWORD": PASSWORD})
    assert alone.returncode == 0 and f"--storage {stored}" in alone.stderr, alone.stderr[-2000:]
    named = (("rep1", {STORAGE_ENV: url}, ()), ("rep2", {"PGPASSWORD": PASSWORD}, ("--storage", stored)))
    for out, extra, args in named:  # ours (naming best.yaml's storage), then libpq's for the storage named
        rep = report(out, extra, *args)
        assert rep.returncode == 0, rep.stderr[-3000:]
        _clean(rep.stdout + rep.stderr, f"the report's output ({out})")
        for f in (tmp_path / out).rglob("*"):
            _clean(f.read_bytes().decode(errors="replace"), str(f))
        page = (tmp_path / out / "index.html").read_text()
        assert "&lt;img src=x onerror=alert(1)&gt;" in page, "the study name is shown, escaped"
        assert HTML_NAME not in page, "the study name's HTML reached the page"


def test_a_report_page_escapes_what_users_named(tmp_path: Path) -> None:
    from paci_tune.report.page import write_page
    from paci_tune.report.summary import Table

    evil = "<script>alert(1)</script>"
    page = write_page(
        tmp_path / "index.html", title=evil, verdict=evil, tables=[Table(evil, [evil], [[evil]])], pictures=[]
    ).read_text()
    assert "<script>" not in page and page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 6


def test_a_distributed_launch_keeps_to_loopback() -> None:
    from paci_tune.base.processes import loopback_env
    from paci_tune.train.launch import torchrun_command

    cmd = torchrun_command(Path("run.yaml"), 2)
    assert "--standalone" not in cmd and "--rdzv-backend=static" in cmd and "--master-addr=127.0.0.1" in cmd
    if Path("/sys/class/net/lo").exists():
        assert loopback_env({})["GLOO_SOCKET_IFNAME"] == "lo"
    assert loopback_env({"GLOO_SOCKET_IFNAME": "eth9"})["GLOO_SOCKET_IFNAME"] == "eth9"


# ------------------------------------------------------------------------------------------ the torch floor
def test_the_torch_floor_is_one_whose_weights_only_loader_has_no_known_bypass() -> None:
    """torch <= 2.5.1's weights-only loader can be made to run code (CVE-2025-32434), < 2.10's to corrupt
    memory; 2.4 lacks the pickle scan every ``--init-from`` runs first. The floor and the README agree."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(r for r in map(Requirement, deps) if r.name == "torch").specifier
    assert not any(spec.contains(v) for v in ("2.4.0", "2.5.1", "2.9.1")) and spec.contains("2.10.0")
    assert spec.contains(torch.__version__.split("+")[0])
    assert hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint")
    assert "torch >= 2.10" in (REPO / "README.md").read_text()
