"""Reading ``best.yaml`` for ``paci-tune apply``: the whole file checked before anything runs.

``apply`` trains ``run`` and reads ``evidence.steps`` (where its first checkpoint goes), so those
are validated as strictly as a run config; ``recommended``, ``evidence``, ``target`` and ``budget``
must have their known keys with values of the right kind, and ``recommended`` must describe the
same pipeline as ``run`` (a file edited by hand in one place and not the other is refused rather
than trained half-way). The purely informative sections (``provenance``, ``confirmation``,
``transfer_check``, ``baseline``, ...) need only be of the right shape: nothing reads their insides. A new field of
the run's ``pipeline`` section is accepted in ``recommended`` too, so the file grows with the schema.
``recommended.backward_weights`` is null (flush) or PACI's value, the run's ``pipeline.backward_weights``;
a file from before the key has none and trains the run as written. May import: :mod:`paci_tune.pipeline`
(its checks), :mod:`paci_tune.model`, :mod:`paci_tune.config`, :mod:`paci_tune.base`,
:mod:`paci_tune.errors` and the tune layer's :mod:`.best` and :mod:`.choices`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..base.files import read_mapping
from ..config import PipelineConfig, RunConfig, derive_run
from ..config.schema import from_dict
from ..config.tune import BudgetConfig, TargetConfig
from ..errors import ConfigError
from ..model.loader import MAX_UNITS
from ..pipeline.checks import check_model_and_data
from .best import EVIDENCE, RECOMMENDED
from .choices import BACKWARD_WEIGHTS

EVIDENCE_KEYS = ("trial", "time_to_target", "reached_target", "best_val_loss", "score", *EVIDENCE, "steps")
INFORMATIVE: dict[str, tuple[type, ...]] = {
    "confirmation": (dict,),
    "transfer_check": (dict,),
    "baseline": (dict,),
    "speedup_vs_flush": (int, float),
    "paci_speedup_vs_flush": (int, float),
    "paci_speedup_interval": (list,),
    "verdict": (str,),
    "paci_won": (bool,),
    "speedup_note": (str,),
    "provenance": (dict,),
}
TOP = ("recommended", "evidence", "target", "budget", "run", *INFORMATIVE)
WHAT = "a file written by `paci-tune search`: recommended, evidence, ..., run"


def load_best(path: str | Path) -> tuple[dict[str, Any], RunConfig]:
    """The document and its validated ``run``; a ConfigError naming ``best.yaml``'s key otherwise."""
    doc = read_mapping(path, "best.yaml", WHAT)
    for k, v in doc.items():
        if k not in TOP:
            raise ConfigError(f"best.yaml.{k}", v, "a key of " + ", ".join(TOP))
    for k in ("recommended", "run"):
        if not isinstance(doc.get(k), dict) or not doc[k]:
            raise ConfigError(f"best.yaml.{k}", doc.get(k), WHAT)
    for k, kinds in INFORMATIVE.items():
        v = doc.get(k)
        if v is not None and (not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool))):
            raise ConfigError(f"best.yaml.{k}", v, f"null or {' or '.join(t.__name__ for t in kinds)}")
    try:
        run = derive_run(doc["run"])
        check_model_and_data(run)  # the run as apply would train it: its model and data, before the rest
    except ConfigError as e:
        raise ConfigError(f"best.yaml.run.{e.key}", e.value, e.allowed) from None
    _check_recommended(doc["recommended"], run)
    _check_evidence(doc.get("evidence"))
    for key, cls in (("target", TargetConfig), ("budget", BudgetConfig)):
        if doc.get(key) is not None:
            from_dict(cls, doc[key], f"best.yaml.{key}").check(f"best.yaml.{key}", require=False)
    return doc, run


def _check_recommended(rec: dict[str, Any], run: RunConfig) -> None:
    allowed = (*RECOMMENDED, *(f.name for f in dataclasses.fields(PipelineConfig) if f.name not in RECOMMENDED))
    for k, v in rec.items():
        if k not in allowed:
            raise ConfigError(f"best.yaml.recommended.{k}", v, "a key of " + ", ".join(allowed))
    p = run.pipeline
    same = {**{k: getattr(p, k) for k in ("schedule", "stages", "window", "microbatch_size", "data_parallel")},
            "global_batch": run.training.global_batch, "lr": run.optimizer.lr,
            "devices": run.layout.devices}  # fmt: skip
    for k, want in same.items():
        v = rec.get(k)
        if k in rec and (type(v) is bool or v != want):
            raise ConfigError(f"best.yaml.recommended.{k}", v, f"{want!r}, what the run apply trains says")
    part = rec.get("partition")
    if part is not None and (not isinstance(part, list) or len(part) != p.stages
                             or any(type(n) is not int or not 1 <= n <= MAX_UNITS for n in part)):  # fmt: skip
        raise ConfigError("best.yaml.recommended.partition", part, f"null or {p.stages} positive unit counts")
    scale = rec.get("lr_scale")
    if scale is not None and not _number(scale, 1e3):
        raise ConfigError("best.yaml.recommended.lr_scale", scale, "a positive number up to 1000")
    bw = rec.get("backward_weights")  # absent in files written before the key: nothing to compare
    if bw is not None and (not isinstance(bw, str) or bw not in BACKWARD_WEIGHTS or bw != p.backward_weights):
        raise ConfigError("best.yaml.recommended.backward_weights", bw, f"null or {p.backward_weights!r}, what the "
                          f"run apply trains says (one of {', '.join(BACKWARD_WEIGHTS)})")  # fmt: skip


NUMBERS = ("time_to_target", "best_val_loss", "score", "clock_tokens_per_s", "clock_step_time_s",
           "clock_bubble_fraction", "tokens_per_s", "bubble_fraction", "max_drift")  # fmt: skip
"""Evidence figures that are numbers (null where the trial did not measure them)."""


def _number(v: Any, most: float = float("inf"), least_ok: float = 0.0, strict: bool = True) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        x = float(v)
    except OverflowError:
        return False
    return (least_ok < x if strict else least_ok <= x) and x <= most and x != float("inf")


def _check_evidence(ev: Any) -> None:
    if ev is None:
        return
    if not isinstance(ev, dict):
        raise ConfigError("best.yaml.evidence", ev, "a mapping of the recommended trial's figures")
    for k, v in ev.items():
        if k not in EVIDENCE_KEYS:
            raise ConfigError(f"best.yaml.evidence.{k}", v, "a key of " + ", ".join(EVIDENCE_KEYS))
    if ev.get("trial") is not None and not isinstance(ev["trial"], str):
        raise ConfigError("best.yaml.evidence.trial", ev["trial"], "null or the trial's name (STUDY#NUMBER)")
    for k in NUMBERS:
        v = ev.get(k)
        if v is not None and not _number(v, strict=False):
            raise ConfigError(f"best.yaml.evidence.{k}", v, "null or a finite number >= 0")
    if ev.get("reached_target") is not None and not isinstance(ev["reached_target"], bool):
        raise ConfigError("best.yaml.evidence.reached_target", ev["reached_target"], "true or false")
    steps = ev.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps < 2**63):
        raise ConfigError("best.yaml.evidence.steps", steps, "null or a positive integer (the trial's steps)")
