"""Where can PACI win on tokens? Steps to a fixed validation loss, PACI over flush, over depth x window.

PACI removes the pipeline bubble, so per *second* it wins whenever its statistical efficiency
(loss per step) holds up; what costs it is staleness: a micro-batch's backward at stage s runs
against weights up to ceil((P-s-1)/a) updates newer than its forward. This bench measures that
cost alone, on the emulated runtime (exact numerics, no clock): for each depth P and window a at a
fixed global batch, the steps PACI needs to reach a fixed validation loss over the steps flush
needs at the same window, at every seed, at two learning rates. A ratio of 1 means PACI's
staleness is free; above 1, PACI must be that much faster per step to win on time.

The target is the median, over flush's runs at the first LR, of the validation loss at two thirds
of the step budget, so flush reaches it well inside the budget; runs that never reach it are
censored (shown as ">"; "<": PACI reached it and flush did not, at that seed). Each cell is the
mean over seeds of the paired ratio (same seed, same window, same LR), with the drift bound
ceil((P-1)/a) beside it.

PACI runs once per ``--backward-weights`` semantics (``forward``: each backward reads the weights its
forward used; ``current``: the weights of now), side by side against the same flush runs.

**Each distinct curve is trained once** (issue 39): many tasks of the map train the very same curve,
and training it again only spends the cores. The tasks are grouped by their run's numerics key
(:func:`paci_tune.tune.curves.numerics_key`: equal keys, equal validation curves, tested in
``tests/test_curves.py``); each class trains once, its cheapest member (fewest stages, then fewest
micro-batches), and every task of the class reads that run (its row says which ``class`` and whether
it was the one ``trained``). The data are drawn sequence by sequence (``data.draw: sequence``, unless
the config names a draw), so every split of a global batch sees the same sequences: flush computes
plain gradient accumulation over the global batch, so its curve does not depend on P, a or b (one
run per seed and LR for every window), and PACI on one stage is flush to the bit (it reads flush's
run). PACI on two or more stages depends on P, a and its semantics: each is its own run. The bench
prints and records (``curves``) how many runs it trained for how many tasks.

    python bench/stat_map.py --out runs/stat-map          # the full map, both semantics (~33 min, 2 cores)
    python bench/stat_map.py --quick --out /tmp/map        # seconds: P {1,2} x a {1,2}, one seed (CI)
    python bench/stat_map.py --plan                        # how many distinct curves for how many tasks; trains nothing
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from simrun import first_reach, run_pool

from paci_tune.config import derive_run, load_config
from paci_tune.config.schema import RunConfig
from paci_tune.schedule import drift_bound
from paci_tune.train import resolve_run, run_training
from paci_tune.tune.curves import numerics_key


def run_config(base: dict[str, Any], steps: int, eval_every: int, task: dict[str, Any]) -> RunConfig:
    """A task's run: its schedule, P, a, seed, LR and semantics on ``base``, emulated on the CPU."""
    return derive_run(
        base,
        {
            "pipeline.schedule": task["schedule"],
            "pipeline.stages": task["P"],
            "pipeline.window": task["a"],
            "training.seed": task["seed"],
            "optimizer.lr": task["lr"],
            "training.steps": steps,
            "training.eval_every": eval_every,
            "pipeline.runtime": "emulated",
            "pipeline.device": "cpu",
            "pipeline.partition": "auto",
            "pipeline.backward_weights": task.get("bw", "current"),
            "hardware.memory": None,  # no budget
        },
    )


def train(base: dict[str, Any], steps: int, eval_every: int, task: dict[str, Any]) -> dict:
    """One emulated run (in a worker of :func:`simrun.run_pool`): its validation curve, per-batch
    train losses and per-stage drift."""
    p, a = task["P"], task["a"]
    cfg = run_config(base, steps, eval_every, task)
    curve: list[tuple[int, float]] = []
    losses: list[float] = []

    def on_record(rec: dict[str, Any]) -> None:
        if rec.get("event") == "eval":
            curve.append((int(rec["step"]), float(rec["val_loss"])))
        elif rec.get("event") == "train":
            losses.append(float(rec["loss"]))

    summary = run_training(resolve_run(cfg), on_record=on_record) or {}
    drift = [(st["max_drift"], drift_bound(st["stage"], p, a)) for st in summary.get("stages", [])]
    read_ahead = [st.get("max_read_ahead", 0) for st in summary.get("stages", [])]
    return {**task, "curve": curve, "losses": losses, "drift": drift, "read_ahead": read_ahead}


def classes(base: dict[str, Any], steps: int, eval_every: int, tasks: list[dict]) -> list[dict[str, Any]]:
    """The tasks grouped by the curve they train (their run's numerics key), each class with its lead:
    the member of fewest stages, then fewest micro-batches (the cheapest run), flush before PACI."""
    groups: dict[str, list[dict]] = {}
    for t in tasks:
        key = numerics_key(run_config(base, steps, eval_every, t))
        groups.setdefault(key if key is not None else f"run:{len(groups)}", []).append(t)
    return [
        {
            "class": key,
            "lead": min(members, key=lambda t: (t["P"], t["a"], t["schedule"] != "1f1b")),
            "members": members,
        }
        for key, members in groups.items()
    ]


def shared_rows(tasks: list[dict], curves: list[dict[str, Any]], trained: list[dict]) -> list[dict]:
    """A row per task, in task order: its class's run read as its own (the drift bounds its own P and a's),
    with the ``class`` it was read from and whether it was the run ``trained`` (only that one is timed)."""
    rows: dict[int, dict] = {}
    for cls, rec in zip(curves, trained, strict=True):
        for t in cls["members"]:
            mine = t is cls["lead"]
            drift = [(d, drift_bound(s, t["P"], t["a"])) for s, (d, _) in enumerate(rec["drift"])]
            rows[id(t)] = {
                **t,
                **({"wall_s": rec["wall_s"]} if mine and "wall_s" in rec else {}),
                "curve": rec["curve"],
                "losses": rec["losses"],
                "drift": drift,
                "read_ahead": rec["read_ahead"],
                "class": cls["class"],
                "trained": mine,
            }
    return [rows[id(t)] for t in tasks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--out", default="runs/stat-map", help="folder for map.json, map.md and map.png")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--lr-scales",
        type=float,
        nargs="+",
        default=[1.0, 2.0],
        help="LRs as multiples of the config's (the first: the target's).",
    )
    ap.add_argument(
        "--backward-weights",
        nargs="+",
        default=["forward", "current"],
        choices=["forward", "current"],
        help="PACI's semantics, each run side by side (pipeline.backward_weights).",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="lr_schedule.warmup_fraction: the warm-up as a fraction of the steps.",
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--n-layer", type=int, default=6, help="blocks (at least max(stages) - 2 units' worth)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2, help="Runs trained at once (one thread each).")
    ap.add_argument("--quick", action="store_true", help="P {1,2} x a {1,2}, one seed and LR, 6 steps: a smoke run")
    ap.add_argument("--plan", action="store_true", help="Print how many distinct curves the tasks train, and exit.")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.windows, args.seeds, args.lr_scales = [1, 2], [1, 2], [0], [1.0]
        args.steps, args.eval_every, args.n_layer, args.d_model, args.block_size = 6, 2, 2, 32, 32
    t0 = time.time()
    cfg = load_config(args.config)
    base = cfg.to_doc()
    base["model"] = {
        **base["model"],
        "n_layer": args.n_layer,
        "d_model": args.d_model,
        "n_head": 2,
        "block_size": args.block_size,
    }
    base["training"] = {k: v for k, v in base["training"].items() if k not in ("seconds", "target_val_loss")}
    base["training"]["eval_sequences"] = 64 if args.quick else 256
    if args.quick:  # no corpus to read: a small synthetic source
        base["data"] = {"source": "synthetic", "vocab_size": 64, "branching": 4, "n_train": 20_000, "n_val": 4_000}
    base["data"] = {"draw": "sequence", **base["data"]}  # every split sees the same sequences: flush is one curve
    base["pipeline"].pop("microbatch_size", None)
    if args.warmup is not None:
        base["lr_schedule"] = {**base["lr_schedule"], "warmup_fraction": args.warmup}
    lr0 = float(cfg.optimizer.lr)
    tasks = [
        {"schedule": "1f1b", "P": 1, "a": a, "seed": seed, "lr": lr0 * scale}
        for scale in args.lr_scales
        for seed in args.seeds
        for a in args.windows
    ]
    tasks += [
        {"schedule": "paci", "P": p, "a": a, "seed": seed, "lr": lr0 * scale, "bw": bw}
        for bw in args.backward_weights
        for scale in args.lr_scales
        for seed in args.seeds
        for a in args.windows
        for p in args.stages
    ]
    curves = classes(base, args.steps, args.eval_every, tasks)
    shared = f"{len(curves)} distinct curves for {len(tasks)} tasks, each curve trained once"
    print(shared, file=sys.stderr)
    if args.plan:
        return
    trained = run_pool(
        [c["lead"] for c in curves],
        functools.partial(train, base, args.steps, args.eval_every),
        log=Path(args.out) / "runs.jsonl",
        jobs=args.jobs,
        describe=_describe,
        depends=[base, args.steps, args.eval_every],
    )
    runs = shared_rows(tasks, curves, trained)

    def flush_of(r: dict) -> dict:
        key = (r["a"], r["seed"], r["lr"])
        return next(f for f in runs if f["schedule"] == "1f1b" and (f["a"], f["seed"], f["lr"]) == key)

    # Checks that hold whatever the machine: no stage drifts past its bound (that P=1 PACI is flush and
    # every task of a class trains its class's curve, tests/test_benches.py checks against fresh runs).
    for r in runs:
        assert all(d <= b for d, b in r["drift"]), f"drift above the bound: {r['drift']} at P={r['P']} a={r['a']}"
        if r["schedule"] == "paci" and r["bw"] == "forward":
            assert all(x == 0 for x in r.get("read_ahead", [0])), f"a forward-mode backward read newer weights: {r}"
    at = max(1, round(2 * args.steps / 3))
    base_flush = [dict(r["curve"]) for r in runs if r["schedule"] == "1f1b" and r["lr"] == lr0 * args.lr_scales[0]]
    target = statistics.median(min(c.items(), key=lambda kv: abs(kv[0] - at))[1] for c in base_flush)
    cells: dict[str, dict] = {}
    for r in runs:
        if r["schedule"] != "paci":
            continue
        mine, theirs = first_reach(r["curve"], target), first_reach(flush_of(r)["curve"], target)
        cell_reached = mine is not None
        key = f"{r['bw']}|{r['lr']:.3g}|{r['P']}|{r['a']}"
        cell = cells.setdefault(
            key,
            {
                "bw": r["bw"],
                "lr": r["lr"],
                "P": r["P"],
                "a": r["a"],
                "ratios": [],
                "censored": 0,
                "reached": 0,
                "runs": 0,
                "finals": [],
                "paci_only": 0,
                "bound": drift_bound(0, r["P"], r["a"]),
                "max_drift": max((d for d, _ in r["drift"]), default=0),
            },
        )
        cell["runs"] += 1
        cell["reached"] += int(cell_reached)
        cell["finals"].append(r["curve"][-1][1] if r["curve"] else math.nan)
        if mine is not None and theirs is None:
            cell["paci_only"] += 1  # PACI reached the target and flush did not: a win by any ratio
        elif mine is None or theirs is None:
            cell["censored"] += 1
        else:
            cell["ratios"].append(mine / theirs)
    for c in cells.values():
        c["mean"] = statistics.fmean(c["ratios"]) if c["ratios"] else math.nan
        # The most PACI's speed can buy back: flush's step over PACI's on an ideal pipeline (equal
        # stages, free transfers), (a + P - 1) / a. More steps than that and PACI cannot win on time.
        c["payback"] = (c["a"] + c["P"] - 1) / c["a"]
        c["cannot_win"] = (
            c["P"] > 1 and not c["paci_only"] and (c["mean"] >= c["payback"] if c["ratios"] else c["censored"] > 0)
        )
    flush_runs = [r for r in runs if r["schedule"] == "1f1b"]
    flush = {
        "runs": len(flush_runs),
        "reached": sum(first_reach(r["curve"], target) is not None for r in flush_runs),
        "final": statistics.fmean(r["curve"][-1][1] for r in flush_runs if r["curve"]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/stat_map.py " + " ".join(sys.argv[1:]),
        "target_val_loss": target,
        "curves": {"trained": len(curves), "tasks": len(tasks)},
        "base": base,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "jobs": args.jobs,
        "global_batch": cfg.training.global_batch,
        "seconds": round(time.time() - t0, 1),
        "run_seconds": run_seconds(runs, args.jobs),
        "model": base["model"],
        "lr_schedule": base["lr_schedule"],
        "flush": flush,
        "cells": list(cells.values()),
        "stale_limit": stale_limit(list(cells.values())),
        "semantics": paired_semantics(runs, target),
        "runs": runs,
    }
    (out / "map.json").write_text(json.dumps(doc, indent=1))
    table = markdown(doc, args)
    (out / "map.md").write_text(table)
    draw(doc, args, out / "map.png")
    print(table)
    print(f"target val loss {target:.4f}; {shared} in {doc['seconds']:.0f}s; wrote {out}/map.{{json,md,png}}")


def paired_semantics(runs: list[dict], target: float) -> list[dict[str, Any]]:
    """``forward`` against ``current``, run by run: the same P, a, LR and seed, so the same data, init
    and flush partner. Per depth (and over all depths): how many runs each semantics brought to the
    target, in how many pairs ``forward`` reached it in fewer steps / more / the same, and the mean
    difference of the final validation losses (forward - current) with a percentile bootstrap 95%
    interval over the pairs. Empty unless both semantics ran."""
    import numpy as np

    by = {(r["P"], r["a"], r["lr"], r["seed"], r["bw"]): r for r in runs if r["schedule"] == "paci"}
    pairs = [(by[k], by[(*k[:4], "current")]) for k in by if k[4] == "forward" and (*k[:4], "current") in by]
    rows = []
    for p in [*sorted({f["P"] for f, _ in pairs}), None]:
        mine = [(f, c) for f, c in pairs if p is None or f["P"] == p]
        if not mine or (p is None and len({f["P"] for f, _ in pairs}) < 2):
            continue
        diffs = np.array([f["curve"][-1][1] - c["curve"][-1][1] for f, c in mine])
        idx = np.random.default_rng(0).integers(0, len(diffs), size=(4000, len(diffs)))
        lo, hi = np.quantile(diffs[idx].mean(axis=1), [0.025, 0.975])
        steps = [(first_reach(f["curve"], target), first_reach(c["curve"], target)) for f, c in mine]
        rows.append(
            {
                "P": p,
                "pairs": len(mine),
                "reached_forward": sum(f is not None for f, _ in steps),
                "reached_current": sum(c is not None for _, c in steps),
                "forward_sooner": sum(f is not None and (c is None or f < c) for f, c in steps),
                "current_sooner": sum(c is not None and (f is None or c < f) for f, c in steps),
                "final_diff": float(diffs.mean()),
                "final_diff_ci": [float(lo), float(hi)],
                "forward_lower_final": int((diffs < 0).sum()),
            }
        )
    return rows


def stale_limit(cells: list[dict]) -> dict[str, Any]:
    """The smallest drift bound at which PACI cannot win somewhere in the map (any LR), and whether
    it wins -- could win -- in every cell below it: the basis of ``search.paci_max_drift``'s default."""
    deep = [c for c in cells if c["P"] > 1]
    per_depth = {
        str(p): f"{sum(c['cannot_win'] for c in deep if c['P'] == p)}/{sum(c['P'] == p for c in deep)}"
        for p in sorted({c["P"] for c in deep})
    }
    hopeless = sorted({c["bound"] for c in deep if c["cannot_win"]})
    if not hopeless:
        return {"bound": None, "clean_below": True, "separates": True, "cells": [], "per_depth": per_depth}
    lowest = hopeless[0]
    # A bound separates the map when cells above it cannot win and cells at or below it can; when
    # the lowest losing bound is the map's lowest bound, no cut on the bound keeps a winner apart.
    separates = lowest > min(c["bound"] for c in deep)
    return {
        "bound": lowest,
        "clean_below": not any(c["cannot_win"] for c in deep if c["bound"] < lowest),
        "separates": separates,
        "per_depth": per_depth,
        "cells": [f"P={c['P']} a={c['a']} lr={c['lr']:.3g}" for c in deep if c["cannot_win"]],
    }


def _describe(r: dict) -> str:
    last = r["curve"][-1][1] if r["curve"] else float("nan")
    return f"{r['schedule']:5s} P={r['P']} a={r['a']:2d} lr={r['lr']:.3g} seed {r['seed']}: final val {last:.4f}"


def _cell_text(c: dict) -> str:
    if not c["ratios"]:
        only = f" +{c['paci_only']}<" if c["paci_only"] else ""
        return f"> (x{c['censored']}{only}, bound {c['bound']})" + (" **x**" if c["cannot_win"] else "")
    spread = f" [{min(c['ratios']):.2f}-{max(c['ratios']):.2f}]" if len(c["ratios"]) > 1 else ""
    cens = (f" +{c['censored']}>" if c["censored"] else "") + (f" +{c['paci_only']}<" if c["paci_only"] else "")
    mark = " **x**" if c["cannot_win"] else ""
    return f"{c['mean']:.2f}{spread}{cens} (bound {c['bound']}, pays {c['payback']:.2f}){mark}"


def run_seconds(runs: list[dict], jobs: int) -> dict[str, Any]:
    """What the map's runs cost on this machine, from the seconds each took in its worker (a bench
    resumed from its run log only times the runs it trained, so this, not the bench's own wall
    time, says how long one run of the whole map takes): the sum, the mean per window, and the sum
    over ``jobs`` workers -- the wall time of the map from scratch. Only the runs trained count (``of``):
    a task that read its class's run cost nothing."""
    timed = [r for r in runs if "wall_s" in r and r.get("trained", True)]
    by_a: dict[int, list[float]] = {}
    for r in timed:
        by_a.setdefault(r["a"], []).append(r["wall_s"])
    total = sum(r["wall_s"] for r in timed)
    return {
        "timed": len(timed),
        "of": sum(r.get("trained", True) for r in runs),
        "sum": round(total, 1),
        "from_scratch_wall": round(total / jobs, 1),
        "mean_by_window": {a: round(statistics.fmean(v), 1) for a, v in sorted(by_a.items())},
    }


def markdown(doc: dict, args: argparse.Namespace) -> str:
    lines = []
    for bw in args.backward_weights:
        for lr in sorted({c["lr"] for c in doc["cells"]}, reverse=True):
            lines.append(
                f"\nbackward_weights **{bw}**, lr {lr:.3g}: PACI steps to val loss "
                f"{doc['target_val_loss']:.3f} over flush's (same a, same seed); mean [min-max] over "
                "seeds, drift bound ceil((P-1)/a)\n"
            )
            lines.append("| P \\ a | " + " | ".join(str(a) for a in args.windows) + " |")
            lines.append("|---" * (len(args.windows) + 1) + "|")
            for p in args.stages:
                key = [(bw, lr, p, a) for a in args.windows]
                row = [next(c for c in doc["cells"] if (c["bw"], c["lr"], c["P"], c["a"]) == k) for k in key]
                lines.append(f"| {p} | " + " | ".join(_cell_text(c) for c in row) + " |")
    lines.append(
        "\nRuns that reached the target, and mean final validation loss, per semantics and depth "
        "(all windows, LRs and seeds):\n"
    )
    lines.append("| runs | " + " | ".join(f"P={p}" for p in args.stages) + " |")
    lines.append("|---" * (len(args.stages) + 1) + "|")
    fl = doc["flush"]
    lines.append(
        f"| 1F1B-flush | {fl['reached']} of {fl['runs']}, final {fl['final']:.3f} (any P) |"
        + " |" * (len(args.stages) - 1)
    )
    for bw in args.backward_weights:
        cols = []
        for p in args.stages:
            cs = [c for c in doc["cells"] if c["bw"] == bw and c["P"] == p]
            finals = [f for c in cs for f in c["finals"]]
            cols.append(
                f"{sum(c['reached'] for c in cs)} of {sum(c['runs'] for c in cs)}, final {statistics.fmean(finals):.3f}"
            )
        lines.append(f"| PACI {bw} | " + " | ".join(cols) + " |")
    if doc.get("semantics"):
        lines.append(
            "\n`forward` against `current`, paired run by run (same P, a, LR and seed): runs that reached "
            "the target; pairs where one reached it in fewer steps (or alone); final validation loss, "
            "forward - current, mean with its bootstrap 95% interval over the pairs.\n"
        )
        lines.append(
            "| P | pairs | reached (forward / current) | sooner (forward / current) | "
            "final loss, forward - current | forward lower |"
        )
        lines.append("|---|---|---|---|---|---|")
        for row in doc["semantics"]:
            lo, hi = row["final_diff_ci"]
            lines.append(
                f"| {row['P'] or 'all'} | {row['pairs']} | {row['reached_forward']} / "
                f"{row['reached_current']} | {row['forward_sooner']} / {row['current_sooner']} | "
                f"{row['final_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {row['forward_lower_final']} of "
                f"{row['pairs']} |"
            )
    lim = doc["stale_limit"]
    lines.append(
        "\n**x**: PACI cannot win there -- it needs more steps than removing the bubble can buy back "
        "(`pays` = (a + P - 1) / a, flush's step over PACI's on an ideal pipeline). "
    )
    depth = ", ".join(f"P={p}: {n}" for p, n in lim["per_depth"].items())
    if lim["bound"] is None:
        lines.append("No cell of the map is out of reach.")
    elif not lim["separates"]:
        lines.append(
            f"Cells that cannot win occur at the map's smallest drift bound ({lim['bound']}): no cut on the "
            f"bound separates them from the rest. Cells that cannot win, per depth: {depth}."
        )
    else:
        below = "every cell below it could win" if lim["clean_below"] else "some cells below it cannot win either"
        lines.append(
            f"The smallest drift bound of a cell that cannot win: {lim['bound']} ({', '.join(lim['cells'])}); "
            f"{below}. Per depth: {depth}."
        )
    rs = doc["run_seconds"]
    if rs["timed"]:
        per = ", ".join(f"a={a}: {v:.0f} s" for a, v in rs["mean_by_window"].items())
        lines.append(
            f"\nRuns: {rs['timed']} of {rs['of']} timed (each distinct curve trained once, for "
            f"{len(doc['runs'])} tasks), {rs['sum']:.0f} s in all (per run, mean: {per}); "
            f"from scratch on {doc['jobs']} workers ~{rs['from_scratch_wall'] / 60:.0f} min."
        )
    return "\n".join(lines) + "\n"


def draw(doc: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lrs = sorted({c["lr"] for c in doc["cells"]}, reverse=True)
    bws = args.backward_weights
    fig, axes = plt.subplots(
        len(bws),
        len(lrs),
        squeeze=False,
        figsize=(1.3 * len(args.windows) * len(lrs) + 2, (0.8 * len(args.stages) + 2) * len(bws)),
    )
    for ax, (bw, lr) in zip(axes.flat, [(bw, lr) for bw in bws for lr in lrs], strict=True):
        grid = np.full((len(args.stages), len(args.windows)), np.nan)
        mine = [c for c in doc["cells"] if c["bw"] == bw]
        for c in mine:
            if c["lr"] == lr:
                grid[args.stages.index(c["P"]), args.windows.index(c["a"])] = c["mean"]
        im = ax.imshow(grid, cmap="RdBu_r", vmin=0.5, vmax=1.5, aspect="auto")
        for c in mine:
            if c["lr"] == lr:
                i, j = args.stages.index(c["P"]), args.windows.index(c["a"])
                text = ">" if not c["ratios"] else f"{c['mean']:.2f}"
                mark = "\ncannot win" if c["cannot_win"] else ""
                ax.text(j, i, f"{text}\nbound {c['bound']}{mark}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(args.windows)), [str(a) for a in args.windows])
        ax.set_yticks(range(len(args.stages)), [str(p) for p in args.stages])
        ax.set_xlabel("window a (micro-batches per step)")
        ax.set_ylabel("pipeline depth P")
        ax.set_title(f"PACI ({bw} weights) / flush steps to val {doc['target_val_loss']:.3f}, lr {lr:.3g}", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8, label="< 1: PACI needs fewer steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
