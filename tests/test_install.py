"""A non-editable install works from any folder: the wheel carries the shipped spaces and example.

Oracle: a wheel built from the source, installed (no editable hook, no ``PYTHONPATH``) into a fresh
virtual environment that sees the test's own site-packages for torch and Optuna only, run from a
folder outside the repository. The search there names its space ``cpu-small`` (package data) and
reads the README's ``examples/tiny-gpt.yaml`` from the package; the reduced budget is the example's
own file with a smaller budget and a hand-written reference profile (the rst clock), so nothing is
measured.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO
from helpers.cli import cpu_threads
from helpers.profiles import reference_profile

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("OMP_NUM_THREADS", cpu_threads())
    return env


def test_wheel_install_finds_the_shipped_spaces_and_example(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    shutil.copytree(REPO / "paci_tune", src / "paci_tune", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("paci_tune-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch, optuna, ... from this interpreter's site-packages, as plain path entries: a folder named
    # in a .pth is not a site dir, so its own .pth files (an editable install's hook) are not run.
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [*pip, "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=120,
    )

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import paci_tune; from paci_tune.base.shipped import shipped; "
            "print(paci_tune.__file__); print(shipped('examples', 'tiny-gpt'))",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=outside,
        env=_env(),
    ).stdout.split()
    assert where[0].startswith(purelib), f"paci_tune imported from {where[0]}, not the wheel"
    example = yaml.safe_load(Path(where[1]).read_text())
    assert example["search"]["space"] == "cpu-small"

    cli = str(venv / "bin" / "paci-tune")
    n_units = example["model"].get("n_layer", 4) + 2
    (outside / "profile.yaml").write_text(yaml.safe_dump(reference_profile(n_units, 128)))
    sim = subprocess.run(
        [cli, "simulate", "examples/tiny-gpt.yaml", "--profile", "profile.yaml", "--json"],
        capture_output=True,
        text=True,
        cwd=outside,
        env=_env(),
        timeout=120,
    )
    assert sim.returncode == 0, sim.stderr[-2000:]

    doc = dict(example)
    doc["data"] = {**example["data"], "max_bytes": 1_000_000}  # a slice of the corpus: each trial loads it
    doc["training"] = {**example["training"], "eval_sequences": 16}
    doc["budget"] = {"clock": "rst", "seconds": 0.2, "grid": 2, "profile": "profile.yaml"}
    doc["hardware"] = {k: v for k, v in example["hardware"].items() if k != "memory"}  # sized to the real profile
    doc["search"] = {
        **example["search"],
        "trials": 1,
        "confirm": {"top": 0},
        "warm_start": {"steps": 8},
    }  # the example's warm start, shortened past its LR ramp
    (outside / "small.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run(
        [cli, "search", "small.yaml", "--no-live"], capture_output=True, text=True, cwd=outside, env=_env(), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((outside / "best.yaml").read_text())
    assert best["provenance"]["space"]["name"] == "cpu-small"
    assert best["recommended"]["stages"] in (2, 3, 4)
    assert not (REPO / "paci-search" / "small").exists()
