"""Depth against data parallelism on a fixed budget of 8 devices: PACI and flush time to target.

For every layout (P, D) in {(1,8), (2,4), (4,2), (8,1)} -- all 8 devices used, D = 8 / P -- and
each schedule, the run is trained at a few windows ``a`` (global batch fixed: b = global_batch /
(D * a)) on the **sim clock**: the time is that of the P x D layout on this machine's measured
profile (each replica's schedule, plus each stage's gradient all-reduce in its dp group at every
step, :mod:`paci_tune.sim.simulator`), and the LR decays over that clock's budget. The table shows
each layout's best window per schedule: time to the target validation loss (or the best loss, when
it was not reached), and the simulated share of the all-reduce.

**The numerics** are the configured layout's: ``pipeline.data_parallel: D`` on the emulated
runtime, D replicas of each stage averaging their gradients at every step (the distributed
runtime's numerics, tested equal in tests/test_data_parallel.py), the stage cut planned for D
replicas at micro-batch b. Only the clock is simulated.

    python bench/dp_budget.py                    # the table in docs/benchmarks.md
    python bench/dp_budget.py --quick            # a smoke run (CI): tiny model, P x D = 2x4 and 4x2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simrun import train_sim

from paci_tune.calibrate import calibrate
from paci_tune.calibrate.cache import measured_profile
from paci_tune.config import derive_run

DEVICES = 8
LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]
FULL: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 6},  # embed + 6 blocks + head: 8 units, enough for P = 8
    "data": {"source": "stdlib"},
    "training": {"global_batch": 64, "seed": 0, "eval_sequences": 128},
    "optimizer": {"name": "adamw", "lr": 2.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
    "lr_schedule": {"warmup_fraction": 0.02, "min_ratio": 0.1},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}
QUICK: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 6, "d_model": 32, "n_head": 2, "block_size": 16},
    "data": {"source": "synthetic", "vocab_size": 32, "branching": 4, "n_train": 20_000, "n_val": 2_000},
    "training": {"global_batch": 16, "seed": 0, "eval_sequences": 16},
    "optimizer": {"name": "adamw", "lr": 3.0e-3},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 0.1, "scaling": "none"},
    "pipeline": {"runtime": "emulated", "device": "cpu"},
}


def run_layout(base: dict[str, Any], profile: str, schedule: str, p: int, d: int, a: int, args: Any) -> dict[str, Any]:
    """Train one (schedule, P, D, a) on the sim clock; its time to target and best validation loss."""
    return train_sim(base, profile, schedule, p, d, a, seconds=args.seconds, grid=args.grid)


def auto_target(rows: list[dict[str, Any]], seconds: float) -> float:
    """The median, over flush's runs, of the validation loss at two thirds of the budget: a target
    flush reaches well inside the budget at its typical layout, so times to it are real times."""
    at = []
    for r in rows:
        if r["schedule"] == "1f1b":
            late = [v for c, v in r["curve"] if c >= 2 * seconds / 3 - 1e-9]
            if late:
                at.append(late[0])
    return round(statistics.median(at), 3)


def set_times(rows: list[dict[str, Any]], target: float) -> None:
    for r in rows:
        r["time_to_target"] = next((c for c, v in r["curve"] if v <= target), None)


def windows_for(p: int, d: int, g: int, wanted: list[int]) -> list[int]:
    """The wanted windows this layout admits (b = g / (D a) whole), else its largest admissible one."""
    ok = [a for a in wanted if g % (d * a) == 0]
    return ok or [max(a for a in range(1, g // d + 1) if (g // d) % a == 0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="Budget per run on the sim clock.")
    ap.add_argument("--grid", type=int, default=8, help="Validations over the budget (time-to-target resolution).")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="Target validation loss (default: flush's median loss at 2/3 of the budget).",
    )
    ap.add_argument("--global-batch", type=int, default=None, help="Override training.global_batch.")
    ap.add_argument("--d-model", type=int, default=None, help="Override model.d_model.")
    ap.add_argument("--block-size", type=int, default=None, help="Override model.block_size (sequence length).")
    ap.add_argument("--windows", type=int, nargs="+", default=[2, 8], help="Windows a tried per layout.")
    ap.add_argument("--quick", action="store_true", help="Tiny model, one window per layout: a smoke run.")
    ap.add_argument("--workdir", default="paci-bench-dp", help="Where the profile is kept.")
    args = ap.parse_args()
    base = QUICK if args.quick else FULL
    base = {**base, "model": dict(base["model"]), "training": dict(base["training"])}
    for key, section, name in (
        ("global_batch", "training", "global_batch"),
        ("d_model", "model", "d_model"),
        ("block_size", "model", "block_size"),
    ):
        if getattr(args, key) is not None:
            base[section][name] = getattr(args, key)
    layouts = LAYOUTS
    if args.quick:
        args.seconds, args.grid, args.target, args.windows = 0.03, 2, 3.3, [2]
        layouts = [(2, 4), (4, 2)]
    g = base["training"]["global_batch"]
    sizes = sorted({g // (d * a) for p, d in layouts for a in windows_for(p, d, g, args.windows)})
    t0 = time.time()
    probe = derive_run(base, {"pipeline.stages": 2, "pipeline.microbatch_size": sizes[0], "training.steps": 1})
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(f"  profile: {m}", file=sys.stderr)  # noqa: E731
    if args.quick:  # one timed batch per size, one process: a smoke run's profile
        prof = calibrate(probe, microbatch_sizes=sizes, repeats=1, warmup=0, processes=1, p2p_repeats=3, log=log)
        profile_path = work / "quick.yaml"
        prof.save(profile_path)
    else:
        prof, profile_path = measured_profile(probe, microbatch_sizes=sizes, path=work / "profile.yaml", log=log)
    ar = prof.allreduce
    print(
        f"profile {profile_path}: all-reduce {ar.backend}, {ar.latency_s * 1e6:.0f} us + bytes / "
        f"{ar.bandwidth_Bps / 1e9:.2f} GB/s per ring step",
        file=sys.stderr,
    )
    rows = []
    for p, d in layouts:
        for schedule in ("paci", "1f1b"):
            for a in windows_for(p, d, g, args.windows):
                r = run_layout(base, str(profile_path), schedule, p, d, a, args)
                rows.append(r)
                print(
                    f"  {schedule:5s} P={p} D={d} a={a:2d} b={r['microbatch_size']:2d}: {len(r['curve'])} evals, "
                    f"best val {r['best_val_loss']:.4f}, step {r['step_time_s']:.3g} s, "
                    f"all-reduce {r['allreduce_fraction']:.1%}, {r['wall_s']} s wall",
                    file=sys.stderr,
                )
    if args.target is None:
        args.target = auto_target(rows, args.seconds)
    set_times(rows, args.target)
    print(table(rows, args, layouts))
    took = time.time() - t0
    cmd = "python " + " ".join(sys.argv)
    print(f"\n{cmd}: {took:.0f} s on this machine")
    print(json.dumps({"rows": rows, "seconds": args.seconds, "target": args.target, "took_s": round(took, 1)}))


def _score(r: dict[str, Any], args: Any) -> float:
    """Time to target; a miss ranks after every hit, closer misses first (the search's objective)."""
    if r["time_to_target"] is not None:
        return float(r["time_to_target"])
    best = r["best_val_loss"] if r["best_val_loss"] is not None else float("inf")
    return args.seconds * (1 + max(best - args.target, 0) / args.target)


def table(rows: list[dict[str, Any]], args: Any, layouts: list[tuple[int, int]]) -> str:
    """Markdown: per layout, each schedule's best window and its time to target."""
    lines = [
        f"| P x D | PACI: a, b, time to {args.target} | flush: a, b, time to {args.target} | "
        "PACI / flush | all-reduce share (PACI) |",
        "|---|---|---|---|---|",
    ]
    for p, d in layouts:
        best = {}
        for s in ("paci", "1f1b"):
            mine = [r for r in rows if r["stages"] == p and r["data_parallel"] == d and r["schedule"] == s]
            best[s] = min(mine, key=lambda r: _score(r, args))

        def cell(r: dict[str, Any]) -> str:
            t = r["time_to_target"]
            got = f"{t:.2f} s" if t is not None else f"not reached (best {r['best_val_loss']:.3f})"
            return f"a={r['window']}, b={r['microbatch_size']}: {got}"

        ratio = _score(best["paci"], args) / _score(best["1f1b"], args)
        lines.append(
            f"| {p} x {d} | {cell(best['paci'])} | {cell(best['1f1b'])} | {ratio:.2f} | "
            f"{best['paci']['allreduce_fraction']:.1%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
