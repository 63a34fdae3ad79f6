"""How much of PACI's loss to flush does each optimizer and staleness control take back? A warm-started map.

PACI's staleness costs loss per step: a micro-batch's gradient at stage s arrives up to
ceil((P-s-1)/a) updates late. The asynchronous-pipeline literature puts most of that cost in the
optimizer (AdamW is the least tolerant) and offers remedies. This bench measures, for each option,
the paired final-loss gap PACI - flush **on the same optimizer**, over depth P and window a, at two
LRs and several seeds, every run starting from one 1F1B-flush checkpoint past the loss plateau (the
long middle of a run, which a warm-started search measures; from step 0 the comparison is decided by
which seeds escape the plateau):

- ``adamw``: AdamW (0.9, 0.95), what every earlier measurement used;
- ``nadam``: NAdam (0.99, 0.999), momentum decay psi (Ajanthan et al., ICML 2025);
- ``muon``: Muon (momentum 0.95) on the hidden matrices, AdamW on the rest;
- ``nadam+stage``: NAdam (0.9, 0.999) with per-stage momentum up to 0.99 (``pipeline.stage_momentum``);
- ``adamw+predict``: AdamW with weight prediction (``pipeline.predict_weights``);
- ``adamw+pipemare``: AdamW with PipeMare's per-stage LR over the whole run (``pipeline.stale_lr: 1``; the
  warm-up is part of the run's progress, so the continuation starts 40% in, at tau_s^-0.6).

Flush's numerics do not depend on P, D or a at a fixed global batch (tested to 1e-5), so each
optimizer's flush partner is trained once per LR and seed. The LR is held constant over the
continuation (the warm-up ended at its peak): each LR is a level the gap is measured at. Every
option's flush partner is its optimizer without the control, so a control is judged by the gap it
closes on its own optimizer, and the flush finals are shown too: closing the gap by training both
worse is no win. A checkpoint of AdamW moves its weights and step count to another optimizer, whose
moments then start fresh, for PACI and flush alike.

    python bench/optimizer_map.py --out runs/optimizer-map        # the table in docs/benchmarks.md
    python bench/optimizer_map.py --quick --out /tmp/omap          # seconds: a smoke run (CI)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from simrun import run_pool, warm_checkpoint, warm_overrides

from paci_tune.config import derive_run, load_config
from paci_tune.train import resolve_run, run_training

NADAM = {"optimizer.name": "nadam", "optimizer.betas": [0.99, 0.999], "optimizer.momentum_decay": 0.004}
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "adamw": ({"optimizer.name": "adamw", "optimizer.betas": [0.9, 0.95]}, {}),
    "nadam": (NADAM, {}),
    "muon": ({"optimizer.name": "muon", "optimizer.betas": [0.9, 0.95]}, {}),
    "nadam+stage": ({**NADAM, "optimizer.betas": [0.9, 0.999]}, {"pipeline.stage_momentum": 0.99}),
    "adamw+predict": ({"optimizer.name": "adamw", "optimizer.betas": [0.9, 0.95]}, {"pipeline.predict_weights": True}),
    "adamw+pipemare": ({"optimizer.name": "adamw", "optimizer.betas": [0.9, 0.95]}, {"pipeline.stale_lr": 1.0}),
}
"""Each option: (its optimizer, which its flush partner shares; PACI's staleness controls)."""
LEVEL = 0.95


def _flush_key(option: str) -> str:
    """The options sharing an optimizer share its flush runs: the first option with that optimizer names them."""
    opt = OPTIONS[option][0]
    return next(name for name, (o, _) in OPTIONS.items() if o == opt)


def _same_as_adamw(option: str, p: int, a: int) -> bool:
    """PipeMare's LR changes only stages whose bound is 2 or more: elsewhere its runs are AdamW's, not run twice."""
    return "pipeline.stale_lr" in OPTIONS[option][1] and -(-(p - 1) // a) <= 1


def train(base: dict[str, Any], steps: int, eval_every: int, warm: str, task: dict[str, Any]) -> dict[str, Any]:
    """One emulated run from the warm checkpoint (in a worker of :func:`simrun.run_pool`): its validation curve."""
    opt, controls = OPTIONS[task["option"]]
    paci = task["schedule"] == "paci"
    cfg = derive_run(
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
            "hardware.memory": None,
            "lr_schedule.min_ratio": 1.0,
            **opt,
            **(controls if paci else {}),
            **warm_overrides(warm),
        },
    )
    curve: list[tuple[int, float]] = []

    def on_record(rec: dict[str, Any]) -> None:
        if rec.get("event") == "eval":
            curve.append((int(rec["step"]), float(rec["val_loss"])))

    summary = run_training(resolve_run(cfg), on_record=on_record) or {}
    return {
        **task,
        "curve": curve,
        "final": curve[-1][1] if curve else float("nan"),
        "max_drift": max((st["max_drift"] for st in summary.get("stages", [])), default=0),
    }


def _interval(values: np.ndarray, draws: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (paired differences)."""
    if len(values) < 2:
        return float(values.mean()), float(values.mean())
    idx = np.random.default_rng(0).integers(0, len(values), size=(draws, len(values)))
    lo, hi = np.quantile(values[idx].mean(axis=1), [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(lo), float(hi)


def analyse(runs: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Per option, P, a and LR the paired gap PACI - flush (same optimizer, LR and seed); per option, P and LR
    the gap over every window and seed, and the share of AdamW's gap the option closes."""
    flush = {(r["option"], r["lr"], r["seed"]): r["final"] for r in runs if r["schedule"] == "1f1b"}
    diffs: dict[tuple[str, int, float], list[tuple[int, int, float]]] = {}
    cells = []
    for r in runs:
        if r["schedule"] != "paci":
            continue
        d = r["final"] - flush[(_flush_key(r["option"]), r["lr"], r["seed"])]
        diffs.setdefault((r["option"], r["P"], r["lr"]), []).append((r["a"], r["seed"], d))
    for (option, p, lr), ds in sorted(diffs.items()):
        for a in sorted({x[0] for x in ds}):
            v = np.array([x[2] for x in ds if x[0] == a])
            lo, hi = _interval(v)
            cells.append(
                {"option": option, "P": p, "a": a, "lr": lr, "gap": float(v.mean()), "ci": [lo, hi], "seeds": len(v)}
            )
    overall, closed = [], []
    for (option, p, lr), ds in sorted(diffs.items()):
        v = np.array([x[2] for x in ds])
        lo, hi = _interval(v)
        overall.append({"option": option, "P": p, "lr": lr, "gap": float(v.mean()), "ci": [lo, hi], "runs": len(v)})
        base = {(a, s): d for a, s, d in diffs.get(("adamw", p, lr), [])}
        pairs = [(base[(a, s)], d) for a, s, d in ds if (a, s) in base]
        if option == "adamw" or not pairs:
            continue
        b, o = np.array([x[0] for x in pairs]), np.array([x[1] for x in pairs])
        idx = np.random.default_rng(1).integers(0, len(pairs), size=(4000, len(pairs)))
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = 1 - o[idx].mean(axis=1) / b[idx].mean(axis=1)
        lo, hi = np.nanquantile(shares, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
        closed.append(
            {
                "option": option,
                "P": p,
                "lr": lr,
                "adamw_gap": float(b.mean()),
                "gap": float(o.mean()),
                "closed": float(1 - o.mean() / b.mean()),
                "ci": [float(lo), float(hi)],
            }
        )
    finals = [
        {
            "optimizer": o,
            "lr": lr,
            "final": statistics.fmean(v for (oo, ll, _), v in flush.items() if oo == o and ll == lr),
        }
        for o in dict.fromkeys(k[0] for k in flush)
        for lr in sorted({k[1] for k in flush})
    ]
    return {"cells": cells, "overall": overall, "closed": closed, "flush_finals": finals}


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Final validation loss after {args.steps} steps from a {args.warm_start}-step AdamW flush checkpoint; "
        "gap = PACI - flush on the same optimizer, LR and seed (mean, 95% bootstrap interval).",
        "",
        "Flush's final loss per optimizer (the level each option's gap is measured against):",
        "",
        "| optimizer | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |",
        "|---|" + "---|" * len(args.lrs),
    ]
    for o in dict.fromkeys(f["optimizer"] for f in res["flush_finals"]):
        row = {f["lr"]: f["final"] for f in res["flush_finals"] if f["optimizer"] == o}
        lines.append(f"| {o} | " + " | ".join(f"{row[lr]:.4f}" for lr in args.lrs) + " |")
    lines += [
        "",
        "Gap over every window and seed, and the share of AdamW's gap each option closes (paired by window and seed):",
        "",
        "| option | P | lr | gap PACI - flush | share of AdamW's gap closed |",
        "|---|---|---|---|---|",
    ]
    closed = {(c["option"], c["P"], c["lr"]): c for c in res["closed"]}
    for g in res["overall"]:
        c = closed.get((g["option"], g["P"], g["lr"]))
        share = f"{c['closed']:+.0%} [{c['ci'][0]:+.0%}, {c['ci'][1]:+.0%}]" if c else "-"
        lines.append(
            f"| {g['option']} | {g['P']} | {g['lr']:g} | {g['gap']:+.4f} [{g['ci'][0]:+.4f}, "
            f"{g['ci'][1]:+.4f}] | {share} |"
        )
    for p in args.stages:
        for lr in args.lrs:
            lines += [
                "",
                f"P = {p}, lr {lr:g}: gap per window a (mean [interval] over seeds)",
                "",
                "| option | " + " | ".join(f"a={a}" for a in args.windows) + " |",
                "|---|" + "---|" * len(args.windows),
            ]
            for o in OPTIONS if not args.options else args.options:
                cell = {c["a"]: c for c in res["cells"] if (c["option"], c["P"], c["lr"]) == (o, p, lr)}
                lines.append(
                    f"| {o} | "
                    + " | ".join(
                        f"{cell[a]['gap']:+.3f} [{cell[a]['ci'][0]:+.3f}, {cell[a]['ci'][1]:+.3f}]"
                        if a in cell
                        else "-"
                        for a in args.windows
                    )
                    + " |"
                )
    return "\n".join(lines) + "\n"


def draw(res: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(args.lrs),
        len(args.stages),
        figsize=(4.6 * len(args.stages), 3.4 * len(args.lrs)),
        squeeze=False,
        sharey=True,
    )
    for i, lr in enumerate(args.lrs):
        for j, p in enumerate(args.stages):
            ax = axes[i][j]
            for o in OPTIONS if not args.options else args.options:
                cs = sorted(
                    (c for c in res["cells"] if (c["option"], c["P"], c["lr"]) == (o, p, lr)), key=lambda c: c["a"]
                )
                if cs:
                    ax.errorbar(
                        [c["a"] for c in cs],
                        [c["gap"] for c in cs],
                        capsize=2,
                        marker="o",
                        markersize=3,
                        yerr=[[c["gap"] - c["ci"][0] for c in cs], [c["ci"][1] - c["gap"] for c in cs]],
                        label=o,
                    )
            ax.axhline(0, color="grey", linewidth=0.8)
            ax.axhline(0.02, color="grey", linewidth=0.6, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_title(f"P = {p}, lr {lr:g}", fontsize=9)
            ax.set_xlabel("window a")
            if j == 0:
                ax.set_ylabel("final loss, PACI - flush")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        "PACI's final-loss gap to flush on the same optimizer (warm-started; bars: 95% over seeds; dotted: 0.02)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--out", default="runs/optimizer-map", help="folder for map.json, map.md and map.png")
    ap.add_argument("--options", nargs="+", default=None, choices=list(OPTIONS), help="Options (default: all).")
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 5e-4])
    ap.add_argument("--warm-start", type=int, default=100, help="Steps of the AdamW flush warm-up runs start from.")
    ap.add_argument("--steps", type=int, default=150, help="Steps each run trains from the warm checkpoint.")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2, help="Runs trained at once (one thread each).")
    ap.add_argument("--workdir", default=None, help="Warm-up and finished runs (default: OUT).")
    ap.add_argument("--quick", action="store_true", help="A tiny model, P {2, 4} x a {1, 2}, one seed: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.windows, args.seeds, args.lrs = [2, 4], [1, 2], [0], [3e-3]
        args.warm_start, args.steps, args.eval_every, args.n_layer, args.d_model = 4, 6, 3, 2, 32
    t0 = time.time()
    cfg = load_config(args.config)
    base = cfg.to_doc()
    base["model"] = {**base["model"], "n_layer": args.n_layer, "d_model": args.d_model, "n_head": 2, "block_size": 64}
    base["training"] = {k: v for k, v in base["training"].items() if k not in ("seconds", "target_val_loss")}
    base["training"]["eval_sequences"] = 32 if args.quick else 128
    if args.quick:  # no corpus to read: a small synthetic source
        base["data"] = {"source": "synthetic", "vocab_size": 64, "branching": 4, "n_train": 20_000, "n_val": 4_000}
        base["model"]["block_size"] = 16
    base["pipeline"].pop("microbatch_size", None)
    work = Path(args.workdir or args.out)
    log = lambda m: print(f"  {m}", file=sys.stderr)  # noqa: E731
    warm = warm_checkpoint(
        base,
        args.warm_start,
        work / f"warm-{args.warm_start}",
        {"optimizer.lr": args.lrs[0], "optimizer.name": "adamw"},
        log,
    )
    options = args.options or list(OPTIONS)
    total = args.warm_start + args.steps
    flush_opts = list(dict.fromkeys(_flush_key(o) for o in options))
    tasks = [
        {"schedule": "1f1b", "option": o, "P": 1, "a": 4, "seed": s, "lr": lr}
        for o in flush_opts
        for lr in args.lrs
        for s in args.seeds
    ]
    tasks += [
        {"schedule": "paci", "option": o, "P": p, "a": a, "seed": s, "lr": lr}
        for o in options
        for lr in args.lrs
        for s in args.seeds
        for p in args.stages
        for a in args.windows
        if not _same_as_adamw(o, p, a)
    ]
    runs = run_pool(
        tasks,
        functools.partial(train, base, total, args.eval_every, warm),
        log=work / "runs.jsonl",
        jobs=args.jobs,
        depends=[base, total, args.eval_every, warm, OPTIONS],
        describe=lambda r: (
            f"{r['schedule']} {r['option']} P={r['P']} a={r['a']} lr={r['lr']:g} "
            f"seed {r['seed']}: final {r['final']:.4f}"
        ),
    )
    for r in runs:  # what holds on any machine: PACI never drifts past its bound ceil((P-1)/a)
        assert r["max_drift"] <= -(-(r["P"] - 1) // r["a"]), r
    same = [
        {**r, "option": o, "same_as": "adamw"}
        for o in options
        for r in runs
        if r["schedule"] == "paci" and r["option"] == "adamw" and _same_as_adamw(o, r["P"], r["a"])
    ]
    runs += same
    res = analyse(runs, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/optimizer_map.py " + " ".join(sys.argv[1:]),
        "seconds": round(time.time() - t0),
        "run_seconds": round(sum(r.get("wall_s", 0) for r in runs)),
        "model": base["model"],
        "options": {k: [v[0], v[1]] for k, v in OPTIONS.items()},
        **res,
        "runs": runs,
    }
    (out / "map.json").write_text(json.dumps(doc, indent=1))
    text = markdown(res, args)
    (out / "map.md").write_text(text)
    draw(res, args, out / "map.png")
    print(text)
    print(
        f"{doc['command']}: {len(runs)} runs, {doc['seconds']} s ({doc['run_seconds']} s of runs); "
        f"wrote {out}/map.{{json,md,png}}"
    )


if __name__ == "__main__":
    main()
