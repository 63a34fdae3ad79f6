"""``best.yaml``: the recommendation, the evidence behind it, and the tuned flush baseline.

Only finished (not pruned) trials are candidates: a pruned trial never showed it reaches the
target. The recommendation is the best score over both schedules; the baseline is the best
1F1B-flush trial; ``speedup_vs_flush`` is the baseline's score over the recommendation's (1.0
when flush itself wins), and ``paci_speedup_vs_flush`` is what the best PACI trial achieved
against it, below 1 when PACI lost. Scores are times to target, or the not-reached penalty
(:mod:`.objective`), so a speedup against a baseline that never reached the target is a lower
bound, and the file says so.

The file also carries ``run``: the complete run configuration of the recommended trial, which
``paci-tune apply`` trains. May import: optuna, torch (its version), :mod:`paci_tune.base`,
:mod:`.space`.
"""

from __future__ import annotations

import datetime as _dt
import platform
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from .. import __version__
from ..base.files import read_yaml, write_yaml
from ..errors import ConfigError
from .space import TrialParams

HEADER = "# Written by `paci-tune search`; train it with `paci-tune apply {name}`.\n"


def trial_counts(study: optuna.Study) -> dict[str, int]:
    trials = study.get_trials(deepcopy=False)
    return {
        "complete": sum(t.state == TrialState.COMPLETE for t in trials),
        "pruned": sum(t.state == TrialState.PRUNED for t in trials),
        "failed": sum(t.state == TrialState.FAIL for t in trials),
        "repeats_reused": sum("repeat_of" in t.user_attrs and t.state != TrialState.FAIL for t in trials),
    }


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """Lowest score among finished trials; the earliest on a tie (a repeat is not new evidence)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    return min(done, key=lambda t: (t.value, t.number)) if done else None


def describe_trial(t: FrozenTrial, schedule: str, params: TrialParams, lr: float) -> dict[str, Any]:
    a = t.user_attrs
    return {
        "schedule": schedule,
        "window": params.window,
        "microbatch_size": params.microbatch_size,
        "stages": params.stages,
        "partition": a.get("partition"),
        "global_batch": params.global_batch,
        "lr": lr,
        "lr_scale": params.lr_scale,
        "trial": t.number,
        "time_to_target": a.get("time_to_target"),
        "reached_target": a.get("time_to_target") is not None,
        "best_val_loss": a.get("best_val_loss"),
        "score": t.value,
    }


def params_of(t: FrozenTrial, schedule: str, fixed_batch: int | None) -> TrialParams:
    p = t.params
    b = int(p["microbatch_size"])
    a = fixed_batch // b if fixed_batch is not None else int(p["window"])
    return TrialParams(schedule, int(p["stages"]), a, b, float(p.get("lr_scale", 1.0)))


def build_best(
    studies: dict[str, optuna.Study],
    *,
    run_doc_for: Any,
    base_lr: float,
    fixed_batch: int | None,
    target: dict[str, Any],
    budget: dict[str, Any],
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The ``best.yaml`` document (module docstring); ConfigError when no trial finished."""
    bests: dict[str, tuple[FrozenTrial, TrialParams]] = {}
    for schedule, study in studies.items():
        t = best_trial(study)
        if t is not None:
            bests[schedule] = (t, params_of(t, schedule, fixed_batch))
    if not bests:
        raise ConfigError(
            "search", "no finished trial", "at least one trial that ran to its target or budget: "
            "see the failure reasons above, or give budget.seconds / target.value room",
        )  # fmt: skip
    rec_schedule = min(bests, key=lambda s: (bests[s][0].value, s != "paci"))
    rec_t, rec_p = bests[rec_schedule]
    a = rec_t.user_attrs
    described = describe_trial(rec_t, rec_schedule, rec_p, base_lr * rec_p.lr_scale)
    keep = ("schedule", "window", "microbatch_size", "stages", "partition", "global_batch", "lr", "lr_scale")
    doc: dict[str, Any] = {
        "recommended": {k: described[k] for k in keep},
        "evidence": {
            "trial": f"{studies[rec_schedule].study_name}#{rec_t.number}",
            "time_to_target": a.get("time_to_target"),
            "reached_target": a.get("time_to_target") is not None,
            "best_val_loss": a.get("best_val_loss"),
            "score": rec_t.value,
            "tokens_per_s": a.get("tokens_per_s"),
            "bubble_fraction": a.get("bubble_fraction"),
            "max_drift": a.get("max_drift"),
            "peak_memory_bytes": a.get("peak_memory_bytes"),
            "predicted_peak_memory_bytes": a.get("predicted_peak_memory_bytes"),
            "clock_used": a.get("clock_used"),
            "steps": a.get("steps"),
        },
    }
    base = bests.get("1f1b")
    paci = bests.get("paci")
    if base is not None:
        bt, bp = base
        doc["baseline"] = describe_trial(bt, "1f1b", bp, base_lr * bp.lr_scale)
        doc["baseline"]["trial"] = f"{studies['1f1b'].study_name}#{bt.number}"
        doc["speedup_vs_flush"] = round(float(bt.value) / float(rec_t.value), 4)
        if paci is not None:
            doc["paci_speedup_vs_flush"] = round(float(bt.value) / float(paci[0].value), 4)
            doc["paci_won"] = bool(paci[0].value < bt.value)
        notes = []
        spacing = float(budget.get("seconds") or 0.0) / int(budget.get("grid") or 1)
        if paci is not None and abs(float(paci[0].value) - float(bt.value)) < spacing:
            notes.append(f"PACI and flush are within one validation interval ({spacing:.3g}s), the resolution of "
                         "time to target: treat them as tied")  # fmt: skip
        if bt.user_attrs.get("time_to_target") is None:
            notes.append("the flush baseline never reached the target within the budget: its score is the "
                         "not-reached penalty, so the speedup is a lower bound")  # fmt: skip
        if a.get("time_to_target") is None:
            notes.append("the recommended trial did not reach the target either: compare best validation losses")
        if notes:
            doc["speedup_note"] = "; ".join(notes)
    else:
        doc["baseline"] = None
        doc["speedup_vs_flush"] = None
        doc["speedup_note"] = "no 1F1B-flush trial finished (or the space has no flush schedule)"
    doc["target"] = target
    doc["budget"] = budget
    doc["provenance"] = {
        **provenance,
        "trials": {s: trial_counts(st) for s, st in studies.items()},
        "versions": {
            "paci_tune": __version__,
            "torch": str(torch.__version__),
            "optuna": optuna.__version__,
            "python": platform.python_version(),
        },
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    doc["run"] = run_doc_for(rec_p)
    return doc


def write_best(path: Path, doc: dict[str, Any]) -> None:
    """Write ``best.yaml`` atomically: a reader sees the old file or the whole new one."""
    write_yaml(path, _plain(doc), header=HEADER.format(name=path.name))


def read_best(path: str | Path) -> dict[str, Any]:
    doc = read_yaml(path, "best.yaml")
    if not isinstance(doc, dict) or not isinstance(doc.get("run"), dict) or "recommended" not in doc:
        raise ConfigError("best.yaml", str(path), "a file written by `paci-tune search` (with recommended and run)")
    return doc


def _plain(x: Any) -> Any:
    """YAML-safe copy: tuples to lists, numpy/torch scalars to Python numbers."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x
