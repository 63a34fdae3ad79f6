"""Two ``paci-tune search`` workers on one PostgreSQL study: no trial lost, none run twice.

Oracle: the database itself, read back with Optuna after both workers have exited, and the trial
folders on disk (one per fresh trial). The server is ``.ci/run``'s (``PACI_TUNE_POSTGRES_URL``) or
one started here (:mod:`pg`); the test skips, saying why, without PostgreSQL binaries or psycopg.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import REPO, cli_env
from optuna.trial import TrialState
from pg import ENV, start
from test_search import search_cmd, write_search

from paci_tune.tune.study import counted

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'paci-tune[postgres]'")
    if os.environ.get(ENV):
        yield os.environ[ENV]
        return
    server = start()
    if server is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin (and no PACI_TUNE_POSTGRES_URL)")
    url, stop = server
    try:
        yield url
    finally:
        stop()


def test_two_workers_share_one_postgres_study(tmp_path: Path, postgres_url: str) -> None:
    config = write_search(tmp_path, search={"trials": 2})
    name = f"pg-{os.getpid()}-{tmp_path.name}"  # a fresh study even on a server shared with other runs
    cmds = [search_cmd(config, tmp_path, "--storage", postgres_url, "--study-name", name,
                       "--out", str(tmp_path / f"best{i}.yaml")) for i in range(2)]  # fmt: skip
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]  # fmt: skip
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    workers = set()
    for s in ("paci", "1f1b"):
        st = optuna.load_study(study_name=f"{name}.{s}", storage=postgres_url)
        numbers = [t.number for t in st.trials]
        assert numbers == list(range(len(numbers))), "trial numbers must be unique and contiguous"
        assert not [t for t in st.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], "a trial was lost"
        assert 2 <= counted(st.trials, 2) <= 3  # at most (workers - 1) extra from a race at the very end
        fresh = [t for t in st.trials if "repeat_of" not in t.user_attrs]
        dirs = sorted(p.name for p in (tmp_path / "work" / "trials" / f"{name}.{s}").iterdir())
        assert dirs == [f"trial-{t.number:04d}" for t in sorted(fresh, key=lambda t: t.number)], "each trial ran once"
        workers |= {t.user_attrs["worker"]["pid"] for t in st.trials}
    assert workers == {p.pid for p in procs}, "both workers ran trials"
    b0, b1 = (yaml.safe_load((tmp_path / f"best{i}.yaml").read_text()) for i in range(2))
    assert b0["recommended"] == b1["recommended"]
