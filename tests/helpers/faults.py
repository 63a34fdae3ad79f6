"""Faults injected into real paci-tune processes, and the oracles that say nothing was lost.

:mod:`test_faults` kills searches, fork servers, stage workers and database servers, fills the disk and
breaks checkpoints; each case then compares what the user acts on with an uninterrupted run of the same
thing. This module holds what those cases share:

- :func:`tiny_search`: the cheapest deterministic search there is: bench/search_seeds.py's QUICK model on
  its hand-written profile, on the sim clock (no measuring: numbers from the simulator, the same on every
  machine), two points per schedule, no pruner -- so every point runs and the result does not depend on
  the order trials ran in, which a kill and a resume change;
- :func:`search_outcome`: a search's result as a user acts on it (best.yaml's recommendation and verdict,
  each study's counted trials and finished points with their scores), to compare with ``==``;
- :func:`fault_env`: a ``sitecustomize`` on the child's ``PYTHONPATH`` that makes its Nth checkpoint stage
  write fail with ENOSPC (after writing part of the file, as a full disk does) or pause there (so a test
  can kill a stage worker at a known moment, without racing the run's end);
- polling and process plumbing: :func:`start`, :func:`wait_until`, :func:`started_trials`, :func:`fork_server_of`.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import optuna
import yaml
from optuna.trial import TrialState

from helpers import REPO
from helpers.cli import cli_env
from helpers.processes import alive, descendants, kill_tree
from helpers.searches import quick_search

T = TypeVar("T")

SPACE = {"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [2, 4]}
"""Two points per schedule: the quota of 2 runs the whole space, whatever the sampler proposes first."""


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def tiny_search(tmp: Path, **search: Any) -> Path:
    """``tmp/model.yaml``: QUICK (a 2-layer d_model 32 GPT, 2 devices) on QUICK_PROFILE's sim clock,
    0.4 simulated seconds per trial (the target 3.3 is reached by some points, missed by others: a
    recommendation that depends on the numbers), 2 trials per schedule, no pruner, no confirmation;
    ``search`` keys replace the search section's. About 10 s of wall time on 2 cores."""
    seeds = quick_search()
    (tmp / "space.yaml").write_text(yaml.safe_dump(SPACE))
    # written out in full, as paci-tune writes its own files (QUICK_PROFILE shares one cost dict between units)
    (tmp / "profile.yaml").write_text(yaml.dump(seeds.QUICK_PROFILE, Dumper=_NoAliases))
    doc = copy.deepcopy(seeds.QUICK)
    doc["target"] = {"value": 3.3}
    doc["budget"] = {"clock": "sim", "seconds": 0.4, "grid": 3, "profile": str(tmp / "profile.yaml")}
    doc["search"] = {
        "trials": 2,
        "seed": 0,
        "stall_seconds": 120,
        "pruner": "none",  # a pruner's decisions depend on which trials finished first
        "confirm": {"top": 0},
        "space": str(tmp / "space.yaml"),
        **search,
    }
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return config


def sqlite_url(tmp: Path) -> str:
    """The default storage of a search whose work folder is ``tmp/work`` (helpers.searches.search_cmd)."""
    return f"sqlite:///{tmp / 'work' / 'study.db'}"


def search_outcome(best: Path, storage: str | optuna.storages.BaseStorage, name: str = "model") -> dict[str, Any]:
    """What a user acts on after a search, comparable between runs with ``==``.

    From best.yaml: ``recommended``, ``verdict``, ``baseline_schedule`` and each side's compared point.
    From the storage, per study: its trials -- the finished search trials, repeats of a point not counted (an
    interrupted trial's run again counts once, its failed first attempt not at all) -- and its finished
    points with their scores (rounded: a point answered from another layout's curve sums in another order,
    within 1e-4). Not compared: trial numbers, timestamps, paths, failed trials (a kill leaves one behind, by
    design), which trial of a curve trained it and which were answered from it (the order trials ran in
    decides that, and two workers change the order).
    """
    from paci_tune.tune.record import TrialRecord

    doc = yaml.safe_load(best.read_text())
    out: dict[str, Any] = {
        "recommended": doc["recommended"],
        "verdict": doc["verdict"],
        "baseline_schedule": doc.get("baseline_schedule"),
        "compared": {side: doc["comparison"][side]["point"] for side in ("paci", "baseline")},
    }
    for schedule in SPACE["schedules"]:
        study = optuna.load_study(study_name=f"{name}.{schedule}", storage=storage)
        trials = study.get_trials(deepcopy=False)
        left = [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        assert not left, f"{schedule}: trials {left} were left running or queued"
        points: dict[str, tuple[str, float | None]] = {}
        finished = 0
        for t in trials:
            rec = TrialRecord.read(t)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and not rec.is_extra and not rec.is_repeat:
                finished += 1
                key = ",".join(f"{k}={v}" for k, v in sorted(t.params.items()))
                points[key] = (t.state.name, None if t.value is None else round(t.value, 3))
        out[schedule] = {"trials": finished, "points": points}
    return out


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``cmd`` from the repository root in a session of its own (``os.killpg(proc.pid, ...)`` reaches its
    group), Ctrl-C reaching it as at a terminal (a suite started in the background runs with SIGINT ignored,
    which children inherit and Python then leaves ignored; test_failures does the same), stdout into ``log``
    and stderr into :func:`err_of` ``(log)`` (files, not pipes nobody reads while the test polls)."""
    with open(log, "w") as out, open(err_of(log), "w") as err:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env or cli_env(),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def err_of(log: Path) -> Path:
    """Where :func:`start` put the stderr of the process whose stdout is ``log``."""
    return log.with_suffix(".err")


def finish(proc: subprocess.Popen[str], log: Path, timeout: float) -> tuple[int, str]:
    """Wait for ``proc`` (killed with its group past ``timeout``: the test fails, naming the hang); its
    exit code and stderr."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"still running after {timeout:g} s: {err_of(log).read_text()[-2000:]}") from None
    return code, err_of(log).read_text()


def run_twice_at_once(cmd: list[str], tmp: Path, timeout: float) -> None:
    """``cmd`` started twice at once (two workers of one search, logs ``tmp/worker0.log`` and ``worker1.log``);
    waits for both and requires each to succeed, naming the tail of a failed one's stderr."""
    logs = [tmp / f"worker{i}.log" for i in range(2)]
    procs = [start(cmd, log) for log in logs]
    try:
        codes = [finish(p, log, timeout)[0] for p, log in zip(procs, logs, strict=True)]
    finally:
        for p in procs:
            kill_tree(p)
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, err_of(log).read_text()[-2000:]


def wait_until(
    probe: Callable[[], T | None], what: str, timeout: float, proc: subprocess.Popen[str] | None = None
) -> T:
    """Poll ``probe`` every 20 ms until it returns something (not None); fail naming ``what`` after
    ``timeout`` seconds, or as soon as ``proc`` has exited (the moment to inject the fault has passed)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None:
            return got
        assert proc is None or proc.poll() is None, f"the process ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)


def started_trials(work: Path) -> list[Path]:
    """The trial folders under a search's work folder whose trial process is training: its events file
    has a record and no summary yet (a trained trial; one answered from a curve has no process)."""
    out = []
    for events in sorted((work / "trials").glob("*/trial-*/events.jsonl")):
        try:
            text = events.read_text()
        except OSError:
            continue
        if text.strip() and '"summary"' not in text:
            out.append(events.parent)
    return out


def fork_server_of(pid: int) -> int | None:
    """The fork server (``-m paci_tune.base.zygote``) that search ``pid`` started, if it runs."""
    for child in descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"paci_tune.base.zygote" in cmd and alive(child):
            return child
    return None


def forked_trials(server: int) -> list[int]:
    """The live trial processes fork server ``server`` forked (its children)."""
    return [p for p in descendants(server) if alive(p)]


# ------------------------------------------------------------------------------------- injected faults
_SITE = '''
"""Test fault injection (tests/helpers/faults.py): the PACI_FAULT_AT-th torch.save of a checkpoint stage
file in this process (only where RANK is PACI_FAULT_RANK, if set) fails with ENOSPC or pauses."""
import importlib.abc
import importlib.util
import os
import sys


def _patch(torch):
    import errno
    import time

    save, calls = torch.save, [0]
    at, action, marker = int(os.environ["PACI_FAULT_AT"]), os.environ["PACI_FAULT"], os.environ["PACI_FAULT_MARKER"]

    def faulty_save(obj, f, *args, **kwargs):
        name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else str(getattr(f, "name", ""))
        if os.path.basename(name).lstrip(".").startswith("stage_"):
            calls[0] += 1
            if calls[0] == at:
                with open(marker, "w") as m:
                    m.write(f"{os.getpid()} {name}\\n")
                if action == "pause":
                    time.sleep(600)
                # a full disk: part of the file is written, then the write fails
                if isinstance(f, (str, os.PathLike)):
                    with open(f, "wb") as out:
                        out.write(b"PK\\x03\\x04 half a checkpoint")
                else:
                    f.write(b"PK\\x03\\x04 half a checkpoint")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return save(obj, f, *args, **kwargs)

    torch.save = faulty_save


class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches torch.save once torch is imported (importing it here would slow every process)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


if os.environ.get("PACI_FAULT") and os.environ.get("PACI_FAULT_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
    sys.meta_path.insert(0, _AfterTorch())
'''


def fault_env(folder: Path, action: str, at: int, rank: int | None = None) -> tuple[dict[str, str], Path]:
    """The CLI environment (:func:`helpers.cli.cli_env`) plus a ``sitecustomize`` in ``folder`` that makes the
    ``at``-th checkpoint stage write (``torch.save`` of a ``stage_*.pt``, counted per process) fail with
    ENOSPC after writing part of the file (``action="enospc"``) or sleep there (``"pause"``), in every
    process or, with ``rank``, only in the distributed worker of that RANK. Returns the environment and the
    marker file the faulty write creates first (``"PID PATH"``): the test's sign that the fault is on."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(_SITE))
    marker = folder / "fault.marker"
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    env.update(PACI_FAULT=action, PACI_FAULT_AT=str(at), PACI_FAULT_MARKER=str(marker))
    if rank is not None:
        env["PACI_FAULT_RANK"] = str(rank)
    return env, marker
