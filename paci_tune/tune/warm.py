"""Warm-start searches: every trial starts from one checkpoint of the run being tuned.

A trial from step 0 spends its short budget leaving the unigram plateau, whose timing varies
several-fold between seeds; the run a user pays for is the long middle after it. So, as
practitioners tune a long run on a checkpoint of it, ``search.warm_start`` starts every trial,
confirmation and transfer run from one checkpoint, resharded onto the trial's own layout
(:func:`paci_tune.train.checkpoint.reshard`):

- ``{checkpoint: PATH}``: a checkpoint of the user's run in progress, of any layout.
- ``{steps: N}``: the search first trains N global batches of the run as written, on 1F1B-flush
  (exact gradients: no staleness baked into the start). Its LR warms up as written and then holds
  at the peak (``min_ratio: 1``): the warm-up and stable phases of a warmup-stable-decay schedule,
  so the checkpoint is a run in its long middle, not an annealed one.

From the checkpoint each trial is a decay branch: its LR starts at its peak (no second warm-up,
the optimizer's moments came with the weights) and decays over the trial's own budget, which, like
the time to target, counts from the checkpoint (a seconds budget's clock starts there). The data
continues at the checkpoint's step, drawn with the trial's seed: a confirmation's seeds vary the
data order, never the starting weights.

The warm-up is trained once. Its folder holds ``warm.json`` when it is complete; a killed warm-up
resumes from its last checkpoint (every quarter of it); workers that share the folder wait on a
file lock while one of them trains it; the folder is recorded in the studies, so a worker with
another work folder finds it. Workers on other machines need it on a shared file system
(``search.warm_start.dir``), or a copy named by ``{checkpoint: PATH}``. May import:
:mod:`paci_tune.train`, :mod:`paci_tune.config`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`,
:mod:`paci_tune.schedule` and the tune layer's :mod:`.record` and :mod:`.study`.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna

from ..base.files import atomic_write_text
from ..base.locks import Lock, wait_lock
from ..config import derive_doc, derive_run
from ..config.tune import TuneConfig
from ..errors import ConfigError
from ..schedule import FLUSH
from ..train.checkpoint import check_files
from .record import StudyRecord
from .study import storage_file

Log = Callable[[str], None]
DONE = "warm.json"
"""In the warm-up's folder once its last checkpoint is complete: what was trained, and to what loss."""


@dataclass(frozen=True)
class WarmStart:
    """The checkpoint every trial of a search starts from, and what it is (best.yaml's ``warm_start``)."""

    checkpoint: str  # a checkpoint folder (meta.json), resharded onto each trial's layout
    step: int  # the global batches it has trained: trials' step counters continue from here
    source: str  # "warm-up" (trained by the search) or "checkpoint" (the user's)
    val_loss: float | None = None  # the warm-up's validation loss at its end (None: a user's checkpoint)
    run: dict[str, Any] | None = None  # the warm-up's run document (apply trains it when the folder is gone)

    def describe(self) -> str:
        if self.source == "warm-up":
            loss = f", val_loss {self.val_loss:.4f}" if self.val_loss is not None else ""
            return f"warm-started from a {self.step}-step 1F1B-flush warm-up ({self.checkpoint}{loss})"
        return f"warm-started from the checkpoint {self.checkpoint} (step {self.step})"

    def to_doc(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> WarmStart:
        return cls(str(doc["checkpoint"]), int(doc["step"]), str(doc["source"]), doc.get("val_loss"), doc.get("run"))


def trial_overrides(warm: WarmStart | None) -> dict[str, Any]:
    """What a warm start changes in a trial's run: it starts from the checkpoint, at its LR peak."""
    if warm is None:
        return {}
    return {"training.init_from": warm.checkpoint, "lr_schedule.warmup_fraction": 0.0}


def warm_up_doc(tune: TuneConfig, folder: Path, runtime: str, profile: str | None = None) -> dict[str, Any]:
    """The warm-up's run: the file's run as written, on 1F1B-flush, ``steps`` global batches, LR held at its peak.

    Its LR warm-up is the run's own in steps: ``warmup_fraction`` of ``training.steps`` when the run
    gives a step budget (so a 40-step warm-up of a 300-step run with 2% warm-up ramps over 6 steps,
    as that run would), else of the warm-up's steps. Under a device budget (``hardware.memory``) the
    search's ``profile`` predicts its memory and cuts it, so the check costs no calibration here.
    """
    steps = tune.search.warm_start.steps
    assert steps is not None
    t, hw = tune.run.training, tune.hardware
    ramp = tune.run.lr_schedule.warmup_fraction * (t.steps / steps if t.steps is not None else 1.0)
    extra = {k: v for k, v in (("pipeline.device", hw.device), ("pipeline.backend", hw.backend)) if v}
    if tune.run.hardware.memory is not None and profile is not None:
        extra["training.profile"] = profile
    return warm_up_run(tune.run_doc, steps, folder, runtime, ramp, extra)


def warm_up_run(
    run_doc: dict[str, Any], steps: int, folder: Path, runtime: str, ramp: float, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``run_doc`` as a warm-up (:func:`warm_up_doc`): 1F1B-flush for ``steps`` global batches into ``folder``,
    its LR warming up over ``ramp`` of them and then held at its peak (also the benches' warm start)."""
    over: dict[str, Any] = {
        "pipeline.schedule": FLUSH,
        "pipeline.inflight": None,
        "pipeline.runtime": runtime,
        "training.steps": steps,
        "training.seconds": None,
        "training.target_val_loss": None,
        "training.clock": "wall",
        "training.profile": None,
        "training.init_from": None,
        "training.eval_every": steps,
        "training.eval_every_seconds": None,
        "training.checkpoint_dir": str(folder),
        "training.checkpoint_every": max(1, steps // 4),
        "training.keep_checkpoints": 1,
        "lr_schedule.min_ratio": 1.0,
        "lr_schedule.warmup_fraction": ramp,  # < 1: config.tune.check_warm_up_reaches_peak
        **(extra or {}),
    }
    return derive_doc(copy.deepcopy(run_doc), over)


def folder_for(tune: TuneConfig, name: str, work: Path, storage_url: str, studies: dict[str, optuna.Study]) -> Path:
    """Where the warm-up's checkpoint is: ``search.warm_start.dir``; else the folder a worker already
    recorded in the studies; else beside a file storage (so workers sharing it share one); else in
    the work folder."""
    ws = tune.search.warm_start
    if ws.dir is not None:
        return Path(ws.dir).expanduser().resolve()
    recorded = folder_for_recorded(studies)
    if recorded is not None:
        return recorded
    file = storage_file(storage_url)
    return (file.parent / f"{name}-warm-start") if file is not None else work / "warm-start"


def _locked(folder: Path) -> Lock:
    """Hold the warm-up folder's lock: one worker trains, the others wait (however long) and then find it done."""
    return wait_lock(folder / ".lock", timeout_s=math.inf)


def _done(folder: Path) -> dict[str, Any] | None:
    p = folder / DONE
    return json.loads(p.read_text()) if p.is_file() else None


def prepare(
    tune: TuneConfig,
    name: str,
    work: Path,
    storage_url: str,
    studies: dict[str, optuna.Study],
    runtime: str,
    log: Log | None = None,
    profile: str | None = None,
) -> WarmStart | None:
    """The search's warm start (None when off): the user's checkpoint, or the warm-up, trained here if
    no worker has trained it yet (module docstring); recorded in every study."""
    ws = tune.search.warm_start
    if not ws.enabled:
        return None
    if ws.checkpoint is not None:
        from ..train.checkpoint import find

        folder = find(Path(ws.checkpoint), "search.warm_start.checkpoint")
        step = int(json.loads((folder / "meta.json").read_text())["loop"]["batches_done"])
        return WarmStart(str(folder), step, "checkpoint")
    folder = _claimed(folder_for(tune, name, work, storage_url, studies), studies)
    done = ensure(warm_up_doc(tune, folder, runtime, profile), "search.warm_start.dir", log)
    check_files(Path(done["checkpoint"]), "search.warm_start.dir")  # on a shared file system: anyone's
    for study in studies.values():
        StudyRecord.write_warm_start(study, {"folder": str(folder), "checkpoint": done["checkpoint"]})
    return WarmStart(done["checkpoint"], int(done["step"]), "warm-up", done.get("val_loss"), done["run"])


def _claimed(folder: Path, studies: dict[str, optuna.Study]) -> Path:
    """Record ``folder`` in the studies before training there, unless a worker recorded one first:
    a worker that opens the search while the warm-up trains finds the folder and waits on its lock
    (on one machine or a shared file system) instead of training a second warm-up. Two workers
    opening it at the same instant may each train their own (identical: the warm-up is deterministic)."""
    if folder_for_recorded(studies) is None:
        for study in studies.values():
            StudyRecord.write_warm_start(study, {"folder": str(folder)})
    return folder


def folder_for_recorded(studies: dict[str, optuna.Study]) -> Path | None:
    """The warm-up folder a worker recorded in the studies (None: none yet)."""
    for study in studies.values():
        stored = StudyRecord.read(study).warm_start
        if stored:
            return Path(stored["folder"])
    return None


def ensure(doc: dict[str, Any], key: str, log: Log | None = None) -> dict[str, Any]:
    """The warm-up ``doc`` done in its checkpoint folder: found there, or trained there now (under the
    folder's lock, continuing a killed one). ``key`` names the folder in the refusal of a folder that
    holds another run's warm-up."""
    folder = Path(doc["training"]["checkpoint_dir"])
    with _locked(folder):
        done = _done(folder)
        if done is None:
            return _train(doc, folder, log)
        if done.get("run") != _comparable(doc):
            raise ConfigError(
                key,
                str(folder),
                "a folder of this search's warm-up (it holds the warm-up of "
                "another run: choose another folder or remove it)",
            )
        if log:
            log(f"warm start: the {done['step']}-step warm-up in {folder} is done (val_loss {done['val_loss']:.4f})")
        return done


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """The warm-up's run as stored in ``warm.json``: JSON types (a YAML tuple is a list there)."""
    return json.loads(json.dumps(doc))


def _train(doc: dict[str, Any], folder: Path, log: Log | None) -> dict[str, Any]:
    """Train the warm-up (continuing its own last checkpoint when a worker was killed), then mark it done."""
    from ..train import checkpoint
    from ..train.run import resolve_run, run_training

    steps = int(doc["training"]["steps"])
    if log:
        start = checkpoint.latest(folder)
        where = f", continuing at {start.name}" if start is not None else ""
        log(f"warm start: training {steps} steps of 1F1B-flush as written into {folder}{where}")
    every = max(1, steps // 10)

    def progress(rec: dict[str, Any]) -> None:
        if log and rec.get("event") == "train" and (rec["step"] % every == 0 or rec["step"] == steps):
            log(f"warm start: step {rec['step']}/{steps}, train loss {rec['loss']:.4f}")

    summary = run_training(resolve_run(derive_run(doc), log=log), on_record=progress, resume=True, log=log)
    final = checkpoint.latest(folder)
    if final is None or summary is None:
        raise ConfigError("search.warm_start.steps", steps, "a warm-up that completes (it wrote no checkpoint)")
    done = {
        "checkpoint": str(final),
        "step": int(summary["steps"]),
        "val_loss": summary.get("final_val_loss"),
        "run": _comparable(doc),
    }
    atomic_write_text(folder / DONE, json.dumps(done, indent=1))
    if log:
        log(f"warm start: {done['step']} steps done, val_loss {done['val_loss']:.4f}")
    return done
