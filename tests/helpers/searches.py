"""Searches as the tests run them: one small search config (:data:`SEARCH_DOC`) and its space, a
profile of its model measured once per process, ``paci-tune search`` as a subprocess, and the
studies it left, read back with Optuna.

Shared by the search, stage-death, transfer, PostgreSQL and stale-point tests.
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import optuna
import yaml

from helpers import REPO
from helpers.cli import cli_env
from helpers.configs import make_config

SEARCH_DOC: dict[str, Any] = {
    **make_config(lr_schedule={"min_ratio": 0.1}),
    "optimizer": {"name": "adamw", "lr": 3.0e-3},
    "target": {"value": 1.85},
    "budget": {"clock": "sim", "seconds": 0.3, "grid": 3},
    "hardware": {"devices": 4},  # P=2 -> D=2, P=4 -> D=1
    "search": {"trials": 2, "seed": 0, "stall_seconds": 120, "confirm": {"top": 0}},
}
"""BASE_CONFIG's tiny run (its optimizer at paci-tune's defaults but the LR) searched on the sim clock."""

SPACE = {"schedules": ["paci", "1f1b"], "stages": [2, 4], "microbatch_size": [2, 4]}


@functools.cache
def quick_search() -> Any:
    """bench/search_seeds.py as a module: its QUICK search, QUICK_SPACE and QUICK_PROFILE (a tiny synthetic
    model on a hand-written reference profile), read rather than copied."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("search_seeds", REPO / "bench" / "search_seeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def shared_profile() -> str:
    """SEARCH_DOC's model measured once per test process, at every micro-batch size the tests use.

    A search on the sim clock without ``budget.profile`` measures its own (20-30 s on 2 cores);
    the searches here would measure the same model a dozen times. The measuring itself is what
    ``paci-tune search`` runs (:func:`measured_profile`), tested by test_sim_accuracy and the docs check.
    """
    from paci_tune.calibrate.cache import measured_profile
    from paci_tune.config import derive_run

    run = {k: v for k, v in SEARCH_DOC.items() if k not in ("target", "budget", "hardware", "search")}
    path = Path(tempfile.gettempdir()) / f"paci-test-search-profile-{os.getpid()}.yaml"
    atexit.register(path.unlink, missing_ok=True)  # one per test process: gone when the process ends
    _, where = measured_profile(derive_run(run), microbatch_sizes=[1, 2, 4, 8], path=path)
    return str(where)


def write_search(tmp: Path, **sections: dict[str, Any]) -> Path:
    """SEARCH_DOC with some keys of some sections replaced, as ``tmp/model.yaml`` with its space beside it
    (:data:`SPACE` unless ``tmp/space.yaml`` exists); on the sim clock it reads :func:`shared_profile`."""
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in SEARCH_DOC.items()}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    b = doc["budget"]
    if b.get("clock") == "sim" and "profile" not in b and all(doc[k] == SEARCH_DOC[k] for k in ("model", "data")):
        b["profile"] = shared_profile()  # one measurement for every search test (see shared_profile)
    space = tmp / "space.yaml"
    if not space.exists():
        space.write_text(yaml.safe_dump(SPACE))
    doc["search"].setdefault("space", str(space))
    path = tmp / "model.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def search_cmd(config: Path, tmp: Path, *extra: str) -> list[str]:
    """The argv of ``paci-tune search CONFIG`` with its work folder and best.yaml in ``tmp``."""
    return [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "search",
        str(config),
        "--no-live",
        "--workdir",
        str(tmp / "work"),
        "--out",
        str(tmp / "best.yaml"),
        *extra,
    ]


def run(cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a subprocess from the repository root; its output captured as text."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env or cli_env())


def run_workers(cmds: list[list[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Start every ``cmd`` at once (workers of one search), wait for all, and require each to succeed;
    their (pid, stdout, stderr). OMP_NUM_THREADS is unset: the workers split the cores between their trials."""
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [(p.pid, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def studies(storage: str, name: str = "model") -> dict[str, optuna.Study]:
    """The study of each schedule of a search named ``name``, read back from ``storage`` with Optuna."""
    return {s: optuna.load_study(study_name=f"{name}.{s}", storage=storage) for s in ("paci", "1f1b")}


def search_with_model(
    tmp: Path,
    name: str,
    source: str,
    sizes: list[int],
    runtime: str,
    seconds: float,
    stall_s: float,
    trial_s: float,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``paci-tune search`` on 2 devices of ``runtime`` for ``seconds`` of wall clock per trial: PACI at
    P = 2, one trial per micro-batch size of ``sizes`` (a grid), on the user model ``source`` (module
    ``name`` in ``tmp``, built by its ``build()``), run to its end. The target is never reached, so a
    healthy trial runs its budget; ``stall_s`` and ``trial_s`` are the search's stall and trial timeouts,
    ``timeout`` the whole search's."""
    (tmp / f"{name}.py").write_text(source)
    (tmp / "space.yaml").write_text(yaml.safe_dump({"schedules": ["paci"], "stages": [2], "microbatch_size": sizes}))
    config = write_search(
        tmp,
        budget={"clock": "wall", "seconds": seconds, "grid": 2},
        training={"eval_every": 5},
        hardware={"runtime": runtime, "devices": 2},
        search={"trials": len(sizes), "sampler": "grid", "stall_seconds": stall_s, "trial_timeout": trial_s},
    )
    doc = yaml.safe_load(config.read_text())
    doc["model"] = {"entry": f"{name}:build", "block_size": 32}
    doc["target"]["value"] = 0.01
    config.write_text(yaml.safe_dump(doc))
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return run(search_cmd(config, tmp), env=env, timeout=timeout)


def guide_model_search(tmp: Path, model: dict[str, Any], stages: list[int], frozen: tuple[int, ...] = ()) -> Path:
    """``tmp/model.yaml``: bench/search_seeds.py's QUICK search (rst clock on a hand-written profile,
    0.6 s per trial, 4 devices, 3 trials per schedule, no confirmation) on one of the guide's 6-unit
    models (``model``, a ``model:`` section), PACI against flush at ``stages``; the units in
    ``frozen`` train nothing in the profile too."""
    import copy

    from helpers.guide_models import SMALL

    seeds = quick_search()
    profile = copy.deepcopy(seeds.QUICK_PROFILE)
    profile["seq_len"] = SMALL["block_size"]
    profile["units"] = [dict(profile["units"][0], name=f"u{i}") for i in range(6)]
    for i in frozen:
        profile["units"][i].update(trainable_bytes=0, optimizer_s=0.0)
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    space = {"schedules": ["paci", "1f1b"], "stages": stages, "microbatch_size": [2, 4]}
    (tmp / "space.yaml").write_text(yaml.safe_dump(space))
    doc = copy.deepcopy(seeds.QUICK)
    doc["model"] = model
    doc["budget"] = {**doc["budget"], "seconds": 0.6, "profile": str(tmp / "profile.yaml")}
    doc["hardware"] = {"devices": 4}
    doc["search"] = {**doc["search"], "trials": 3, "space": str(tmp / "space.yaml"), "confirm": {"top": 0}}
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return config


def quota_met(trials: list[optuna.trial.FrozenTrial], quota: int, extra: int = 0) -> bool:
    """A study of a :data:`SPACE` search ended where it should: ``quota`` to ``quota + extra`` counted trials
    (``extra``: a race of several workers at the very end), or fewer once every point of the space has a
    finished trial (every point of SPACE is feasible at 4 devices: a study whose space is all run is done,
    and one curve answers flush's other layouts, tune.siblings)."""
    from optuna.trial import TrialState

    from paci_tune.tune.study import counted

    ran = {
        (t.params.get("stages"), t.params.get("microbatch_size"))
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    }
    every_point = ran >= {(p, b) for p in SPACE["stages"] for b in SPACE["microbatch_size"]}
    return quota <= counted(trials, quota) <= quota + extra or every_point
