"""Is the verdict stable? The same search run with several ``search.seed`` values, side by side.

Each run is a real ``paci-tune search`` (its own work folder and storage) on one sim-clock profile
(measured by the first run, copied to the others), so the only thing that differs is the sampler's
seed -- which points are tried and in which order. For each run the table
gives the recommendation, PACI's confirmed speedup over flush with its interval, and the verdict;
the runs *agree* when every run's interval contains every other run's point estimate.

    python bench/search_seeds.py                          # the README example, seeds 0 1 2 (~30 min)
    python bench/search_seeds.py --config my.yaml --seeds 0 1 2 3
    python bench/search_seeds.py --quick                  # a tiny synthetic search, 2 seeds (CI)
"""

from __future__ import annotations

import argparse
import json
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
    "search": {"trials": 1, "stall_seconds": 120, "confirm": {"top": 1, "seeds": 2}},
}
QUICK_SPACE = {"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [2, 4]}
# A hand-written reference system for QUICK's model (embed, 2 blocks, head; sequence 16).
_COST = {"forward_s": 0.002, "backward_s": 0.004, "activation_bytes": 8192, "saved_bytes": 32768}
QUICK_PROFILE = {"seq_len": 16, "units": [{"name": f"u{i}", "param_bytes": 1 << 16, "optimizer_s": 0.001,
                                           "microbatch": {2: _COST, 4: _COST}} for i in range(4)],
                 "p2p": {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e10}}  # fmt: skip


def run_search(config: Path, seed: int, work: Path) -> tuple[dict[str, Any], float]:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "best.yaml"
    cmd = [sys.executable, "-m", "paci_tune.cli", "search", str(config), "--seed", str(seed), "--no-live",
           "--workdir", str(work), "--out", str(out)]  # fmt: skip
    t0 = time.time()
    with open(work.parent / f"search-{seed}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"search with seed {seed} failed (exit {proc.returncode}); see {log.name}")
    return yaml.safe_load(out.read_text()), time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workdir", default=None, help="Keep the searches here (default: a temporary folder).")
    ap.add_argument("--jobs", type=int, default=2, help="Searches run at once once the profile is known.")
    ap.add_argument("--quick", action="store_true", help="A tiny synthetic search with 2 seeds: a smoke run.")
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="paci-seeds-"))
    root.mkdir(parents=True, exist_ok=True)
    config, seeds = Path(args.config), args.seeds
    if args.quick:
        (root / "space.yaml").write_text(yaml.safe_dump(QUICK_SPACE))
        (root / "profile.yaml").write_text(yaml.safe_dump(QUICK_PROFILE))
        doc = {**QUICK, "search": {**QUICK["search"], "space": str(root / "space.yaml")},
               "budget": {**QUICK["budget"], "profile": str(root / "profile.yaml")}}  # fmt: skip
        config, seeds = root / "quick.yaml", [0, 1]
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
    # One clock for every run: the first search measures the profile (unless the config gives one),
    # the others copy it; with the profile known up front, the searches run side by side.
    given = bool((yaml.safe_load(config.read_text()).get("budget") or {}).get("profile"))
    first = root / f"seed-{seeds[0]}"
    results: dict[int, tuple[dict[str, Any], float]] = {}
    if not given:
        results[seeds[0]] = run_search(config, seeds[0], first)
    for seed in seeds[1:]:
        if (first / "profile.yaml").is_file():
            (root / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
            shutil.copy(first / "profile.yaml", root / f"seed-{seed}" / "profile.yaml")
    with ThreadPoolExecutor(args.jobs) as pool:
        todo = [s for s in seeds if s not in results]
        for seed, res in zip(todo, pool.map(lambda s: run_search(config, s, root / f"seed-{s}"), todo), strict=True):
            results[seed] = res
    rows = []
    for seed in seeds:
        best, wall = results[seed]
        r = best["recommended"]
        rows.append({
            "seed": seed, "wall_s": round(wall, 1),
            "recommended": f"{r['schedule']} P={r['stages']} a={r['window']} b={r['microbatch_size']} lr={r['lr']:.3g}",
            "paci": best["confirmation"]["paci"][0]["point"] if best.get("confirmation") else None,
            "speedup": best.get("paci_speedup_vs_flush"), "interval": best.get("paci_speedup_interval"),
            "verdict": best.get("verdict"),
            "verdict_reason": best.get("verdict_reason"),
        })  # fmt: skip
    print(f"{'seed':>4}  {'recommended':<36} {'PACI/flush':>10}  {'interval':<18} verdict  wall")
    for r in rows:
        iv = "[{:.3f}, {:.3f}]".format(*r["interval"]) if r["interval"] else "-"
        sp = f"{r['speedup']:.3f}" if r["speedup"] is not None else "-"
        print(f"{r['seed']:>4}  {r['recommended']:<36} {sp:>10}  {iv:<18} {r['verdict']:<7}  {r['wall_s']:.0f}s")
    agree = all(
        o["interval"] and o["interval"][0] <= r["speedup"] <= o["interval"][1]
        for r in rows for o in rows if r is not o and r["speedup"] is not None
    )  # fmt: skip
    print(f"intervals {'agree' if agree else 'DISAGREE'}: every run's interval "
          f"{'contains' if agree else 'does not always contain'} the others' point estimates")  # fmt: skip
    print(json.dumps({"rows": rows, "agree": agree}))
    assert all(r["verdict"] in ("paci", "flush", "tie", "undecided") for r in rows)
    for r in rows:
        lo, hi = r["interval"]
        if r["verdict"] == "undecided":  # a confirmed run missed the target: no verdict, whatever the interval
            assert r["verdict_reason"], r
        else:
            assert r["verdict"] == ("paci" if lo > 1 else "flush" if hi < 1 else "tie")


if __name__ == "__main__":
    main()
