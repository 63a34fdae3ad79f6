"""No process paci-tune starts imports code from the folder a user runs it in.

``python -m`` and ``-c`` put the working folder first on ``sys.path``: a ``yaml.py`` there would run in
every trial, fork server, torchrun worker and calibration rank. The oracle is the file system: the
planted module writes a marker file when anything imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import cli_env
from helpers.configs import make_config, write_config

from paci_tune.base.processes import Child, child_environment
from paci_tune.base.zygote import Zygote


def _plant(folder: Path) -> Path:
    """A ``yaml.py`` in ``folder`` that leaves a marker when imported (and then breaks ``import yaml``)."""
    marker = folder / "IMPORTED"
    (folder / "yaml.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\nraise ImportError('planted')\n")
    return marker


def test_a_child_and_a_forked_child_do_not_import_from_their_working_folder(tmp_path: Path, monkeypatch) -> None:
    marker = _plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = "import yaml, sys; print(yaml.__file__, file=sys.stderr)"
    with Child([sys.executable, "-c", code], log=tmp_path / "child.log", events=tmp_path / "ev.jsonl") as child:
        assert child.wait(timeout=60) == 0, (tmp_path / "child.log").read_text()
    assert not marker.exists()
    env = child_environment(os.environ)
    with Zygote("os:getpid", env, tmp_path / "server.log") as server:  # started here: its cwd is the planted folder
        forked = server.spawn("yaml:safe_load", ["a: 1"], env, tmp_path / "forked.log")
        assert forked is not None and forked.wait(timeout=60) == 0, (tmp_path / "forked.log").read_text()
    assert not marker.exists()


@pytest.mark.slow
def test_a_distributed_run_started_in_a_folder_with_a_yaml_py_imports_none_of_it(tmp_path: Path) -> None:
    """torchrun and its stage workers (grandchildren) run with the user's folder as their working folder."""
    marker = _plant(tmp_path)
    config = write_config(tmp_path, make_config(training={"steps": 2}))
    script = Path(sys.executable).with_name("paci-tune")  # the console script, as a user runs it
    cmd = [str(script), "train", str(config), "--runtime", "distributed", "--no-live"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
