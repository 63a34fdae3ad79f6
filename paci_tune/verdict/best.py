"""``best.yaml``: the recommendation, the evidence behind it, and the verdict against the strongest tuned baseline.

Only finished (not pruned) trials are candidates: a pruned trial never showed it reaches the target.
The verdict (:mod:`.compare`) is one comparison: PACI's best pipelined point against the strongest
synchronous point over every layout, each chosen on the search's draws and read on fresh seeds with the
sequential paired test (:mod:`paci_tune.tune.comparison`), since an efficient method has to beat the
strongest baseline, not the easiest (No Train No Gain). best.yaml keeps it whole under ``comparison``
(the two points, the method, n, the per-seed ratios, the interval, why the confirmation stopped), and
``verdict`` and ``baseline_schedule`` beside it for a reader that wants one word. The recommendation
follows the verdict: PACI only where it is shown faster. ``lr_edges`` names a compared point whose LR
sits at the edge of its grid (:mod:`.edges`): a point at an unexplored edge is not tuned.

The file also carries ``run``: the complete run configuration of the recommended trial, which
``paci-tune apply`` trains -- with ``pipeline.data_parallel``, so it runs on the P x D devices the
trial was timed on (``recommended`` states P, D, a, b and the devices, and for PACI the
``backward_weights`` the run has: the point's, else the run's own; null for flush). The document
is written through ``best.yaml``'s schema (:mod:`paci_tune.tune.bestfile`). May import: optuna, torch and
scipy (their versions), :mod:`paci_tune.config`, :mod:`paci_tune.errors`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.tune` and the verdict layer's :mod:`.confirm`, :mod:`.transfer`, :mod:`.compare`, :mod:`.edges`.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import platform
from typing import Any

import optuna
import scipy
import torch
from optuna.trial import FrozenTrial, TrialState

from .. import __version__
from ..config.layout import Layout
from ..config.optimizer import OptimizerConfig
from ..config.schema import STALENESS_KEYS, from_dict
from ..errors import ConfigError
from ..schedule import DEFAULT_CHUNKS, schedule_of
from ..tune.bestfile import EVIDENCE, RECOMMENDED
from ..tune.choices import DEFAULT_BACKWARD_WEIGHTS
from ..tune.comparison import LEVEL, Design
from ..tune.point import TrialParams
from ..tune.record import TrialRecord
from . import candidates, confirm, transfer
from .compare import best_trial, recommended_schedule, verdict_of
from .confirm import Confirmed
from .edges import lr_edges


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
    spec = schedule_of(schedule)
    bw = p.get("backward_weights", r.backward_weights) if spec.asynchronous else None
    v = spec.chunks_of(int(p.get("chunks", DEFAULT_CHUNKS)))  # interleaved's v is its study's parameter
    opt, stale = p.get("optimizer", r.optimizer), p.get("staleness", r.staleness) if spec.asynchronous else None
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
    design: Design | None = None,
    lr_grid: list[float] | dict[str, float] | None = None,
) -> dict[str, Any]:
    """The ``best.yaml`` document (module docstring); ConfigError when no trial finished.

    With ``confirm_seeds``, the verdict reads the compared points on those seeds with ``design`` (the
    sequential test; default: one look at all of them); without, the search's single draws (an anecdote,
    and the file says so). ``confirm_rounds``: the confirmation's minimum and cap, its tolerance and why it
    stopped adding seeds (:mod:`paci_tune.tune.rounds`), written into the ``confirmation`` section as given.
    ``lr_grid``: the space's LR scales (a list, ``[1.0]`` where it fixes the LR, or ``{low, high}`` for a
    range), for the LR edge rule (:mod:`.edges`); None: not checked.
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
    chosen = {s: t for s, st in studies.items() if (t := _chosen_trial(st, tables.get(s))) is not None}
    if not chosen:
        raise ConfigError(
            "search",
            "no finished trial",
            "at least one trial that ran to its target or budget: "
            "see the failure reasons above, or give budget.seconds / target.value room",
        )
    spacing = validation_spacing(list(chosen.values()), budget)
    if seeds and design is None:
        design = Design(len(seeds), max(len(seeds), 2))
    found = verdict_of(
        studies,
        tables,
        point_of,
        design if seeds else None,
        spacing=spacing,
        advice=confirm.what_to_change(warm_started),
    )
    comparison = found[0] if found else None
    if found:
        chosen.update(found[1])
    means = {s: _mean(t, tables.get(s)) for s, t in chosen.items()}
    rec_schedule = recommended_schedule(comparison, means)
    rec_t = chosen[rec_schedule]
    rec_p = point_of(rec_t, rec_schedule)
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
    compared_points = {s: point_of(t, s) for s, t in found[1].items()} if found else {rec_schedule: rec_p}
    edges = lr_edges(compared_points, lr_grid) if lr_grid is not None else []
    if comparison is not None:
        comparison.notes.extend(e["note"] for e in edges)
        doc["verdict"] = comparison.verdict
        doc["baseline_schedule"] = comparison.baseline["schedule"]
        doc["comparison"] = comparison.to_doc()
    if edges:
        doc["lr_edges"] = edges
    if confirm_seeds:
        doc["confirmation"] = {
            "seeds": list(confirm_seeds),
            "level": LEVEL,
            **(confirm_rounds or {}),
            **{s: [c.to_dict() for c in table] for s, table in tables.items()},
        }
    if transfer_factor:
        doc["transfer_check"] = transfer.section(studies, transfer_factor, budget.get("seconds"), point_of)
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
            "scipy": scipy.__version__,
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
    if schedule_of(rec_schedule).asynchronous and rec_p.backward_weights is None:  # the space left it: the run's
        pipe = doc["run"].get("pipeline") if isinstance(doc["run"], dict) else None
        own = pipe.get("backward_weights") if isinstance(pipe, dict) else None
        doc["recommended"]["backward_weights"] = own or DEFAULT_BACKWARD_WEIGHTS
    return doc


def _chosen_trial(study: optuna.Study, table: list[Confirmed] | None) -> FrozenTrial | None:
    """A schedule's chosen point: its search-ranked best confirmed point (the plan's first with runs), else its
    best search draw."""
    for c in table or []:
        if c.complete:
            return next(t for t in study.get_trials(deepcopy=False) if t.number == c.trial)
    return best_trial(study)


def _mean(t: FrozenTrial, table: list[Confirmed] | None) -> float:
    """The chosen point's score: its confirmed mean, else its search draw."""
    c = next((c for c in table or [] if c.trial == t.number and c.complete), None)
    return c.mean if c is not None else float(t.value)  # type: ignore[arg-type]


def validation_spacing(trials: list[FrozenTrial], budget: dict[str, Any]) -> float:
    """Time to target's resolution: the clock between two validations. ``budget.seconds / budget.grid`` on
    the clock grid; where the search shared curves (:mod:`paci_tune.tune.sharing`: validations every few
    steps, on each layout's own clock) the widest gap between the validation that reached the target and the
    one before it, over the compared points (far from the target they validate further apart,
    :mod:`paci_tune.train.nearness`: that spacing resolves nothing); the widest gap of all where none reached it."""
    records = [TrialRecord.read(t) for t in trials]
    gaps = [b[0] - a[0] for r in records for a, b in itertools.pairwise(r.curve or [])]
    if gaps and any(r.numerics is not None or r.shared_from is not None for r in records):
        crossing = [
            b[0] - a[0]
            for r in records
            for a, b in itertools.pairwise(r.curve or [])
            if r.time_to_target is not None and abs(b[0] - r.time_to_target) < 1e-6
        ]
        return max(crossing or gaps)
    return float(budget.get("seconds") or 0.0) / int(budget.get("grid") or 1)
