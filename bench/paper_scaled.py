"""The PACI paper's headline experiment scaled to a 2-core CPU: time to a target on 8 pipeline stages.

The paper (GPT-2 Medium, 8 stages, long runs) reports PACI reaching the target perplexity 1.69x
faster than the fastest 1F1B-flush configuration at global batch 128 and 1.41x at 256 -- 1.83x and
1.48x against flush at the same micro-batch count -- so the gain is larger at the smaller batch,
where flush's bubble is a larger share of its step. Here, the same protocol at CPU scale:

- a GPT of 14 blocks (16 units: embedding, blocks, head) cut into P = 8 stages, trained on the
  built-in corpus with exact numerics (emulated runtime) and timed on the **sim clock**: 8 devices
  of this machine's measured profile, each stage as its own device. 16 units is what interleaved
  1F1B needs at P = 8 (v = 2 chunks a stage, one unit a chunk);
- two global batches G and 2G (the paper's 1:2), the same sim-clock budget and validation set for
  every run, the LR decaying over the budget, every run warm-started (``--warm-start``) from a
  checkpoint of AdamW 1F1B-flush at P = 1 past the loss plateau;
- every schedule tuned over the same grid: micro-batch size b (window / micro-batch count G / b),
  the optimizer (``--optimizers``, default AdamW and Muon) and, for each optimizer, the LR (``--lrs``,
  ``--opt-lrs``). The synchronous schedules are 1F1B-flush and ``--baselines`` (default ZB-H1 and
  interleaved 1F1B with 2 chunks a stage); PACI runs under each ``--backward-weights`` semantics;
- **search, then report on fresh seeds.** Every grid point trains on the search seeds
  (``--search-seeds``). The target is set there (per batch and optimizer, the validation loss the best
  flush point on that optimizer -- lowest median loss at 2/3 of the budget -- has at 2/3 of the budget;
  for "each schedule on its best optimizer", the lowest over the optimizers), and each schedule's best
  point per optimizer is chosen there (lowest mean score: time to target, a miss scored as the search
  does, :func:`paci_tune.tune.objective.score`). Then only the chosen points train again on the fresh
  seeds (``--seeds``, disjoint from the search seeds), and every reported ratio and interval is on the
  fresh seeds alone: the pick's optimism does not reach the figures;
- **the interval**: per fresh seed, r = the baseline's score over PACI's; a paired t-test on log r
  (:class:`paci_tune.tune.comparison.Design`, one look at all fresh seeds: a plain 95% t-interval),
  the speedup its geometric mean. A fresh seed on which either compared run missed the target is
  censored: the comparison is then ``undecided`` with no interval;
- PACI is compared, per optimizer, with the strongest synchronous point on that optimizer (lowest
  search mean among flush's, ZB-H1's and interleaved's bests, flush first on a tie: No Train No Gain,
  beat the strongest baseline, not the easiest), with each synchronous schedule's best, and with
  flush at PACI's micro-batch count (its best LR there: the paper's second comparison); and, "each
  schedule on its best optimizer", PACI's best over every optimizer with the strongest synchronous
  point over every optimizer.

Each distinct curve is trained once (issue 39, :func:`simrun.train_shared`): the synchronous schedules
of one batch, LR, seed and optimizer train plain gradient accumulation over the global batch, one curve
whatever the schedule and micro-batch count, read at each layout's own sim clock; each PACI (a,
semantics) is its own curve. Every run's LR decays over its class's horizon in steps (the most steps
one of its layouts fits in the budget), so a synchronous curve on a fresh seed is trained with every
layout of its class, as on the search seeds (the same horizon, the same LR schedule), and only the
chosen layouts are read. Finished curves are kept in ``--workdir``, so a killed bench resumes where it
stopped; ``--plan`` says how many runs and curves a configuration costs before training any.

    python bench/paper_scaled.py --plan          # the cost: runs and distinct curves
    python bench/paper_scaled.py                 # the table in docs/benchmarks.md (hours on a 2-core CPU)
    python bench/paper_scaled.py --quick         # a minute: a tiny model on 4 stages (CI)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from simrun import (
    Layout,
    _planned,
    _sim_overrides,
    curve_class,
    first_reach,
    run_pool,
    train_shared,
    warm_checkpoint,
    warm_overrides,
)

from paci_tune.calibrate import calibrate
from paci_tune.calibrate.cache import measured_profile
from paci_tune.config import derive_run
from paci_tune.schedule import FLUSH, SYNCHRONOUS, schedule_of
from paci_tune.tune.comparison import Design
from paci_tune.tune.objective import score
from paci_tune.tune.sharing import layout_clock

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer.name": "adamw", "optimizer.betas": [0.9, 0.95]},
    "nadam": {"optimizer.name": "nadam", "optimizer.betas": [0.99, 0.999], "optimizer.momentum_decay": 0.004},
    "muon": {"optimizer.name": "muon", "optimizer.betas": [0.9, 0.95]},
}
"""``--optimizers``' choices: AdamW as every earlier table ran it, NAdam with the asynchronous-pipeline
literature's high momentum, Muon on the hidden matrices (AdamW on the rest)."""
PAPER = {"small": {"batch": 128, "best": 1.69, "same_m": 1.83}, "large": {"batch": 256, "best": 1.41, "same_m": 1.48}}
FULL: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 14, "d_model": 64, "n_head": 2, "block_size": 64},
    "data": {"source": "stdlib"},
    "training": {"seed": 0, "eval_sequences": 128},
    "optimizer": {"name": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1},
    "lr_schedule": {"warmup_fraction": 0.02, "min_ratio": 0.1},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}
QUICK: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 6, "d_model": 32, "n_head": 2, "block_size": 16},
    "data": {"source": "synthetic", "vocab_size": 32, "branching": 4, "n_train": 20_000, "n_val": 2_000},
    "training": {"seed": 0, "eval_sequences": 16},
    "optimizer": {"name": "adamw"},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 0.1},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}
"""The quick mode's model: 8 units, so interleaved (v = 2) fits its P = 4."""
SYNC_ORDER = SYNCHRONOUS
"""The synchronous schedules, flush first: the order ties between them break in (the registry's)."""
BASELINES = tuple(s for s in SYNCHRONOUS if s != FLUSH)
NAMES = {"paci": "PACI", "1f1b": "flush"}


# ------------------------------------------------------------------------------------ the runs
def _layout(warm: dict[int, str], task: dict[str, Any]) -> tuple[dict[str, Any], Layout]:
    """A task's base (its global batch) and layout, from the warm checkpoint of its batch if any."""
    extra: dict[str, Any] = {"pipeline.backward_weights": task["bw"]} if "bw" in task else {}
    extra.update(warm_overrides(warm.get(task["G"])))
    extra.update(OPTIMIZERS[task["opt"]] if "opt" in task else {})
    if schedule_of(task["schedule"]).chunks is None:  # chunks a rank as configured: interleaved's v = 2
        extra["pipeline.chunks"] = 2
    extra.update({"optimizer.lr": task["lr"], "training.seed": task["seed"]})
    return {"G": task["G"]}, (task["schedule"], task["P"], 1, task["a"], extra)


def classes(
    base: dict[str, Any], profile: str, seconds: float, grid: int, warm: dict[int, str], tasks: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The tasks grouped by the curve they train (:func:`simrun.curve_class`): the synchronous schedules of
    one batch, LR, seed and optimizer are one curve whatever their micro-batch count; each PACI (a,
    semantics) its own. Groups keep the tasks' order."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for t in tasks:
        _, lay = _layout(warm, t)
        key = curve_class(_base_for(base, t["G"]), profile, lay, seconds=seconds, grid=grid)
        groups.setdefault(f"{t['G']}:{key}" if key is not None else f"run:{len(groups)}", []).append(t)
    return [{"G": members[0]["G"], "members": members} for members in groups.values()]


def _base_for(base: dict[str, Any], g: int) -> dict[str, Any]:
    return {**base, "training": {**base["training"], "global_batch": g}}


def _one(
    base: dict[str, Any], profile: str, seconds: float, grid: int, warm: dict[int, str], cls: dict[str, Any]
) -> dict[str, Any]:
    """One curve (in a worker process of :func:`simrun.run_pool`): trained once, a row per member task."""
    layouts = [_layout(warm, t)[1] for t in cls["members"]]
    rows = train_shared(_base_for(base, cls["G"]), profile, layouts, seconds=seconds, grid=grid)
    return {**cls, "rows": [{**t, **row} for t, row in zip(cls["members"], rows, strict=True)]}


def _describe(rec: dict[str, Any]) -> str:
    r = rec["rows"][0]
    who = ", ".join(f"{m['schedule']} a={m['a']}" for m in rec["rows"])
    best = r["best_val_loss"] if r["best_val_loss"] is not None else math.nan
    return (
        f"G={r['G']} {r.get('opt', '')} {r.get('bw', ''):7s} lr={r['lr']:.3g} seed {r['seed']}: one curve for "
        f"{who}; {r['steps']} steps, best val {best:.4f}, {rec['wall_s']} s wall"
    )


def _key(depends: Any, cls: dict[str, Any]) -> str:
    """The key :func:`simrun.run_pool` files a curve under (to count, for ``--plan``, what is done)."""
    return hashlib.sha256(json.dumps([depends, cls], sort_keys=True, default=str).encode()).hexdigest()[:16]


def clocks(args: argparse.Namespace, base: dict[str, Any], profile: str, warm: dict[int, str]) -> str:
    """``--clocks``: per optimizer and grid point, each synchronous schedule's global batches in the budget
    and its lag behind the fastest of them (the least, over the steps both run, of the gap between the
    moments every stage has applied a step: > 0 means it trails at every validation step there)."""
    lines = ["| optimizer | G | b | " + " | ".join(["1f1b", *args.baselines]) + " |", "|---|---|---|"]
    lines[1] += "---|" * (1 + len(args.baselines))
    for opt in args.optimizers:
        for g, a in grid_points(args):
            done = {}
            for t in sync_class(args, g, lrs_for(args, opt)[0], args.search_seeds[0], opt):
                if t["a"] == a:
                    cfg, prof = _planned(_base_for(base, g), profile, _layout_overrides(base, profile, args, warm, t))
                    clock, n, _ = layout_clock(cfg, prof)
                    clock.begin_segment(n)
                    done[t["schedule"]] = [clock.model_done(i) for i in range(n)]
            fastest = max(done, key=lambda s: (len(done[s]), -SYNC_ORDER.index(s)))
            cells = []
            for s in ["1f1b", *args.baselines]:
                if s not in done:
                    cells.append("refused")
                    continue
                lag = min((x - y for x, y in zip(done[s], done[fastest], strict=False)), default=0.0)
                cells.append(f"{len(done[s])}" + (" (fastest)" if s == fastest else f" (lag >= {lag * 1e3:.1f} ms)"))
            lines.append(f"| {opt} | {g} | {g // a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _layout_overrides(
    base: dict[str, Any], profile: str, args: argparse.Namespace, warm: dict[int, str], task: dict[str, Any]
) -> dict[str, Any]:
    """The sim-clock run's overrides of one task, as :func:`simrun.train_shared` derives them."""
    _, (schedule, p, d, a, own) = _layout(warm, task)
    return _sim_overrides(_base_for(base, task["G"]), profile, schedule, p, d, a, args.seconds, args.grid, own)


def lrs_for(args: argparse.Namespace, opt: str) -> list[float]:
    """The LR grid of ``opt``: its ``--opt-lrs`` if given, else ``--lrs``."""
    return args.opt_lrs.get(opt, args.lrs)


def grid_points(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (G, a) of the grid: every b of ``--microbatch-sizes`` that divides G into 2 or more
    micro-batches, less ``--skip``."""
    skip = {tuple(int(x) for x in s.split(":")) for s in args.skip}
    return [
        (g, g // b)
        for g in args.batches
        for b in args.microbatch_sizes
        if g % b == 0 and g // b > 1 and (g, b) not in skip
    ]


def sync_class(args: argparse.Namespace, g: int, lr: float, seed: int, opt: str) -> list[dict[str, Any]]:
    """Every synchronous layout of one (G, LR, seed, optimizer): one curve, its LR over their horizon."""
    return [
        {"G": g, "schedule": s, "P": args.stages, "a": a, "lr": lr, "seed": seed, "opt": opt}
        for s in ["1f1b", *args.baselines]
        for gg, a in grid_points(args)
        if gg == g and schedule_of(s).refusal(args.stages, a, schedule_of(s).chunks_of(2)) is None  # DualPipeV: a >= 2P
    ]


def paci_task(args: argparse.Namespace, g: int, a: int, lr: float, seed: int, opt: str, bw: str) -> dict[str, Any]:
    return {"G": g, "schedule": "paci", "bw": bw, "P": args.stages, "a": a, "lr": lr, "seed": seed, "opt": opt}


def search_tasks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every grid point of every schedule on every search seed, seed by seed (a trimmed re-run keeps the
    seeds it finished)."""
    tasks: list[dict[str, Any]] = []
    for seed in args.search_seeds:
        for opt in args.optimizers:
            for g in args.batches:
                for lr in lrs_for(args, opt):
                    tasks += sync_class(args, g, lr, seed, opt)
                    tasks += [
                        paci_task(args, gg, a, lr, seed, opt, bw)
                        for bw in args.backward_weights
                        for gg, a in grid_points(args)
                        if gg == g
                    ]
    return tasks


def fresh_tasks(args: argparse.Namespace, chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chosen points on the fresh seeds: each chosen PACI point's own curve, and each synchronous
    (G, LR, optimizer) a chosen synchronous point is on, trained with every layout of its class."""
    paci = sorted({(p["G"], p["a"], p["lr"], p["opt"], p["bw"]) for p in chosen if p["schedule"] == "paci"})
    sync = sorted({(p["G"], p["lr"], p["opt"]) for p in chosen if p["schedule"] != "paci"})
    tasks: list[dict[str, Any]] = []
    for seed in args.seeds:
        for g, lr, opt in sync:
            tasks += sync_class(args, g, lr, seed, opt)
        tasks += [paci_task(args, g, a, lr, seed, opt, bw) for g, a, lr, opt, bw in paci]
    return tasks


# ------------------------------------------------------------------------------------ the analysis
def loss_at(curve: list[tuple[float, float]], at: float) -> float:
    """The validation loss of the validation nearest to clock ``at``."""
    return min(curve, key=lambda cv: abs(cv[0] - at))[1]


def pkey(p: dict[str, Any]) -> tuple:
    """A point's identity: (G, schedule, a, lr, optimizer, PACI semantics or '')."""
    return (p["G"], p["schedule"], p["a"], p["lr"], p["opt"], p.get("bw") or "")


def points_of(rows: list[dict], seeds: list[int]) -> dict[tuple, dict[str, Any]]:
    """The grid points of ``rows`` on ``seeds``, each with its runs by seed."""
    points: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r["seed"] not in seeds:
            continue
        pt = {
            "G": r["G"],
            "schedule": r["schedule"],
            "a": r["a"],
            "b": r["microbatch_size"],
            "lr": r["lr"],
            "opt": r["opt"],
            "bw": r.get("bw") or "",
            "step_time_s": r["step_time_s"],
        }
        points.setdefault(pkey(pt), {**pt, "runs": {}})["runs"][r["seed"]] = r
    return points


def targets(points: dict[tuple, dict[str, Any]], seconds: float, opt: str | None) -> dict[int, float]:
    """Per batch, the validation loss at 2/3 of the budget of the flush point lowest there (median over
    the search seeds), over every LR on optimizer ``opt`` (None: on every optimizer). Each optimizer's
    comparison has its own target: one that only the other optimizer reaches would censor every run."""
    out: dict[int, float] = {}
    for p in points.values():
        if p["schedule"] == "1f1b" and opt in (None, p["opt"]):
            at = statistics.median(loss_at(r["curve"], 2 * seconds / 3) for r in p["runs"].values())
            out[p["G"]] = min(out.get(p["G"], math.inf), at)
    return out


def scored(
    points: dict[tuple, dict[str, Any]], target: dict[int, float], seconds: float, opt: str | None
) -> dict[tuple, dict[str, Any]]:
    """The points on optimizer ``opt`` (None: every one), each with its time to target per seed, its score
    (a miss scored as the search does) and their mean; ``scored_for`` names the target's optimizer."""
    out: dict[tuple, dict[str, Any]] = {}
    for k, p in points.items():
        if opt not in (None, p["opt"]):
            continue
        t = target[p["G"]]
        times = {s: first_reach(r["curve"], t) for s, r in p["runs"].items()}
        scores = {
            s: (x if x is not None else score(None, p["runs"][s]["best_val_loss"], t, seconds))
            for s, x in times.items()
        }
        out[k] = {
            **p,
            "times": times,
            "scores": scores,
            "mean": statistics.fmean(scores.values()),
            "reached": sum(x is not None for x in times.values()),
            "scored_for": opt or "best",
        }
    return out


def _lowest(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The lowest mean score, ties broken by the smaller LR, then a, then the optimizer's name."""
    return min(points, key=lambda p: (p["mean"], p["lr"], p["a"], p["opt"]))


def choose(points: dict[tuple, dict[str, Any]], g: int, bw: str, opt: str | None) -> dict[str, dict[str, Any]]:
    """The chosen points of batch ``g`` for PACI semantics ``bw`` on optimizer ``opt`` (None: every optimizer,
    each schedule on its best) by their search means: each schedule's best, the strongest synchronous,
    flush at PACI's window."""
    mine = [p for p in points.values() if p["G"] == g and (opt is None or p["opt"] == opt) and p["bw"] in ("", bw)]
    best = {
        s: _lowest([p for p in mine if p["schedule"] == s])
        for s in ["paci", *SYNC_ORDER]
        if any(p["schedule"] == s for p in mine)
    }
    sync = [best[s] for s in SYNC_ORDER if s in best]
    strongest = min(sync, key=lambda p: (p["mean"], SYNC_ORDER.index(p["schedule"])))
    same_m = _lowest([p for p in mine if p["schedule"] == "1f1b" and p["a"] == best["paci"]["a"]])
    return {**best, "strongest": strongest, "same_m": same_m}


def compare(paci: dict[str, Any], base: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """PACI's chosen point against a baseline's on the fresh seeds: per seed r = the baseline's score over
    PACI's; a paired t-test on log r (:class:`Design`, one look at all the seeds); a seed where either
    run missed the target makes the comparison undecided (a censored time)."""
    ratios = [base["scores"][s] / paci["scores"][s] for s in seeds]
    missed = sum(paci["times"][s] is None or base["times"][s] is None for s in seeds)
    look = Design(len(seeds), len(seeds)).look(ratios, missed)
    return {
        "baseline": _label(base),
        "baseline_schedule": base["schedule"],
        "paci": _label(paci),
        "seeds": seeds,
        "paci_scores": [paci["scores"][s] for s in seeds],
        "baseline_scores": [base["scores"][s] for s in seeds],
        "ratios": ratios,
        "missed": missed,
        "speedup": look.speedup,
        "low": look.low,
        "high": look.high,
        "verdict": look.verdict,
        "paci_mean": statistics.fmean(paci["scores"][s] for s in seeds),
        "baseline_mean": statistics.fmean(base["scores"][s] for s in seeds),
    }


def _label(p: dict) -> str:
    bw = f" {p['bw']}" if p.get("bw") else ""
    return f"{NAMES.get(p['schedule'], p['schedule'])}{bw} a={p['a']} b={p['b']} lr={p['lr']:.3g} {p['opt']}"


def _public(p: dict) -> dict:
    keep = ("G", "schedule", "bw", "a", "b", "lr", "opt", "step_time_s", "mean", "reached", "scored_for")
    return {k: p[k] for k in keep} | {
        "label": _label(p),
        "scores": {str(s): v for s, v in p["scores"].items()},
        "times": {str(s): v for s, v in p["times"].items()},
    }


def analyse(rows: list[dict], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """The search points, the targets, the choices; then, where the fresh seeds' rows are there, the
    comparisons on them (``results``: one per semantics, optimizer -- or ``best`` -- and batch). Each
    optimizer's rows are scored against its own target, ``best``'s against the target over both."""
    runs, fresh_runs = points_of(rows, args.search_seeds), points_of(rows, args.seeds)
    target, search, fresh = {}, {}, {}
    for opt in [*args.optimizers, None]:
        name = opt or "best"
        target[name] = targets(runs, seconds, opt)
        search[name] = scored(runs, target[name], seconds, opt)
        fresh[name] = scored(fresh_runs, target[name], seconds, opt)
    results, chosen = [], []
    for bw in args.backward_weights:
        for opt in [*args.optimizers, None]:
            name = opt or "best"
            for g in args.batches:
                pick = choose(search[name], g, bw, opt)
                chosen += pick.values()
                res: dict[str, Any] = {
                    "G": g,
                    "bw": bw,
                    "opt": name,
                    "target": target[name][g],
                    "chosen": {k: _label(p) for k, p in pick.items()},
                    "search_mean": {k: p["mean"] for k, p in pick.items()},
                    "search_reached": {k: p["reached"] for k, p in pick.items()},
                }
                if fresh_runs:
                    f = {k: fresh[name][pkey(p)] for k, p in pick.items()}
                    res["fresh_mean"] = {k: p["mean"] for k, p in f.items()}
                    res["fresh_reached"] = {k: p["reached"] for k, p in f.items()}
                    res["ratios"] = {k: compare(f["paci"], f[k], args.seeds) for k in f if k != "paci"}
                results.append(res)
    keep = {(p["scored_for"], pkey(p)) for p in chosen}
    return {
        "target": target,
        "results": results,
        "chosen": chosen,
        "search_points": [_public(p) for pts in search.values() for p in pts.values()],
        "fresh_points": [_public(p) for name, pts in fresh.items() for k, p in pts.items() if (name, k) in keep],
    }


def check(rows: list[dict], doc: dict[str, Any], seconds: float) -> None:
    """What holds on any machine: PACI's simulated step is never longer than flush's at the same
    (G, a, optimizer) (no bubble); the best flush over every optimizer reaches its own target on the
    search seeds, its mean inside the budget; every
    interval holds its point; the fresh seeds are not the search seeds."""
    by = {(r["G"], r["schedule"], r["a"], r["opt"]): r["step_time_s"] for r in rows}
    for (g, s, a, o), t in by.items():
        if s == "paci":
            flush = by[(g, "1f1b", a, o)]
            assert t <= flush * (1 + 1e-9), f"PACI step {t} > flush's {flush} at G={g} a={a} {o}"
    assert not set(doc["search_seeds"]) & set(doc["seeds"]), "fresh seeds must not be search seeds"
    for res in doc["results"]:  # each row's target is a flush point's, so its best flush reaches it
        assert res["search_reached"]["1f1b"] > 0 and res["search_mean"]["1f1b"] <= seconds * (1 + 1e-9), res
        for r in res["ratios"].values():
            assert r["low"] is None or r["low"] <= r["speedup"] <= r["high"], r


# ------------------------------------------------------------------------------------ the report
def _ratio(r: dict) -> str:
    if r["low"] is None:
        return f"{r['speedup']:.2f}x, no interval ({r['missed']} seed(s) missed) ({r['verdict']})"
    return f"{r['speedup']:.2f}x [{r['low']:.2f}, {r['high']:.2f}] ({r['verdict']})"


def _short(label: str) -> str:
    return label.replace("PACI forward ", "PACI ").replace("PACI current ", "PACI ")


def _who(res: dict[str, Any], seeds: int, k: str) -> str:
    """A chosen point, its search and fresh means and its fresh reach."""
    return (
        f"{_short(res['chosen'][k])}: {res['search_mean'][k]:.2f} -> {res['fresh_mean'][k]:.2f} s, "
        f"{res['fresh_reached'][k]}/{seeds}"
    )


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"P = {args.stages} stages on the sim clock, {args.seconds:g} s budget; points chosen on search seeds "
        f"{args.search_seeds}, reported on fresh seeds {args.seeds}; speedup = geometric mean over the fresh "
        "seeds of the baseline's time to target over PACI's, 95% paired t-interval on the log ratios "
        "(none when a compared run missed the target on a fresh seed: undecided).\n",
        "| backward weights | optimizer | G | target | PACI (search mean -> fresh mean, reached) | strongest "
        "synchronous (search -> fresh, reached) | speedup over the strongest | per-seed ratios | over best flush "
        "| over flush at PACI's m |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in doc["results"]:
        r = res["ratios"]
        who = functools.partial(_who, res, len(args.seeds))
        per_seed = ", ".join(f"{x:.2f}" for x in r["strongest"]["ratios"])
        lines.append(
            f"| {res['bw']} | {res['opt']} | {res['G']} | {res['target']:.3f} | {who('paci')} | "
            f"{who('strongest')} | {_ratio(r['strongest'])} | {per_seed} | {_ratio(r['1f1b'])} | "
            f"{_ratio(r['same_m'])} ({_short(res['chosen']['same_m'])}) |"
        )
    lines += [
        "",
        "Each schedule's chosen point (search mean over the search seeds, then the fresh seeds' mean and "
        "reach) and PACI's ratio over it on the fresh seeds:",
        "",
        "| backward weights | optimizer | G | schedule | chosen point | search mean (s) | fresh mean (s) | "
        "fresh reached | PACI over it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in doc["results"]:
        for k in ["paci", *SYNC_ORDER]:
            if k not in res["chosen"]:
                continue
            rat = _ratio(res["ratios"][k]) if k != "paci" else ""
            lines.append(
                f"| {res['bw']} | {res['opt']} | {res['G']} | {NAMES.get(k, k)} | {_short(res['chosen'][k])} "
                f"| {res['search_mean'][k]:.2f} | {res['fresh_mean'][k]:.2f} | "
                f"{res['fresh_reached'][k]}/{len(args.seeds)} | {rat} |"
            )
    lines += [
        "",
        f"Every grid point on the search seeds {args.search_seeds} (mean score against its optimizer's "
        "target; a miss scored as the search does):",
        "",
        "| G | schedule | a (m) | b | lr | optimizer | sim step (s) | reached | mean score (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {s: i for i, s in enumerate(["paci", *SYNC_ORDER])}
    own = [p for p in doc["search_points"] if p["scored_for"] == p["opt"]]
    for p in sorted(own, key=lambda p: (p["G"], p["opt"], order[p["schedule"]], p["bw"], p["a"], p["lr"])):
        name = f"paci {p['bw']}" if p["schedule"] == "paci" else p["schedule"]
        lines.append(
            f"| {p['G']} | {name} | {p['a']} | {p['b']} | {p['lr']:.3g} | {p['opt']} | "
            f"{p['step_time_s']:.4f} | {p['reached']}/{len(p['scores'])} | {p['mean']:.2f} |"
        )
    for bw in args.backward_weights:
        for opt in [*args.optimizers, "best"]:
            lines += [
                "",
                f"PACI {bw}, {opt}: " + direction([r for r in doc["results"] if r["bw"] == bw and r["opt"] == opt]),
            ]
    return "\n".join(lines) + "\n"


def direction(results: list[dict]) -> str:
    """Whether the paper's direction (a larger gain at the smaller batch) and size hold here."""
    small, large = (r["ratios"]["1f1b"] for r in results)
    if small["low"] is None or large["low"] is None:
        d = "undecided: a compared run missed the target on a fresh seed"
    elif small["low"] > large["high"]:
        d = "holds: the gain at the smaller batch is larger, with disjoint intervals"
    elif small["speedup"] > large["speedup"]:
        d = "points the paper's way (a larger gain at the smaller batch) but the intervals overlap"
    else:
        d = "does not hold: the gain at the smaller batch is not larger"
    return (
        f"Direction over the best flush: {d}. Size: {small['speedup']:.2f}x and {large['speedup']:.2f}x here "
        f"against the paper's {PAPER['small']['best']}x and {PAPER['large']['best']}x."
    )


WHAT = {"1f1b": "best flush", "same_m": "flush at same m", "strongest": "strongest synchronous"}


def draw(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    fig, ax = plt.subplots(figsize=(1.9 * len(results) + 1, 3.8))
    labels, x = [], 0.0
    papers = {
        g: paper for g, paper in zip(sorted({r["G"] for r in results}), (PAPER["small"], PAPER["large"]), strict=True)
    }
    paper_key = {"1f1b": "best", "same_m": "same_m"}
    for res in results:
        paper = papers[res["G"]]
        for name, color in (("1f1b", "tab:blue"), ("same_m", "tab:green"), ("strongest", "tab:red")):
            r, what = res["ratios"][name], WHAT[name]
            if r["low"] is not None:
                ax.errorbar(
                    [x],
                    [r["speedup"]],
                    yerr=[[r["speedup"] - r["low"]], [r["high"] - r["speedup"]]],
                    fmt="o",
                    color=color,
                    capsize=4,
                    label=f"here: vs {what}",
                )
            else:
                ax.plot([x], [r["speedup"]], marker="x", color=color, linestyle="none", label=f"here: vs {what}")
            if name in paper_key:  # the paper compared with flush only
                ax.plot(
                    [x + 0.25],
                    [paper[paper_key[name]]],
                    marker="*",
                    markersize=10,
                    color=color,
                    alpha=0.5,
                    linestyle="none",
                    label=f"paper: vs {what}",
                )
            x += 1
        labels.append((x - 2, f"G={res['G']} {res['opt']}\n{res['bw']}"))
        x += 0.5
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("PACI speedup in time to target")
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="best")
    ax.set_title(
        "PACI over synchronous baselines on fresh seeds, sim clock (bars: 95% paired t-interval; "
        "x: a miss, no interval)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main
def _opt_lrs(spec: str) -> tuple[str, list[float]]:
    name, _, lrs = spec.partition("=")
    if name not in OPTIMIZERS or not lrs:
        raise argparse.ArgumentTypeError(f"OPT=LR,LR,... with OPT one of {list(OPTIMIZERS)}: {spec!r}")
    return name, [float(x) for x in lrs.split(",")]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs=2, default=[16, 32], help="The two global batches (paper: 1:2).")
    ap.add_argument(
        "--microbatch-sizes",
        type=int,
        nargs="+",
        default=[4, 2, 1],
        help="Micro-batch sizes b tried (window / micro-batch count G / b). b = 8 (a = 2 at G = 16) "
        "is left out by default: no schedule reached the target there in earlier tables.",
    )
    ap.add_argument("--skip", nargs="*", default=[], metavar="G:b", help="Grid points left out, e.g. 32:1.")
    ap.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[2e-3, 4e-3, 8e-3],
        help="Peak LRs tried by every schedule on every optimizer without its own --opt-lrs.",
    )
    ap.add_argument(
        "--opt-lrs",
        type=_opt_lrs,
        nargs="*",
        default=[],
        metavar="OPT=LR,LR",
        help="An optimizer's own LR grid, e.g. muon=2e-3,4e-3,8e-3.",
    )
    ap.add_argument(
        "--search-seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="Seeds every grid point trains on; the best points and the target are chosen on them.",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[3, 4, 5, 6, 7, 8],
        help="Fresh seeds the chosen points train on again; every reported ratio is on these alone.",
    )
    ap.add_argument(
        "--backward-weights",
        nargs="+",
        default=["forward"],
        choices=["forward", "current"],
        help="PACI's semantics, each against the same synchronous runs (pipeline.backward_weights).",
    )
    ap.add_argument(
        "--baselines",
        nargs="*",
        default=["zb-h1", "interleaved"],
        choices=BASELINES,
        help="Synchronous schedules tuned beside flush (interleaved runs 2 chunks a stage; the V schedules "
        "2 a rank; DualPipeV only where a >= 2P).",
    )
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0, help="Budget per run on the sim clock.")
    ap.add_argument("--grid", type=int, default=10, help="Validations over the budget.")
    ap.add_argument("--jobs", type=int, default=2, help="Curves trained at once (one thread each).")
    ap.add_argument("--workdir", default="paci-bench-paper", help="The profile and the finished runs.")
    ap.add_argument("--out", default="runs/paper", help="Folder for paper.json, paper.md and paper.png.")
    ap.add_argument(
        "--optimizers",
        nargs="+",
        default=["adamw", "muon"],
        choices=list(OPTIMIZERS),
        help="Every schedule tries each; results per optimizer and each schedule on its best.",
    )
    ap.add_argument(
        "--warm-start",
        type=int,
        default=100,
        metavar="STEPS",
        help="Start every run from a checkpoint of STEPS global batches of AdamW 1F1B-flush at P = 1 "
        "(one per global batch, at --warm-lr), past the loss plateau (0: from scratch).",
    )
    ap.add_argument("--warm-lr", type=float, default=4e-3, help="The warm-up's LR.")
    ap.add_argument("--plan", action="store_true", help="Say how many runs and distinct curves, then stop.")
    ap.add_argument(
        "--clocks",
        action="store_true",
        help="Print each synchronous schedule's sim clock at every grid point (steps in the budget, and how "
        "far the fastest leads it at every validation step), then stop: no training. The synchronous "
        "schedules train one curve, so one whose clock trails another's at every step never wins a point.",
    )
    ap.add_argument("--quick", action="store_true", help="A tiny model on 4 stages: a smoke run (CI).")
    args = ap.parse_args(argv)
    args.opt_lrs = dict(args.opt_lrs)
    if args.quick:
        args.batches, args.microbatch_sizes, args.lrs, args.opt_lrs = [4, 8], [2, 1], [3e-3, 6e-3], {}
        # 2 fresh seeds (the paired t-test's least) and a shorter budget: a smoke run of every path, not figures
        args.search_seeds, args.seeds, args.skip = [0, 1], [2, 3], []
        args.stages, args.seconds, args.grid, args.jobs, args.warm_start = 4, 0.08, 4, 1, 3
    if set(args.seeds) & set(args.search_seeds):
        ap.error(f"--seeds {args.seeds} must be disjoint from --search-seeds {args.search_seeds}")
    if len(args.seeds) < 2:
        ap.error("a paired t-test needs 2 or more fresh --seeds (6 or more for a useful interval)")
    return args


def main() -> None:
    args = parse()
    base = QUICK if args.quick else FULL
    units = base["model"]["n_layer"] + 2
    if any(schedule_of(s).multi_chunk for s in args.baselines) and units < 2 * args.stages:
        sys.exit(f"{args.baselines}: 2 chunks a stage need 2 x {args.stages} units; the model has {units}")
    t0 = time.time()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(set(args.microbatch_sizes))
    probe = derive_run(
        {**base, "training": {**base["training"], "global_batch": args.batches[0]}},
        {"pipeline.stages": args.stages, "pipeline.microbatch_size": sizes[0], "training.steps": 1},
    )
    log = lambda m: print(f"  profile: {m}", file=sys.stderr)  # noqa: E731
    timed = [derive_run(probe.to_doc(), OPTIMIZERS[o]).optimizer for o in args.optimizers]  # each one's step
    if args.quick:
        profile = work / "quick.yaml"
        if not profile.is_file():
            calibrate(
                probe,
                microbatch_sizes=sizes,
                repeats=1,
                warmup=0,
                processes=1,
                p2p_repeats=10,
                log=log,
                optimizers=timed,
            ).save(profile)
    else:
        _, profile = measured_profile(
            probe, microbatch_sizes=sizes, path=work / "profile.yaml", log=log, optimizers=timed
        )
    depends = [base, profile.read_text(), args.seconds, args.grid, args.warm_start or None]
    search = search_tasks(args)
    if args.plan:
        plan(args, base, profile, depends, search, work / "curves.jsonl")
        return
    warm: dict[int, str] = {}
    for g in args.batches if args.warm_start else []:
        folder = work / f"warm-G{g}-{args.warm_start}-lr{args.warm_lr:g}"
        warm[g] = warm_checkpoint(_base_for(base, g), args.warm_start, folder, {"optimizer.lr": args.warm_lr}, log)
    if args.clocks:
        print(clocks(args, base, str(profile), warm))
        return
    train = functools.partial(_one, base, str(profile), args.seconds, args.grid, warm)
    pool = functools.partial(
        run_pool, fn=train, log=work / "curves.jsonl", jobs=args.jobs, describe=_describe, depends=depends
    )
    curves = classes(base, str(profile), args.seconds, args.grid, warm, search)
    print(f"search: {len(search)} runs of {len(curves)} distinct curves on seeds {args.search_seeds}", file=sys.stderr)
    rows = [row for rec in pool(curves) for row in rec["rows"]]
    picked = analyse(rows, args, args.seconds)
    fresh = fresh_tasks(args, picked["chosen"])
    again = classes(base, str(profile), args.seconds, args.grid, warm, fresh)
    print(f"fresh: {len(fresh)} runs of {len(again)} distinct curves on seeds {args.seeds}", file=sys.stderr)
    rows += [row for rec in pool(again) for row in rec["rows"]]
    found = analyse(rows, args, args.seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    took = round(time.time() - t0, 1)
    doc = {
        "command": "python bench/paper_scaled.py " + " ".join(sys.argv[1:]),
        "took_s": took,
        "model": base["model"],
        "stages": args.stages,
        "seconds": args.seconds,
        "batches": args.batches,
        "search_seeds": args.search_seeds,
        "seeds": args.seeds,
        "optimizers": args.optimizers,
        "lrs": {o: lrs_for(args, o) for o in args.optimizers},
        "microbatch_sizes": args.microbatch_sizes,
        "baselines": ["1f1b", *args.baselines],
        "warm_start": args.warm_start,
        "plan": {
            "search_runs": len(search),
            "search_curves": len(curves),
            "fresh_runs": len(fresh),
            "fresh_curves": len(again),
        },
        "method": "paired t-test on log time ratios over the fresh seeds (Design(n, n).look: one look, 95%)",
        "paper": PAPER,
        "targets": found["target"],
        "results": found["results"],
        "search_points": found["search_points"],
        "fresh_points": found["fresh_points"],
    }
    (out / "paper.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc, args)
    (out / "paper.md").write_text(text)
    draw(doc, out / "paper.png")
    check(rows, doc, args.seconds)  # after writing: a failed check leaves its figures to read
    print(text)
    print(f"{doc['command']}: {took:.0f} s; wrote {out}/paper.{{json,md,png}}")


def plan(
    args: argparse.Namespace, base: dict[str, Any], profile: Path, depends: Any, search: list[dict[str, Any]], log: Path
) -> None:
    """The cost before training: the search's runs and distinct curves (and how many are done), the fresh
    seeds' bounds (exact once the search is done)."""
    curves = classes(base, str(profile), args.seconds, args.grid, {}, search)  # one checkpoint a batch: same classes
    done: dict[str, dict] = {}
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            rec = json.loads(line)
            done[rec["key"]] = rec
        except (json.JSONDecodeError, KeyError):
            continue
    have = sum(_key(depends, c) in done for c in curves)
    n, per = len(args.seeds), len(args.batches) * len(args.optimizers)
    paci = per * len(args.backward_weights) * n
    hi = sum(min(len(lrs_for(args, o)), 3 + 2 * len(args.backward_weights)) for o in args.optimizers) * n
    print(f"search: {len(search)} runs of {len(curves)} distinct curves ({have} done) on seeds {args.search_seeds}")
    print(
        f"fresh: {paci} PACI curves and {len(args.batches) * n} to {len(args.batches) * hi} synchronous curves "
        f"on seeds {args.seeds} (one a chosen (G, LR, optimizer) a seed)"
    )
    if have == len(curves):
        rows = [row for c in curves for row in done[_key(depends, c)]["rows"]]
        fresh = fresh_tasks(args, analyse(rows, args, args.seconds)["chosen"])
        again = classes(base, str(profile), args.seconds, args.grid, {}, fresh)
        print(
            f"fresh, as chosen: {len(fresh)} runs of {len(again)} distinct curves "
            f"({sum(_key(depends, c) in done for c in again)} done)"
        )
    walls = [rec["wall_s"] for rec in done.values() if "wall_s" in rec]
    if walls:
        print(f"the {len(walls)} curves in {log} took {statistics.fmean(walls):.0f} s wall each on average")


if __name__ == "__main__":
    main()
