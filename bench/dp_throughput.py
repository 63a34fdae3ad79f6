"""Data parallelism on this CPU, measured: P=2 x D=2 against P=2 x D=1, tokens/s and the all-reduce's share.

Both run ``paci-tune train --runtime distributed`` (gloo, one process per device) on the example's
model at the same global batch, interleaved so machine noise hits both alike; D=2 has twice the
processes and half the micro-batches per replica. The all-reduce's share is what the optimizer steps
spent finishing the gradient all-reduce (``allreduce_wait_s`` per stage: the part the backward did
not hide), over the run's pipeline time. On a 2-core machine P x D = 4 processes share 2 cores, so
D=2 cannot be faster here: the figures say what the all-reduce costs, not what DP buys on a GPU box.

    python bench/dp_throughput.py --steps 30 --repeats 3
    python bench/dp_throughput.py --quick        # 4 steps, one repeat: a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(args: argparse.Namespace, schedule: str, d: int, metrics: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "train",
        args.config,
        "--memory",
        "none",
        "--schedule",
        schedule,
        "--stages",
        "2",
        "--data-parallel",
        str(d),
        "--window",
        str(args.window),
        "--runtime",
        "distributed",
        "--device",
        "cpu",
        "--steps",
        str(args.steps),
        "--eval-every",
        str(10**6),
        "--metrics",
        str(metrics),
        "--no-live",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in metrics.read_text().splitlines() if '"summary"' in x][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=4, help="per replica; D=1 runs 2x this to keep the global batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 4, 1
    rows: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for schedule in ("paci", "1f1b"):
                for d in (1, 2):
                    w = args.window * (2 // d)  # D * a fixed: the same global batch and micro-batch size
                    a = argparse.Namespace(**{**vars(args), "window": w})
                    s = run(a, schedule, d, Path(tmp) / f"{schedule}{d}-{i}.jsonl")
                    waits = [st.get("allreduce_wait_s", 0.0) for st in s["stages"]]
                    share = max(waits) / s["pipeline_seconds"] if s["pipeline_seconds"] else 0.0
                    row = {
                        "tokens_per_s": s["tokens_per_s"],
                        "allreduce_share": share,
                        "waits": waits,
                        "window": w,
                        "microbatch_size": s.get("microbatch_size"),
                    }
                    rows.setdefault((schedule, d), []).append(row)
                    print(
                        f"  {schedule:4s} P=2 D={d} a={w}: {row['tokens_per_s']:,.0f} tokens/s, all-reduce wait "
                        f"{share:.1%} of pipeline time",
                        file=sys.stderr,
                    )
    print(f"command: python bench/dp_throughput.py {' '.join(sys.argv[1:])}")
    print("| schedule | P x D | best tokens/s | all-reduce wait (share of pipeline time, median) |")
    print("|---|---|---|---|")
    out = {}
    for (schedule, d), rs in rows.items():
        best = max(r["tokens_per_s"] for r in rs)
        share = sorted(r["allreduce_share"] for r in rs)[len(rs) // 2]
        out[f"{schedule}-D{d}"] = {"tokens_per_s": best, "allreduce_share": share}
        print(f"| {schedule} | 2 x {d} | {best:,.0f} | {share:.1%} |")
        if d == 1:
            assert share == 0.0, "no all-reduce without replicas"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
