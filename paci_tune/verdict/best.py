"""``best.yaml``: the recommendation, the evidence behind it, and the strongest tuned synchronous baseline.

Only finished (not pruned) trials are candidates: a pruned trial never showed it reaches the
target. The recommendation is the best score over every schedule; the baseline is the best trial of
the best synchronous schedule searched (``baseline_schedule``: ``1f1b``, ``zb-h1`` or ``interleaved``,
ranked by confirmed score), since an efficient method has to beat the strongest baseline, not the
easiest (No Train No Gain). ``speedup_vs_flush`` is 1F1B-flush's score over the recommendation's
(1.0 when flush itself wins), and ``paci_speedup_vs_flush`` is what the best PACI trial achieved
against it, below 1 when PACI lost: the paper's comparison. The verdict compares PACI with the
baseline; where that is not flush, ``paci_speedup_vs_baseline`` and its interval say by how much,
and ``verdict_vs_flush`` gives the paper's verdict beside it. Scores are times to target, or the not-reached penalty
(:mod:`paci_tune.tune.objective`), so a speedup against a baseline that never reached the target is a lower
bound, and the file says so.

The file also carries ``run``: the complete run configuration of the recommended trial, which
``paci-tune apply`` trains -- with ``pipeline.data_parallel``, so it runs on the P x D devices the
trial was timed on (``recommended`` states P, D, a, b and the devices, and for PACI the
``backward_weights`` the run has: the point's, else the run's own; null for flush). The document
is written through ``best.yaml``'s schema (:mod:`paci_tune.tune.bestfile`). May import: optuna, torch (its
version), :mod:`paci_tune.config`, :mod:`paci_tune.errors`, :mod:`paci_tune.tune` and the verdict layer's
:mod:`.confirm`, :mod:`.transfer`.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import platform
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from .. import __version__
from ..config.layout import Layout
from ..config.optimizer import OptimizerConfig
from ..config.schema import STALENESS_KEYS, from_dict
from ..errors import ConfigError
from ..tune.bestfile import EVIDENCE, RECOMMENDED
from ..tune.choices import DEFAULT_BACKWARD_WEIGHTS
from ..tune.extra import search_trials
from ..tune.point import TrialParams
from ..tune.record import TrialRecord
from ..tune.rounds import LEVEL
from ..tune.space import SYNCHRONOUS
from . import candidates, confirm, transfer
from .confirm import Confirmed


def trial_counts(study: optuna.Study) -> dict[str, int]:
    trials = [(t, TrialRecord.read(t)) for t in study.get_trials(deepcopy=False)]
    search = [(t, r) for t, r in trials if not r.is_extra]
    infeasible = sum(r.infeasible for _, r in search)  # outside the device budget, unrun
    long = sum(r.is_transfer and t.state.is_finished() for t, r in trials)  # the transfer check's
    layouts = sum(r.sibling_of is not None and t.state.is_finished() for t, r in search)  # tune/siblings.py
    capped = sum(t.state == TrialState.PRUNED and r.capped_at is not None for t, r in search)  # tune/capping.py
    return {
        "complete": sum(t.state == TrialState.COMPLETE for t, _ in search),
        "pruned": sum(t.state == TrialState.PRUNED and not r.infeasible for t, r in search),
        **({"capped": capped} if capped else {}),
        **({"infeasible": infeasible} if infeasible else {}),
        "failed": sum(t.state == TrialState.FAIL for t, _ in search),
        "repeats_reused": sum(r.is_repeat and t.state != TrialState.FAIL for t, r in search),
        "confirmation": sum(r.is_confirmation and t.state.is_finished() for t, r in trials),
        **({"transfer": long} if long else {}),
        **({"other_layouts": layouts} if layouts else {}),
    }


def compute_used(studies: dict[str, optuna.Study]) -> dict[str, float]:
    """Wall seconds of trial processes: the search's, the confirmation's and (when there is one) the transfer
    check's; repeats answered from the storage cost 0."""
    out = {"search_s": 0.0, "confirmation_s": 0.0}
    for study in studies.values():
        for r in map(TrialRecord.read, study.get_trials(deepcopy=False)):
            if not r.is_repeat:
                key = "confirmation_s" if r.is_confirmation else "transfer_s" if r.is_transfer else "search_s"
                out[key] = out.get(key, 0.0) + float(r.wall_seconds or 0)
    return {k: round(v, 1) for k, v in out.items()}


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """Lowest score among finished search trials; the earliest on a tie (a repeat is not new evidence)."""
    done = [t for t in search_trials(study, (TrialState.COMPLETE,)) if t.value is not None]
    return min(done, key=lambda t: (t.value, t.number)) if done else None


def describe_trial(t: FrozenTrial, schedule: str, params: TrialParams, lr: float) -> dict[str, Any]:
    r = TrialRecord.read(t)
    return {
        "schedule": schedule,
        "window": params.window,
        "microbatch_size": params.microbatch_size,
        "stages": params.stages,
        "data_parallel": params.data_parallel,
        "devices": params.devices,
        "partition": r.figure("partition"),
        "global_batch": params.global_batch,
        "lr": lr,
        "lr_scale": params.lr_scale,
        "backward_weights": params.backward_weights,
        **({"optimizer": params.optimizer} if params.optimizer is not None else {}),
        **({"staleness": params.staleness} if params.staleness is not None else {}),
        "trial": t.number,
        "time_to_target": r.time_to_target,
        "reached_target": r.time_to_target is not None,
        "best_val_loss": r.best_val_loss,
        "score": t.value,
    }


def params_of(t: FrozenTrial, schedule: str, fixed_batch: int | None) -> TrialParams:
    """A trial's point; D is in its user attributes (1 for trials of searches without a device budget).

    PACI's ``backward_weights``: the parameter where the study tunes it, the user attribute where the
    space fixes it; None (the run's own value) for a space without the key -- and for trials stored
    before the key existed, whose runs used the current weights (the only mode then).
    """
    p, r = t.params, TrialRecord.read(t)
    b = int(p["microbatch_size"])
    d = int(p.get("data_parallel", 1 if r.data_parallel is None else r.data_parallel))
    a = Layout.window_for(fixed_batch, d, b) if fixed_batch is not None else int(p["window"])
    bw = p.get("backward_weights", r.backward_weights) if schedule == "paci" else None
    v = int(p.get("chunks", 1))  # interleaved's v (its study's parameter); 1 for every other schedule
    opt, stale = p.get("optimizer", r.optimizer), p.get("staleness", r.staleness) if schedule == "paci" else None
    return TrialParams(schedule, int(p["stages"]), a, b, float(p.get("lr_scale", 1.0)), d, bw, v, opt, stale)


def build_best(
    studies: dict[str, optuna.Study],
    *,
    run_doc_for: Any,
    base_lr: float,
    fixed_batch: int | None,
    target: dict[str, Any],
    budget: dict[str, Any],
    provenance: dict[str, Any],
    confirm_seeds: list[int] | None = None,
    confirm_rounds: dict[str, Any] | None = None,
    transfer_factor: float | None = None,
    warm_started: bool = False,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``best.yaml`` document (module docstring); ConfigError when no trial finished.

    With ``confirm_seeds``, schedules are ranked by their confirmed points' mean over those seeds
    (:mod:`.confirm`); without, by the search's single draws (an anecdote, and the file says so).
    ``confirm_rounds``: the confirmation's minimum and cap, its tolerance and why it stopped adding seeds
    (:mod:`paci_tune.tune.rounds`), written into the ``confirmation`` section as given.
    With ``transfer_factor``, ``transfer_check`` reports how the short trials' ranking held at that
    many times the budget (:mod:`.transfer`); it changes nothing else in the file. ``warm_started``:
    the trials started from a checkpoint (an undecided verdict's advice says so). ``memory``: the device
    budget and the points it dropped (:func:`.candidates.memory_section`), written as given; every file
    gets the ranked table of each schedule's best points (``candidates``, :mod:`.candidates`).
    """

    def point_of(t: FrozenTrial, schedule: str) -> TrialParams:
        return params_of(t, schedule, fixed_batch)

    seeds = confirm_seeds or []
    tables = {s: confirm.confirmed(st, s, seeds, point_of) for s, st in studies.items()} if seeds else {}
    confirmed: dict[str, Confirmed] = {}
    for schedule, table in tables.items():
        points = [c for c in table if c.complete]
        if points:
            confirmed[schedule] = min(points, key=lambda c: (c.mean, c.trial))
    bests: dict[str, tuple[FrozenTrial, TrialParams, float]] = {}
    for schedule, study in studies.items():
        if schedule in confirmed:
            c = confirmed[schedule]
            t = next(x for x in study.get_trials(deepcopy=False) if x.number == c.trial)
            bests[schedule] = (t, c.params, c.mean)
        elif (t := best_trial(study)) is not None:
            bests[schedule] = (t, params_of(t, schedule, fixed_batch), float(t.value))
    if not bests:
        raise ConfigError(
            "search", "no finished trial", "at least one trial that ran to its target or budget: "
            "see the failure reasons above, or give budget.seconds / target.value room",
        )  # fmt: skip
    rec_schedule = min(bests, key=lambda s: (bests[s][2], s != "paci"))
    rec_t, rec_p, _ = bests[rec_schedule]
    a = TrialRecord.read(rec_t)
    described = describe_trial(rec_t, rec_schedule, rec_p, base_lr * rec_p.lr_scale)
    doc: dict[str, Any] = {
        "recommended": {k: described[k] for k in RECOMMENDED if k != "optimizer"},  # the run's, below
        "evidence": {
            "trial": f"{studies[rec_schedule].study_name}#{rec_t.number}",
            "time_to_target": a.time_to_target,
            "reached_target": a.time_to_target is not None,
            "best_val_loss": a.best_val_loss,
            "score": rec_t.value,
            **{k: a.figure(k) for k in EVIDENCE},
            "steps": a.figure("steps"),
        },
    }
    if confirm_seeds:
        doc["confirmation"] = {"seeds": list(confirm_seeds), "level": LEVEL, **(confirm_rounds or {}),
                               **{s: [c.to_dict() for c in table] for s, table in tables.items()}}  # fmt: skip
    if transfer_factor:
        doc["transfer_check"] = transfer.section(studies, transfer_factor, budget.get("seconds"), point_of)
    doc.update(_comparison(studies, bests, confirmed, rec_schedule, budget, warm_started))
    doc["candidates"] = candidates.ranked(studies, point_of)
    if memory is not None:
        doc["memory"] = memory
    doc["target"] = target
    doc["budget"] = budget
    doc["provenance"] = {
        **provenance,
        "trials": {s: trial_counts(st) for s, st in studies.items()},
        "compute": compute_used(studies),
        "versions": {
            "paci_tune": __version__,
            "torch": str(torch.__version__),
            "optuna": optuna.__version__,
            "python": platform.python_version(),
        },
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    if rec_p.chunks != 1:  # interleaved's v: the run's pipeline.chunks, stated beside the rest of the point
        doc["recommended"]["chunks"] = rec_p.chunks
    doc["run"] = run_doc_for(rec_p)
    run = doc["run"] if isinstance(doc["run"], dict) else {}  # what apply trains: its optimizer, PACI's controls
    doc["recommended"]["optimizer"] = from_dict(OptimizerConfig, run.get("optimizer") or {}, "optimizer").settings()
    pipe = run.get("pipeline") or {}
    doc["recommended"].update({k: pipe[k] for k in STALENESS_KEYS if pipe.get(k) not in (None, False)})
    if rec_schedule == "paci" and rec_p.backward_weights is None:  # the space left it to the run: state the run's
        pipe = doc["run"].get("pipeline") if isinstance(doc["run"], dict) else None
        own = pipe.get("backward_weights") if isinstance(pipe, dict) else None
        doc["recommended"]["backward_weights"] = own or DEFAULT_BACKWARD_WEIGHTS
    return doc


def _comparison(
    studies: dict[str, optuna.Study],
    bests: dict[str, tuple[FrozenTrial, TrialParams, float]],
    confirmed: dict[str, Confirmed],
    rec_schedule: str,
    budget: dict[str, Any],
    warm_started: bool = False,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The baseline (the best synchronous schedule), the speedups, the intervals and the verdicts.

    The verdict is PACI against the baseline; with another baseline than 1F1B-flush, PACI against
    1F1B-flush (the paper's comparison) is reported beside it (``verdict_vs_flush``). For a search of
    ``[paci, 1f1b]`` the baseline is flush and the file has the keys and meanings it always had.
    """
    sync = [s for s in bests if s != "paci"]
    paci = bests.get("paci")
    if not sync:
        return {"baseline": None, "baseline_schedule": None, "speedup_vs_flush": None,
                "verdict": "paci" if paci else None,
                "speedup_note": "no synchronous trial finished (or the space has no synchronous schedule)"}  # fmt: skip
    base_s = min(sync, key=lambda s: (bests[s][2], SYNCHRONOUS.index(s)))  # ties: flush first, as the paper's
    bt, bp, b_score = bests[base_s]
    out: dict[str, Any] = {"baseline_schedule": base_s, "baseline": describe_trial(bt, base_s, bp, 0.0)}
    out["baseline"].pop("lr")
    out["baseline"]["trial"] = f"{studies[base_s].study_name}#{bt.number}"
    out["baseline"]["score"] = b_score
    rec_score = bests[rec_schedule][2]
    out["speedup_vs_flush"] = round(bests["1f1b"][2] / rec_score, 4) if "1f1b" in bests else None
    if base_s != "1f1b":
        out["speedup_vs_baseline"] = round(b_score / rec_score, 4)
    notes: list[str] = []
    spacing = validation_spacing([t for t, _, _ in bests.values()], budget)
    if paci is not None:
        vs = "flush" if base_s == "1f1b" else "baseline"
        keys = ("paci_speedup_vs_flush", "paci_speedup_interval") if vs == "flush" else (
            "paci_speedup_vs_baseline", "paci_baseline_interval")  # fmt: skip
        out.update(_against(bests, confirmed, base_s, spacing, warm_started, notes, keys, "verdict"))
        if base_s != "1f1b" and "1f1b" in bests:  # the paper's comparison, beside the strongest baseline's
            flush_notes: list[str] = []
            out.update(_against(bests, confirmed, "1f1b", spacing, warm_started, flush_notes,
                                ("paci_speedup_vs_flush", "paci_speedup_interval"), "verdict_vs_flush"))  # fmt: skip
            notes.append(f"against 1F1B-flush (the paper's baseline): {out['verdict_vs_flush']}, "
                         f"{out['paci_speedup_vs_flush']:g}x")  # fmt: skip
        out["paci_won"] = out["verdict"] == "paci"
    for schedule, who in ((base_s, f"the {base_s} baseline"), (rec_schedule, "the recommendation")):
        if schedule == base_s and who == "the recommendation":
            continue
        c = confirmed.get(schedule)
        missed = (sum(v is None for v in c.time_to_target.values()), len(c.time_to_target)) if c else (
            int(TrialRecord.read(bests[schedule][0]).time_to_target is None), 1)  # fmt: skip
        if missed[0]:
            notes.append(f"{who} missed the target on {missed[0]} of {missed[1]} runs: a miss scores the "
                         "not-reached penalty (budget x (1 + excess loss / target)), so a speedup against it is "
                         "a bound, not a measured ratio of times")  # fmt: skip
    if paci is not None and paci[1].stages == 1:
        notes.append(f"PACI's best is a single stage (P=1 x D={paci[1].data_parallel}): no pipeline and nothing "
                     f"stale, so it trains flush's numbers at window {paci[1].window}; the comparison is between two "
                     "flush-like points, and a gap means the flush study did not find that point, not that PACI's "
                     "asynchrony won")  # fmt: skip
    out["speedup_note"] = "; ".join(notes) if notes else None
    return out


def validation_spacing(trials: list[FrozenTrial], budget: dict[str, Any]) -> float:
    """Time to target's resolution: the clock between two validations. ``budget.seconds / budget.grid`` on
    the clock grid; where the search shared curves (:mod:`paci_tune.tune.sharing`: validations every few
    steps, on each layout's own clock) the widest gap between the validation that reached the target and the
    one before it, over the compared points (far from the target they validate further apart,
    :mod:`paci_tune.train.nearness`: that spacing resolves nothing); the widest gap of all where none reached it."""
    records = [TrialRecord.read(t) for t in trials]
    gaps = [b[0] - a[0] for r in records for a, b in itertools.pairwise(r.curve or [])]
    if gaps and any(r.numerics is not None or r.shared_from is not None for r in records):
        crossing = [b[0] - a[0] for r in records for a, b in itertools.pairwise(r.curve or [])
                    if r.time_to_target is not None and abs(b[0] - r.time_to_target) < 1e-6]  # fmt: skip
        return max(crossing or gaps)
    return float(budget.get("seconds") or 0.0) / int(budget.get("grid") or 1)


def _against(
    bests: dict[str, tuple[FrozenTrial, TrialParams, float]], confirmed: dict[str, Confirmed], base: str,
    spacing: float, warm_started: bool, notes: list[str], keys: tuple[str, str], verdict_key: str,
) -> dict[str, Any]:  # fmt: skip
    """PACI against the synchronous schedule ``base``: ``keys`` (the speedup, its interval) and the verdict
    under ``verdict_key`` (its reason, when undecided, in ``verdict_reason``); notes appended to ``notes``."""
    out: dict[str, Any] = {}
    paci, b_score = bests["paci"], bests[base][2]
    name = "flush" if base == "1f1b" else base
    if "paci" in confirmed and base in confirmed:
        point, low, high = confirm.paired_speedup(confirmed[base], confirmed["paci"])
        out[keys[0]], out[keys[1]] = round(point, 4), [round(low, 4), round(high, 4)]
        out[verdict_key] = confirm.verdict(low, high)
        seeds = sorted(set(confirmed[base].scores) & set(confirmed["paci"].scores))
        notes.append(f"confirmed on {len(seeds)} paired seeds; {LEVEL:.0%} bootstrap interval of {name}'s mean "
                     f"score over PACI's: [{low:.3g}, {high:.3g}]")  # fmt: skip
        if out[verdict_key] != "tie" and abs(confirmed[base].mean - confirmed["paci"].mean) < spacing:
            # Runs that reach the target at the same validation on every seed give an interval of no width
            # (warm starts do: little seed noise is left), but a gap below one interval is not resolved.
            out[verdict_key] = "tie"
            notes.append(f"the interval excludes 1, but the mean times differ by less than one validation interval "
                         f"({spacing:.3g}s), the resolution of time to target: a tie")  # fmt: skip
    else:
        out[keys[0]] = round(b_score / paci[2], 4)
        tied = abs(paci[2] - b_score) < spacing
        out[verdict_key] = "tie" if tied else ("paci" if paci[2] < b_score else "flush")
        notes.append("not confirmed: single draws of the search (an anecdote; search.confirm gives an interval)")
        if tied:
            notes.append(f"PACI and {name} are within one validation interval ({spacing:.3g}s), the resolution of "
                         "time to target")  # fmt: skip
    if misses := _misses(bests, confirmed, base):
        out[verdict_key] = confirm.UNDECIDED
        if verdict_key == "verdict":
            advice = confirm.what_to_change(warm_started)
            out["verdict_reason"] = (f"{misses} missed the target, so the ratio above compares not-reached penalties "
                                     f"(final losses), not times to accuracy; {advice}")  # fmt: skip
    return out


def _misses(
    bests: dict[str, tuple[FrozenTrial, TrialParams, float]], confirmed: dict[str, Confirmed], base: str = "1f1b"
) -> str:
    """Which compared runs missed the target (``"flush's best on 1 of 3 confirmed runs"``), empty when none did.

    The compared runs are each schedule's confirmed point over its fresh seeds, or its best search draw
    when the search was not confirmed.
    """
    said = []
    for schedule, who in (("paci", "PACI's best"), (base, "flush's best" if base == "1f1b" else f"{base}'s best")):
        c = confirmed.get(schedule)
        if c is not None:
            n, total, what = confirm.missed(c), len(c.scores), "confirmed runs"
        else:
            n, total, what = int(TrialRecord.read(bests[schedule][0]).time_to_target is None), 1, "search draw"
        if n:
            said.append(f"{who} on {n} of {total} {what}")
    return " and ".join(said)
