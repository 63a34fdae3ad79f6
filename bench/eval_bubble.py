"""Does evaluating often cost PACI pipeline time? The measured bubble at two cadences, side by side.

Runs PACI on the distributed runtime (one process per stage) with evaluation every batch and
every ``--rarely`` batches, interleaved so machine noise hits both alike, and prints the lowest
measured bubble and best tokens/s of each, next to what a drain per evaluation used to cost (a
fill and drain of ``(P-1)/(a+P-1)`` of a batch at each one). Evaluation time is left out of the
pipeline's time by design (README, Evaluation); what this measures is whether the pipeline around
it runs as tightly as without it.

    python bench/eval_bubble.py --stages 3 --window 2 --steps 30 --repeats 3
    python bench/eval_bubble.py --quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

QUICK_CONFIG = """\
model: {preset: tiny, n_layer: 2, d_model: 64, n_head: 2, block_size: 32}
data: {source: synthetic, vocab_size: 64, branching: 4, n_train: 50000, n_val: 5000}
training: {global_batch: 8, steps: 6, seed: 0, eval_sequences: 8}
pipeline: {schedule: paci, stages: 2, window: 2, runtime: emulated, device: cpu}
"""
"""``--quick``'s run: the tests' tiny model (tests/helpers/configs.py), whose evaluations take milliseconds, not
the example's 256 sequences of 128 tokens at every step: the smoke run checks that the bench runs, not its figures."""


def run(args: argparse.Namespace, every: int, metrics: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "train",
        args.config,
        "--memory",
        "none",
        "--schedule",
        "paci",
        "--stages",
        str(args.stages),
        "--window",
        str(args.window),
        "--runtime",
        "distributed",
        "--steps",
        str(args.steps),
        "--seed",
        "0",
        "--device",
        "cpu",
        "--eval-every",
        str(every),
        "--metrics",
        str(metrics),
        "--no-live",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    summary = records[-1]
    summary["evals"] = sum(r["event"] == "eval" for r in records)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rarely", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tests' tiny model, P=2, 6 steps, one repeat: a smoke run")
    args = ap.parse_args()
    cadences = {"every batch": 1, f"every {args.rarely}": args.rarely}
    out: dict[str, list[dict]] = {k: [] for k in cadences}
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.config = str(Path(tmp) / "quick.yaml")
            Path(args.config).write_text(QUICK_CONFIG)
            args.stages, args.steps, args.repeats = 2, 6, 1
        for i in range(args.repeats):
            for name, every in cadences.items():
                s = run(args, every, Path(tmp) / f"{every}-{i}.jsonl")
                out[name].append(s)
                print(
                    f"  {name:12s} run {i}: {s['evals']:3d} evaluations, bubble {s['bubble_fraction']:.3f}, "
                    f"{s['tokens_per_s']:,.0f} tokens/s"
                )
    p, a = args.stages, args.window
    drain = (p - 1) / (a + p - 1)
    print(f"command: python bench/eval_bubble.py {' '.join(sys.argv[1:])}")
    for name, runs in out.items():
        print(
            f"{name:12s} lowest bubble {min(s['bubble_fraction'] for s in runs):.3f}, "
            f"best {max(s['tokens_per_s'] for s in runs):,.0f} tokens/s"
        )
    print(f"a drain per evaluation would add about {drain:.2f} of a batch of idle pipeline per evaluation")
    assert all(s["evals"] >= 1 for runs in out.values() for s in runs)


if __name__ == "__main__":
    main()
