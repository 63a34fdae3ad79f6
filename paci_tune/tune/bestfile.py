"""Reading ``best.yaml`` for ``paci-tune apply``: the whole file checked before anything runs.

``apply`` trains ``run`` and reads ``evidence.steps`` (where its first checkpoint goes), so those
are validated as strictly as a run config; ``recommended``, ``evidence``, ``target`` and ``budget``
must have their known keys with values of the right kind, and ``recommended`` must describe the
same pipeline as ``run`` (a file edited by hand in one place and not the other is refused rather
than trained half-way). The purely informative sections (``provenance``, ``confirmation``,
``baseline``, ...) need only be of the right shape: nothing reads their insides. A new field of
the run's ``pipeline`` section is accepted in ``recommended`` too, so the file grows with the schema.
May import: :mod:`paci_tune.config`, :mod:`paci_tune.base`, :mod:`paci_tune.errors` and the tune
layer's :mod:`.best`.
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
from .best import EVIDENCE

RECOMMENDED = ("schedule", "window", "microbatch_size", "stages", "partition", "global_batch", "lr", "lr_scale")
EVIDENCE_KEYS = ("trial", "time_to_target", "reached_target", "best_val_loss", "score", *EVIDENCE, "steps")
INFORMATIVE: dict[str, tuple[type, ...]] = {
    "confirmation": (dict,),
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
    for k in ("schedule", "stages", "window", "microbatch_size"):
        if k in rec and rec[k] != getattr(p, k):
            want = f"run.pipeline.{k} = {getattr(p, k)!r} (the run apply trains)"
            raise ConfigError(f"best.yaml.recommended.{k}", rec[k], want)
    for k in ("lr", "lr_scale"):
        v = rec.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ConfigError(f"best.yaml.recommended.{k}", v, "a positive finite number")


def _check_evidence(ev: Any) -> None:
    if ev is None:
        return
    if not isinstance(ev, dict):
        raise ConfigError("best.yaml.evidence", ev, "a mapping of the recommended trial's figures")
    for k, v in ev.items():
        if k not in EVIDENCE_KEYS:
            raise ConfigError(f"best.yaml.evidence.{k}", v, "a key of " + ", ".join(EVIDENCE_KEYS))
    steps = ev.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps < 2**63):
        raise ConfigError("best.yaml.evidence.steps", steps, "null or a positive integer (the trial's steps)")
