"""Is the verdict stable? The same search run with several ``search.seed`` values, side by side.

Each run is a real ``paci-tune search`` (its own work folder and storage) on one sim-clock profile
(measured by the first run, copied to the others), so the only thing that differs is the sampler's
seed -- which points are tried and in which order. For each run the table
gives the recommendation, PACI's confirmed speedup over flush with its interval, and the verdict;
the runs *agree* when every run's interval contains every other run's point estimate.

    python bench/search_seeds.py                          # the README example, seeds 0 1 2 (~30 min)
    python bench/search_seeds.py --config my.yaml --seeds 0 1 2 3
    python bench/search_seeds.py --warm 150               # each seed cold and warm-started: the cold-vs-warm table
    python bench/search_seeds.py --quick                  # a tiny synthetic search, 2 seeds (CI)
    python bench/search_seeds.py --quick --warm 4         # the same, cold and warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

QUICK: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 16},
    "data": {"source": "synthetic", "vocab_size": 32, "branching": 4, "n_train": 20_000, "n_val": 4_000},
    "training": {"global_batch": 8, "steps": 4, "seed": 0, "eval_sequences": 16},
    "optimizer": {"name": "adamw", "lr": 3.0e-3},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 0.1, "scaling": "none"},
    "pipeline": {"schedule": "paci", "stages": 2, "window": 4, "runtime": "emulated", "device": "cpu"},
    "target": {"value": 2.9},
    "budget": {"clock": "rst", "seconds": 0.05, "grid": 3},  # on QUICK_PROFILE: a smoke run measures nothing
    "hardware": {"devices": 2},
    "search": {"trials": 1, "stall_seconds": 120, "confirm": {"top": 1, "seeds": 2, "max_seeds": 2}},
}
QUICK_SPACE = {"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [2, 4]}
# A hand-written reference system for QUICK's model (embed, 2 blocks, head; sequence 16).
_COST = {"forward_s": 0.002, "backward_s": 0.004, "activation_bytes": 8192, "saved_bytes": 32768}
QUICK_PROFILE = {
    "seq_len": 16,
    "units": [
        {"name": f"u{i}", "param_bytes": 1 << 16, "optimizer_s": 0.001, "microbatch": {2: _COST, 4: _COST}}
        for i in range(4)
    ],
    "p2p": {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e10},
}


def run_search(config: Path, seed: int, work: Path) -> tuple[dict[str, Any], float, float]:
    """best.yaml of one search, its wall time and its CPU time (the search and every trial it ran:
    searches share the machine when ``--jobs`` > 1, so the CPU time is the comparable cost)."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "best.yaml"
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "search",
        str(config),
        "--seed",
        str(seed),
        "--no-live",
        "--workdir",
        str(work),
        "--out",
        str(out),
    ]
    t0 = time.time()
    with open(work.parent / f"{work.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # the rusage of the search and its waited-for trials
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"search with seed {seed} failed (exit {proc.returncode}); see {log.name}")
    return yaml.safe_load(out.read_text()), time.time() - t0, usage.ru_utime + usage.ru_stime


def _row(best: dict[str, Any], wall: float, cpu: float, seed: int, mode: str) -> dict[str, Any]:
    r = best["recommended"]
    c = best.get("comparison") or {}
    iv = c.get("interval")
    return {
        "mode": mode,
        "seed": seed,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "recommended": f"{r['schedule']} P={r['stages']} a={r['window']} b={r['microbatch_size']} lr={r['lr']:.3g}",
        "paci": best["confirmation"]["paci"][0]["point"] if best.get("confirmation") else None,
        "baseline": (c.get("baseline") or {}).get("point"),
        "speedup": c.get("speedup"),
        "interval": iv,
        "width": round(iv[1] - iv[0], 4) if iv else None,
        "seeds": len((best.get("confirmation") or {}).get("seeds") or []),
        "target": best["target"]["value"],
        "reached": _reached(best),
        "verdict": best.get("verdict"),
        "verdict_reason": c.get("reason"),
        "warm_start": (best.get("warm_start") or {}).get("note"),
    }


def _reached(best: dict[str, Any]) -> str:
    """Confirmed runs that reached the target, per schedule: ``paci 3/3, 1f1b 2/3``."""
    conf = best.get("confirmation") or {}
    out = []
    for schedule in ("paci", best.get("baseline_schedule") or "1f1b"):
        points = conf.get(schedule) or []
        if points:
            ttt = [s.get("time_to_target") for s in (points[0].get("seeds") or {}).values()]
            out.append(f"{schedule} {sum(t is not None for t in ttt)}/{len(ttt)}")
    return ", ".join(out)


def _agree(rows: list[dict[str, Any]]) -> bool:
    """Every run's interval contains every other run's point estimate."""
    return all(
        o["interval"] and o["interval"][0] <= r["speedup"] <= o["interval"][1]
        for r in rows
        for o in rows
        if r is not o and r["speedup"] is not None
    )


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'mode':<5} {'seed':>4} {'target':>6}  {'recommended':<36} {'PACI/flush':>10}  {'interval':<18} "
        f"{'width':>6} seeds verdict    wall    cpu  reached"
    )
    for r in rows:
        iv = "[{:.3f}, {:.3f}]".format(*r["interval"]) if r["interval"] else "-"
        sp = f"{r['speedup']:.3f}" if r["speedup"] is not None else "-"
        w = f"{r['width']:.3f}" if r["width"] is not None else "-"
        print(
            f"{r['mode']:<5} {r['seed']:>4} {r['target']:>6g}  {r['recommended']:<36} {sp:>10}  {iv:<18} {w:>6} "
            f"{r['seeds']:>5} {r['verdict']:<10} {r['wall_s']:>4.0f}s {r['cpu_s']:>5.0f}s  "
            f"{r['reached']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workdir", default=None, help="Keep the searches here (default: a temporary folder).")
    ap.add_argument("--jobs", type=int, default=2, help="Searches run at once once the profile is known.")
    ap.add_argument(
        "--warm",
        type=int,
        default=None,
        metavar="STEPS",
        help="Also run every seed warm-started (search.warm_start: {steps: STEPS}, one shared "
        "warm-up) and compare: the cold-vs-warm table.",
    )
    ap.add_argument(
        "--warm-target",
        type=float,
        default=None,
        metavar="LOSS",
        help="The warm searches' target.value (a warm start begins past the early losses a cold "
        "target is set for); default: the config's.",
    )
    ap.add_argument("--quick", action="store_true", help="A tiny synthetic search with 2 seeds: a smoke run.")
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="paci-seeds-"))
    root.mkdir(parents=True, exist_ok=True)
    config, seeds = Path(args.config), args.seeds
    if args.quick:
        (root / "space.yaml").write_text(yaml.safe_dump(QUICK_SPACE))
        (root / "profile.yaml").write_text(yaml.safe_dump(QUICK_PROFILE))
        doc = {
            **QUICK,
            "search": {**QUICK["search"], "space": str(root / "space.yaml")},
            "budget": {**QUICK["budget"], "profile": str(root / "profile.yaml")},
        }
        config, seeds = root / "quick.yaml", [0, 1]
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
    cold = yaml.safe_load(config.read_text())
    if (cold.get("search") or {}).get("warm_start"):  # a warm-started config: its cold twin starts from scratch
        cold["search"] = {k: v for k, v in cold["search"].items() if k != "warm_start"}
        config = root / f"{config.stem}-cold.yaml"
        config.write_text(yaml.safe_dump(cold, sort_keys=False))
    configs = {"cold": config}
    if args.warm is not None:  # the same search, every trial from one warm-up shared by all its search seeds
        doc = yaml.safe_load(config.read_text())
        doc["search"] = {**doc.get("search", {}), "warm_start": {"steps": args.warm, "dir": str(root / "warm-up")}}
        if args.warm_target is not None:
            doc["target"] = {**doc.get("target", {}), "value": args.warm_target}
        configs["warm"] = root / f"{config.stem}-warm.yaml"
        configs["warm"].write_text(yaml.safe_dump(doc, sort_keys=False))
    # One clock for every run: the first search measures the profile (unless the config gives one),
    # the others copy it; with the profile known up front, the searches run side by side.
    given = bool((yaml.safe_load(config.read_text()).get("budget") or {}).get("profile"))
    runs = [(mode, seed) for mode in configs for seed in seeds]
    folder = {(mode, seed): root / f"{mode}-seed-{seed}" for mode, seed in runs}
    results: dict[tuple[str, int], tuple[dict[str, Any], float, float]] = {}
    if not given:
        results[runs[0]] = run_search(configs[runs[0][0]], runs[0][1], folder[runs[0]])
        for run in runs[1:]:
            folder[run].mkdir(parents=True, exist_ok=True)
            shutil.copy(folder[runs[0]] / "profile.yaml", folder[run] / "profile.yaml")
    with ThreadPoolExecutor(args.jobs) as pool:
        todo = [r for r in runs if r not in results]
        for run, res in zip(todo, pool.map(lambda r: run_search(configs[r[0]], r[1], folder[r]), todo), strict=True):
            results[run] = res
    rows = [_row(*results[(mode, seed)], seed, mode) for mode, seed in runs]
    _print(rows)
    summary: dict[str, Any] = {}
    for mode in configs:
        mine = [r for r in rows if r["mode"] == mode]
        widths = [r["width"] for r in mine if r["width"] is not None]
        verdicts = [r["verdict"] for r in mine]
        summary[mode] = {
            "verdicts": verdicts,
            "same_verdict": len(set(verdicts)) == 1,
            "intervals_agree": _agree(mine),
            "mean_width": round(sum(widths) / len(widths), 4) if widths else None,
            "wall_s": round(sum(r["wall_s"] for r in mine), 1),
            "cpu_s": round(sum(r["cpu_s"] for r in mine), 1),
        }
        s = summary[mode]
        print(
            f"{mode}: verdicts {s['verdicts']} ({'the same' if s['same_verdict'] else 'differ'}); intervals "
            f"{'agree' if s['intervals_agree'] else 'DISAGREE'} (each contains the others' point estimates); "
            f"mean width {s['mean_width']}; {s['wall_s']:.0f}s of searches, {s['cpu_s']:.0f}s CPU"
        )
    if "warm" in summary and summary["cold"]["mean_width"] and summary["warm"]["mean_width"] is not None:
        ratio = summary["warm"]["mean_width"] / summary["cold"]["mean_width"]
        summary["warm_over_cold_width"] = round(ratio, 3)
        print(f"warm intervals are {ratio:.2f}x as wide as cold ones (goal: at most 0.5)")
    print(json.dumps({"rows": rows, "summary": summary}))
    assert all(r["verdict"] in ("paci", "flush", "tie", "undecided") for r in rows)
    for r in rows:
        assert (r["warm_start"] is not None) == (r["mode"] == "warm"), r
        if r["verdict"] == "undecided":  # a confirmed run missed the target: no verdict, no interval
            assert r["verdict_reason"], r
        elif r["verdict"] != "tie":  # a tie may exclude 1 (mean times within one validation interval)
            lo, hi = r["interval"]
            assert r["verdict"] == ("paci" if lo > 1 else "flush" if hi < 1 else "tie"), r


if __name__ == "__main__":
    main()
