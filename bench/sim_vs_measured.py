"""Simulated vs measured pipeline step time on the distributed runtime.

For each depth P: calibrate a cost profile of the config's model on this machine for a P-stage
pipeline (``paci-tune calibrate --stages P``: the threads one stage process gets, and as many
measuring processes at once as stages would compute at once; see paci_tune/calibrate/),
run ``paci-tune train --runtime distributed`` for a few steps, and compare its measured pipeline
time per global batch with the simulator's prediction for the very same segments (the ``rst``
clock's reading on that profile). Prints the ratio per schedule.

Short runs read low: the runtime's first few micro-batches (fresh memory for the micro-batches
in flight, the optimizer's state) run up to several times slower than the steady state, a
one-off cost a per-step profile does not predict; at 16 steps it is worth ~5% of the step time.

    python bench/sim_vs_measured.py --stages 2 4 --steps 24
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(cmd: list[str]) -> None:
    """Run a command; on failure, exit showing its output (a bare CalledProcessError hides why)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def train(config: str, profile: Path, schedule: str, stages: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "paci_tune.cli", "train", config, "--runtime", "distributed",
        "--schedule", schedule, "--stages", str(stages), "--window", str(args.window),
        "--steps", str(args.steps), "--eval-every", str(10**6), "--device", "cpu",
        "--clock", "rst", "--profile", str(profile), "--metrics", str(out), "--no-live",
    ]  # fmt: skip
    run(cmd)
    return [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--schedules", nargs="+", default=["paci", "1f1b"])
    args = ap.parse_args()
    print(f"command: python bench/sim_vs_measured.py {' '.join(sys.argv[1:])}")
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.stages:
            prof = Path(tmp) / f"profile-P{p}.yaml"
            calibrate = [sys.executable, "-m", "paci_tune.cli", "calibrate", args.config, "--stages", str(p)]
            run([*calibrate, "--out", str(prof)])
            for sched in args.schedules:
                s = train(args.config, prof, sched, p, args, Path(tmp) / f"{sched}{p}.jsonl")
                measured = s["pipeline_seconds"] / s["steps"]
                simulated = s["clock"] / s["steps"]
                print(
                    f"P={p} {sched:5s} measured {measured * 1e3:7.1f} ms/step  simulated {simulated * 1e3:7.1f} "
                    f"ms/step  sim/measured {simulated / measured:.3f}  (bubble measured "
                    f"{s['bubble_fraction']:.3f})"
                )


if __name__ == "__main__":
    main()
