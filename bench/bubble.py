"""PACI vs 1F1B-flush side by side on the distributed runtime: throughput ratio and bubbles.

Runs ``paci-tune train`` alternately with ``--schedule paci`` and ``--schedule 1f1b`` (same
model, window, seed, steps; interleaved so machine noise hits both alike) and prints, per
schedule, the best tokens/s and lowest bubble over the repeats, the measured throughput ratio
and the analytic ones: 1F1B-flush bubble (P-1)/(m+P-1) and the ratio (m+P-1)/m a bubble-free
pipeline should reach.

    python bench/bubble.py --stages 2 --window 4 --steps 24 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(config: str, schedule: str, args: argparse.Namespace, metrics: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "train",
        config,
        "--memory",
        "none",
        "--schedule",
        schedule,
        "--stages",
        str(args.stages),
        "--window",
        str(args.window),
        "--runtime",
        "distributed",
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--device",
        args.device,
        "--eval-every",
        str(10**6),
        "--metrics",
        str(metrics),
        "--no-live",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(x) for x in metrics.read_text().splitlines() if '"summary"' in x][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    results: dict[str, list[dict]] = {"paci": [], "1f1b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for sched in results:
                s = run(args.config, sched, args, Path(tmp) / f"{sched}{i}.jsonl")
                results[sched].append(s)
                print(f"  {sched:5s} run {i}: {s['tokens_per_s']:9,.0f} tokens/s  bubble {s['bubble_fraction']:.3f}")

    p, m = args.stages, args.window
    best = {k: max(v, key=lambda s: s["tokens_per_s"]) for k, v in results.items()}
    bubble = {k: min(s["bubble_fraction"] for s in v) for k, v in results.items()}
    ratio = best["paci"]["tokens_per_s"] / best["1f1b"]["tokens_per_s"]
    analytic_bubble = (p - 1) / (m + p - 1)
    analytic_ratio = (m + p - 1) / m
    print(f"command: python bench/bubble.py {' '.join(sys.argv[1:])}")
    print(f"P={p} a=m={m} steps={args.steps} repeats={args.repeats} device={args.device}")
    print(f"tokens/s   paci {best['paci']['tokens_per_s']:,.0f}  1f1b {best['1f1b']['tokens_per_s']:,.0f}")
    print(
        f"ratio paci/1f1b {ratio:.3f}   analytic (m+P-1)/m {analytic_ratio:.3f}   ({ratio / analytic_ratio:.1%} of it)"
    )
    print(
        f"bubble     paci {bubble['paci']:.3f}  1f1b {bubble['1f1b']:.3f}   "
        f"analytic 1f1b (P-1)/(m+P-1) {analytic_bubble:.3f}"
    )
    ok = bubble["paci"] <= 0.05 and ratio >= 0.95 * analytic_ratio
    print("goal (paci bubble <= 5%, ratio within 5% of analytic):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
