"""The PACI paper's headline experiment scaled to a 2-core CPU: time to a target on 8 pipeline stages.

The paper (GPT-2 Medium, 8 stages, long runs) reports PACI reaching the target perplexity 1.69x
faster than the fastest 1F1B-flush configuration at global batch 128 and 1.41x at 256 -- 1.83x and
1.48x against flush at the same micro-batch count -- so the gain is larger at the smaller batch,
where flush's bubble is a larger share of its step. Here, the same protocol at CPU scale:

- a GPT of 8 blocks (10 units: embedding, blocks, head) cut into P = 8 stages, trained on the
  built-in corpus with exact numerics (emulated runtime) and timed on the **sim clock**: 8 devices
  of this machine's measured profile, each stage as its own device;
- two global batches G and 2G (the paper's 1:2), the same sim-clock budget, validation set and
  seeds for every run, the LR decaying over the budget;
- flush tuned over its micro-batch count m and the LR, PACI over its window a and the LR (the
  micro-batch is G / a for both: the same grid), 3 seeds per point;
- each distinct curve trained once (issue 39, :func:`simrun.train_shared`): flush and the synchronous
  baselines of one batch, LR, seed and optimizer train plain gradient accumulation over the global batch,
  one curve whatever m; it is trained once and read at each layout's own sim clock, as a search answers
  shared trials. Every run's LR decays over its class's horizon in steps (the most steps one of its
  layouts fits in the budget) and its data are drawn sequence by sequence (``data.draw: sequence``);
  each PACI (a, semantics) is its own curve;
- per batch, the target is the validation loss the best flush point (lowest median loss at 2/3 of
  the budget) has at 2/3 of the budget, so the fastest flush reaches it at about two thirds;
- each point's score is its mean over seeds of the time to target (linearly interpolated between
  validations; a miss scores as the search does, more than the budget); PACI's speedup is
  flush's mean over PACI's, with a paired percentile-bootstrap 95% interval over the seeds, against
  the best flush point and against flush at PACI's micro-batch count (its best LR there).

The synchronous baselines (``--baselines``, default ``zb-h1``) are tuned like flush, over the same
grid, LRs and seeds: ZB-H1 computes flush's gradients and is timed on its own simulated timeline
(its B and W halves from the profile), so its runs differ from flush's only in the clock. The
"strongest synchronous" column compares PACI with the best of flush and the baselines, as a search's
best.yaml does (No Train No Gain: beat the strongest baseline, not the easiest). Interleaved 1F1B
needs ``v * P`` chunks: at P = 8 that is 16 or more units, and this model has 10, so it is left out
here (``--baselines interleaved`` with ``--stages 4`` runs it).

PACI runs under each ``--backward-weights`` semantics (``forward``: every backward reads the weights
its forward used, as the reference code's autocast casts did; ``current``: the weights of now), each
compared with the same flush runs, side by side.

The best points are picked on the same seeds the ratio is measured on, as a grid search's winner
is: an optimistic pick for both schedules alike. Finished runs are kept in ``--workdir``, so a killed
bench resumes where it stopped.

    python bench/paper_scaled.py                 # the table in docs/benchmarks.md (~1 h on a 2-core CPU)
    python bench/paper_scaled.py --quick         # seconds: a tiny model on 4 stages, 2 seeds (CI)
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

from simrun import Layout, curve_class, first_reach, run_pool, train_shared, warm_checkpoint, warm_overrides

from paci_tune.calibrate import calibrate
from paci_tune.calibrate.cache import measured_profile
from paci_tune.config import derive_run
from paci_tune.tune.objective import score
from paci_tune.tune.rounds import paired_ratio
from paci_tune.verdict.confirm import verdict

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer.name": "adamw", "optimizer.betas": [0.9, 0.95]},
    "nadam": {"optimizer.name": "nadam", "optimizer.betas": [0.99, 0.999], "optimizer.momentum_decay": 0.004},
    "muon": {"optimizer.name": "muon", "optimizer.betas": [0.9, 0.95]},
}
"""``--optimizers``' choices: AdamW as every earlier table ran it, NAdam with the asynchronous-pipeline
literature's high momentum, Muon on the hidden matrices (AdamW on the rest)."""
PAPER = {"small": {"batch": 128, "best": 1.69, "same_m": 1.83}, "large": {"batch": 256, "best": 1.41, "same_m": 1.48}}
FULL: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 8, "d_model": 64, "n_head": 2, "block_size": 64},
    "data": {"source": "stdlib"},
    "training": {"seed": 0, "eval_sequences": 128},
    "optimizer": {"name": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1},
    "lr_schedule": {"warmup_fraction": 0.02, "min_ratio": 0.1},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}
QUICK: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 16},
    "data": {"source": "synthetic", "vocab_size": 32, "branching": 4, "n_train": 20_000, "n_val": 2_000},
    "training": {"seed": 0, "eval_sequences": 16},
    "optimizer": {"name": "adamw"},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 0.1},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}


def _layout(warm: dict[int, str], task: dict[str, Any]) -> tuple[dict[str, Any], Layout]:
    """A task's base (its global batch) and layout, from the warm checkpoint of its batch if any."""
    extra: dict[str, Any] = {"pipeline.backward_weights": task["bw"]} if "bw" in task else {}
    extra.update(warm_overrides(warm.get(task["G"])))
    extra.update(OPTIMIZERS[task["opt"]] if "opt" in task else {})
    if task["schedule"] == "interleaved":
        extra["pipeline.chunks"] = 2
    extra.update({"optimizer.lr": task["lr"], "training.seed": task["seed"]})
    return {"G": task["G"]}, (task["schedule"], task["P"], 1, task["a"], extra)


def classes(base: dict[str, Any], profile: str, seconds: float, grid: int, warm: dict[int, str],
            tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """The tasks grouped by the curve they train (:func:`simrun.curve_class`): flush and the synchronous
    baselines of one batch, LR, seed and optimizer are one curve whatever their micro-batch count; each
    PACI (a, semantics) its own."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for t in tasks:
        _, lay = _layout(warm, t)
        key = curve_class(_base_for(base, t["G"]), profile, lay, seconds=seconds, grid=grid)
        groups.setdefault(f"{t['G']}:{key}" if key is not None else f"run:{len(groups)}", []).append(t)
    return [{"G": members[0]["G"], "members": members} for members in groups.values()]


def _base_for(base: dict[str, Any], g: int) -> dict[str, Any]:
    return {**base, "training": {**base["training"], "global_batch": g}}


def _one(base: dict[str, Any], profile: str, seconds: float, grid: int, warm: dict[int, str],
         cls: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One curve (in a worker process of :func:`simrun.run_pool`): trained once, a row per member task."""
    layouts = [_layout(warm, t)[1] for t in cls["members"]]
    rows = train_shared(_base_for(base, cls["G"]), profile, layouts, seconds=seconds, grid=grid)
    return {**cls, "rows": [{**t, **row} for t, row in zip(cls["members"], rows, strict=True)]}


def _describe(rec: dict[str, Any]) -> str:
    r = rec["rows"][0]
    who = ", ".join(f"{m['schedule']} a={m['a']}" for m in rec["rows"])
    return (f"G={r['G']} {r.get('bw', ''):7s} lr={r['lr']:.3g} seed {r['seed']}: one curve for {who}; "
            f"{r['steps']} steps, best val {r['best_val_loss']:.4f}, {rec['wall_s']} s wall")  # fmt: skip


def loss_at(curve: list[tuple[float, float]], at: float) -> float:
    """The validation loss of the validation nearest to clock ``at``."""
    return min(curve, key=lambda cv: abs(cv[0] - at))[1]


def analyse(rows: list[dict], g: int, seconds: float, bw: str) -> dict[str, Any]:
    """One global batch and PACI semantics: the target, every point's scores per seed, the best points, the ratios.

    The target depends on flush alone, so it is the same for both semantics.
    """
    mine = [r for r in rows if r["G"] == g and r.get("bw", bw) == bw]
    points: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    for r in mine:
        pt = points.setdefault((r["schedule"], r["a"], r["lr"], r.get("opt", "")), {
            "schedule": r["schedule"], "a": r["a"], "b": r["microbatch_size"], "lr": r["lr"], "runs": {},
            "opt": r.get("opt", ""), "step_time_s": r["step_time_s"]})  # fmt: skip
        pt["runs"][r["seed"]] = r
    flush = [p for p in points.values() if p["schedule"] == "1f1b"]
    for p in flush:
        p["loss_at_2_3"] = statistics.median(loss_at(r["curve"], 2 * seconds / 3) for r in p["runs"].values())
    target = min(p["loss_at_2_3"] for p in flush)
    for p in points.values():
        p["times"] = {s: first_reach(r["curve"], target) for s, r in p["runs"].items()}
        p["scores"] = {s: (t if t is not None else score(None, p["runs"][s]["best_val_loss"], target, seconds))
                       for s, t in p["times"].items()}  # fmt: skip
        p["mean"] = statistics.fmean(p["scores"].values())
        p["reached"] = sum(t is not None for t in p["times"].values())
    best = {s: min((p for p in points.values() if p["schedule"] == s), key=lambda p: p["mean"])
            for s in {p["schedule"] for p in points.values()}}  # fmt: skip
    same_m = min((p for p in flush if p["a"] == best["paci"]["a"]), key=lambda p: p["mean"])
    # the strongest synchronous baseline: the lowest mean score, flush first on a tie (the paper's)
    strongest = min((best[s] for s in best if s != "paci"), key=lambda p: (p["mean"], p["schedule"] != "1f1b"))
    ratios = {}
    for name, ref in (("best", best["1f1b"]), ("same_m", same_m), ("strongest", strongest)):
        point, lo, hi = paired_ratio(ref["scores"], best["paci"]["scores"])
        ratios[name] = {"flush": _label(ref), "speedup": point, "low": lo, "high": hi, "verdict": verdict(lo, hi)}
    return {"G": g, "bw": bw, "target": target, "best_paci": _label(best["paci"]), "best_flush": _label(best["1f1b"]),
            "ratios": ratios, "points": [_public(p) for p in points.values()]}  # fmt: skip


NAMES = {"paci": "PACI", "1f1b": "flush"}


def _label(p: dict) -> str:
    opt = f" {p['opt']}" if p.get("opt") else ""
    return f"{NAMES.get(p['schedule'], p['schedule'])} a={p['a']} b={p['b']} lr={p['lr']:.3g}{opt}"


def _public(p: dict) -> dict:
    keep = ("schedule", "a", "b", "lr", "opt", "step_time_s", "times", "scores", "mean", "reached")
    return {k: p[k] for k in keep} | {"label": _label(p)}


def check(rows: list[dict], results: list[dict], seconds: float) -> None:
    """What holds on any machine: PACI's simulated step is never longer than flush's at the same
    (P, a, b) (no bubble); the best flush reaches its own target inside the budget; every interval
    holds its point."""
    by = {(r["G"], r["schedule"], r["a"], r.get("opt")): r["step_time_s"] for r in rows}
    for (g, s, a, o), t in by.items():
        if s == "paci":
            flush = by[(g, "1f1b", a, o)]
            assert t <= flush * (1 + 1e-9), f"PACI step {t} > flush's {flush} at G={g} a={a} {o or ''}"
    for res in results:
        best = next(p for p in res["points"] if p["label"] == res["best_flush"])
        assert best["reached"] > 0 and best["mean"] <= seconds * (1 + 1e-9), f"best flush misses its target: {best}"
        for r in res["ratios"].values():
            assert r["low"] <= r["speedup"] <= r["high"], r


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"P = {args.stages} stages on the sim clock, {args.seconds:g} s budget, {len(args.seeds)} seeds per "
             "point; speedup = flush's mean time to target over PACI's, paired bootstrap 95% interval.\n",
             "| global batch | PACI's backward weights | target val loss | best PACI | best flush | speedup over best "
             "flush | paper | speedup over flush at PACI's m | paper | speedup over the strongest synchronous |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    papers = {g: paper for g, paper in zip(args.batches, (PAPER["small"], PAPER["large"]), strict=True)}
    for res in results:
        paper = papers[res["G"]]
        r1, r2, r3 = res["ratios"]["best"], res["ratios"]["same_m"], res["ratios"]["strongest"]
        lines.append(f"| {res['G']} | {res['bw']} | {res['target']:.3f} | {res['best_paci']} | {res['best_flush']} | "
                     f"{_ratio(r1)} | {paper['best']}x (G={paper['batch']}) | {_ratio(r2)} ({r2['flush']}) | "
                     f"{paper['same_m']}x | {_ratio(r3)} ({r3['flush']}) |")  # fmt: skip
    lines += ["", "Every point (mean time to target over seeds; `>` a miss, scored as the search does):", "",
              "| G | schedule | a (m) | b | lr | optimizer | sim step (s) | reached | mean score (s) |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    seen: set[tuple] = set()
    for res in results:
        for p in sorted(res["points"], key=lambda p: (p["schedule"], p["a"], p["lr"], p["opt"])):
            name = f"paci {res['bw']}" if p["schedule"] == "paci" else p["schedule"]
            if (res["G"], name, p["a"], p["lr"], p["opt"]) in seen:
                continue  # the synchronous points appear once, not once per PACI semantics
            seen.add((res["G"], name, p["a"], p["lr"], p["opt"]))
            lines.append(f"| {res['G']} | {name} | {p['a']} | {p['b']} | {p['lr']:.3g} | {p['opt'] or 'adamw'} | "
                         f"{p['step_time_s']:.4f} | {p['reached']}/{len(p['scores'])} | {p['mean']:.2f} |")  # fmt: skip
    for bw in args.backward_weights:
        lines += ["", f"PACI {bw}: " + direction([r for r in results if r["bw"] == bw])]
    return "\n".join(lines) + "\n"


def _ratio(r: dict) -> str:
    return f"{r['speedup']:.2f}x [{r['low']:.2f}, {r['high']:.2f}] ({r['verdict']})"


def direction(results: list[dict]) -> str:
    """Whether the paper's direction (a larger gain at the smaller batch) and size hold here."""
    small, large = (r["ratios"]["best"] for r in results)
    if small["low"] > large["high"]:
        d = "holds: the gain at the smaller batch is larger, with disjoint intervals"
    elif small["speedup"] > large["speedup"]:
        d = "points the paper's way (a larger gain at the smaller batch) but the intervals overlap"
    else:
        d = "does not hold: the gain at the smaller batch is not larger"
    size = {s: f"{r['speedup']:.2f}x" for s, r in zip(("small", "large"), (small, large), strict=True)}
    return (
        f"Direction: {d}. Size: {size['small']} and {size['large']} here against the paper's "
        f"{PAPER['small']['best']}x and {PAPER['large']['best']}x."
    )


WHAT = {"best": "best flush", "same_m": "flush at same m", "strongest": "strongest synchronous"}


def draw(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3.5 * len(results), 3.6))
    labels, x = [], 0.0
    papers = {g: paper for g, paper in zip(sorted({r["G"] for r in results}), (PAPER["small"], PAPER["large"]),
                                           strict=True)}  # fmt: skip
    for res in results:
        paper = papers[res["G"]]
        for name, color in (("best", "tab:blue"), ("same_m", "tab:green"), ("strongest", "tab:red")):
            r, what = res["ratios"][name], WHAT[name]
            ax.errorbar([x], [r["speedup"]], yerr=[[r["speedup"] - r["low"]], [r["high"] - r["speedup"]]], fmt="o",
                        color=color, capsize=4, label=f"here: vs {what}")  # fmt: skip
            if name in paper:  # the paper compared with flush only
                ax.plot([x + 0.25], [paper[name]], marker="*", markersize=11, color=color, alpha=0.5,
                        linestyle="none", label=f"paper: vs {what}")  # fmt: skip
            x += 1
        labels.append((x - 2, f"G={res['G']} {res['bw']}\n(paper {paper['batch']})"))
        x += 0.5
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels])
    ax.set_ylabel("PACI speedup in time to target")
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
    ax.set_title("PACI over synchronous baselines, 8 stages, sim clock (bars: 95% bootstrap over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs=2, default=[16, 32], help="The two global batches (paper: 1:2).")
    ap.add_argument("--microbatch-sizes", type=int, nargs="+", default=[8, 4, 2],
                    help="Micro-batch sizes b tried (window / micro-batch count G / b).")  # fmt: skip
    ap.add_argument("--lrs", type=float, nargs="+", default=[4e-3, 8e-3], help="Peak LRs tried by both schedules.")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--backward-weights", nargs="+", default=["forward", "current"], choices=["forward", "current"],
                    help="PACI's semantics, each against the same flush runs (pipeline.backward_weights).")  # fmt: skip
    ap.add_argument("--baselines", nargs="*", default=["zb-h1"], choices=["zb-h1", "interleaved"],
                    help="Synchronous schedules tuned beside flush (interleaved runs 2 chunks a stage).")  # fmt: skip
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0, help="Budget per run on the sim clock.")
    ap.add_argument("--grid", type=int, default=10, help="Validations over the budget.")
    ap.add_argument("--jobs", type=int, default=2, help="Runs trained at once (one thread each).")
    ap.add_argument("--workdir", default="paci-bench-paper", help="The profile and the finished runs.")
    ap.add_argument("--out", default="runs/paper", help="Folder for paper.json, paper.md and paper.png.")
    ap.add_argument("--optimizers", nargs="+", default=None, choices=list(OPTIMIZERS),
                    help="Tune every schedule over these optimizers too (each schedule on its best; default: the "
                         "base config's AdamW).")  # fmt: skip
    ap.add_argument("--warm-start", type=int, default=None, metavar="STEPS",
                    help="Start every run from a checkpoint of STEPS global batches of 1F1B-flush at P = 1 (one "
                         "per global batch, at the first LR), past the loss plateau, as a warm-started search does.")
    ap.add_argument("--quick", action="store_true", help="A tiny model on 4 stages, 2 seeds: a smoke run.")
    args = ap.parse_args()
    base = QUICK if args.quick else FULL
    if args.quick:
        args.batches, args.microbatch_sizes, args.lrs, args.seeds = [4, 8], [2, 1], [3e-3], [0, 1]
        args.stages, args.seconds, args.grid, args.jobs = 4, 0.06, 4, 1
    t0 = time.time()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(set(args.microbatch_sizes))
    probe = derive_run({**base, "training": {**base["training"], "global_batch": args.batches[0]}}, {
        "pipeline.stages": args.stages, "pipeline.microbatch_size": sizes[0], "training.steps": 1})  # fmt: skip
    log = lambda m: print(f"  profile: {m}", file=sys.stderr)  # noqa: E731
    timed = [derive_run(probe.to_doc(), OPTIMIZERS[o]).optimizer for o in args.optimizers or []]  # each one's step
    if args.quick:
        prof = calibrate(probe, microbatch_sizes=sizes, repeats=1, warmup=0, processes=1, p2p_repeats=3, log=log,
                         optimizers=timed)  # fmt: skip
        profile = work / "quick.yaml"
        prof.save(profile)
    else:
        _, profile = measured_profile(probe, microbatch_sizes=sizes, path=work / "profile.yaml", log=log,
                                      optimizers=timed)  # fmt: skip
    warm: dict[int, str] = {}
    for g in args.batches if args.warm_start else []:
        run_base = {**base, "training": {**base["training"], "global_batch": g}}
        folder = work / f"warm-G{g}-{args.warm_start}-lr{args.lrs[0]:g}"
        warm[g] = warm_checkpoint(run_base, args.warm_start, folder, {"optimizer.lr": args.lrs[0]}, log)
    points = [(g, g // b) for g in args.batches for b in args.microbatch_sizes if g % b == 0 and g // b > 1]
    opts: list[dict[str, str]] = [{"opt": o} for o in args.optimizers] if args.optimizers else [{}]
    tasks = [{"G": g, "schedule": sched, "P": args.stages, "a": a, "lr": lr, "seed": seed, **o}
             for sched in ["1f1b", *args.baselines]
             for g, a in points for lr in args.lrs for seed in args.seeds for o in opts]  # fmt: skip
    tasks += [{"G": g, "schedule": "paci", "bw": bw, "P": args.stages, "a": a, "lr": lr, "seed": seed, **o}
              for bw in args.backward_weights for g, a in points for lr in args.lrs for seed in args.seeds
              for o in opts]  # fmt: skip
    curves = classes(base, str(profile), args.seconds, args.grid, warm, tasks)
    print(f"{len(tasks)} runs of {len(curves)} distinct curves: each curve trained once", file=sys.stderr)
    done = run_pool(curves, functools.partial(_one, base, str(profile), args.seconds, args.grid, warm),
                    log=work / "curves.jsonl", jobs=args.jobs, describe=_describe,
                    depends=[base, profile.read_text(), args.seconds, args.grid, args.warm_start])  # fmt: skip
    rows = [row for rec in done for row in rec["rows"]]
    results = [analyse(rows, g, args.seconds, bw) for bw in args.backward_weights for g in args.batches]
    check(rows, results, args.seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    took = round(time.time() - t0, 1)
    doc = {"command": "python bench/paper_scaled.py " + " ".join(sys.argv[1:]), "took_s": took,
           "model": base["model"], "stages": args.stages, "seconds": args.seconds, "seeds": args.seeds,
           "paper": PAPER, "results": results}  # fmt: skip
    (out / "paper.json").write_text(json.dumps(doc, indent=1))
    text = markdown(results, args)
    (out / "paper.md").write_text(text)
    draw(results, out / "paper.png")
    print(text)
    print(f"{doc['command']}: {took:.0f} s; wrote {out}/paper.{{json,md,png}}")


if __name__ == "__main__":
    main()
