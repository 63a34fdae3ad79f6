"""Simulated vs measured pipeline step time on the distributed runtime.

For each depth P: calibrate a cost profile of the config's model on this machine for a P-stage
pipeline (``paci-tune calibrate --stages P``: the threads one stage process gets, and as many
measuring processes at once as stages would compute at once, each unit's backward also timed as
its input and weight halves B and W; see paci_tune/calibrate/), run ``paci-tune train --runtime
distributed`` for a few steps, and compare its measured pipeline time per global batch with the
simulator's prediction for the very same segments (the ``rst`` clock's reading on that profile).
Prints the ratio per schedule.

Schedules: ``paci`` and ``1f1b`` run on paci-tune's own distributed runtime; ``zb-h1`` runs for real
through torch's own ``ScheduleInterleavedZeroBubble`` (paci_tune/pipeline/torch_schedules.py), timed
against the simulation of its action list on the profile's measured B/W split; ``1f1b-torch`` is
1F1B through torch's ``Schedule1F1B`` (``pipeline.torch_schedule: true``), the same machinery as
zb-h1, so the two torch rows compare like with like; ``interleaved`` runs for real through torch's
``ScheduleInterleaved1F1B`` with ``--chunks`` model chunks per rank, timed against the simulation of
its action lists on its own ``v * P``-piece cut; ``zb-v`` and ``dualpipev`` through torch's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (two chunks a rank, in a V), ``gpipe`` on paci-tune's
own runtime.

Memory (``--memory``): every run measures each stage process's allocated tensor bytes
(``PACI_TUNE_TRACK_MEMORY=1``, the CPU meter, a Python call per operator: its steps are then 1.3-2x
slower, so a run's timing is compared without it) and the bench prints them beside the run's predicted
peak per rank (the summary's
``predicted_stage_peak_bytes``: what ``simulate`` and the search give for the layout).

Short runs read low: the runtime's first few micro-batches (fresh memory for the micro-batches
in flight, the optimizer's state) run up to several times slower than the steady state, a
one-off cost a per-step profile does not predict; at 16 steps it is worth ~5% of the step time.

    python bench/sim_vs_measured.py --stages 2 4 --steps 24
    python bench/sim_vs_measured.py --stages 2 --steps 24 --schedules 1f1b zb-h1 1f1b-torch interleaved
    python bench/sim_vs_measured.py --config C --stages 2 4 --window 8 --schedules paci 1f1b zb-h1 interleaved \
        zb-v dualpipev gpipe [--memory]
    python bench/sim_vs_measured.py --quick     # a tiny model, P=2, a few steps: that it runs (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SCHEDULES = ("paci", "1f1b", "zb-h1", "1f1b-torch", "interleaved", "zb-v", "dualpipev", "gpipe")

QUICK_CONFIG = {
    "model": {"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32},
    "data": {"source": "synthetic", "vocab_size": 64, "branching": 4, "n_train": 50_000, "n_val": 5_000},
    "training": {"global_batch": 8, "steps": 4, "seed": 0, "eval_sequences": 4},
    "pipeline": {"schedule": "paci", "stages": 2, "window": 4, "runtime": "emulated", "device": "cpu"},
}
"""``--quick``'s run: the tests' tiny model, which calibrates and trains in seconds."""


def run(cmd: list[str], track_memory: bool = False) -> None:
    """Run a command; on failure, exit showing its output (a bare CalledProcessError hides why)."""
    env = {**os.environ, "PACI_TUNE_TRACK_MEMORY": "1"} if track_memory else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def config_for(config: str, sched: str, tmp: Path) -> tuple[str, str]:
    """(config file, schedule) to train ``sched``: ``1f1b-torch`` is 1f1b on a copy of the config
    that sets ``pipeline.torch_schedule: true`` (no command-line option sets it)."""
    if sched != "1f1b-torch":
        return config, sched
    doc = yaml.safe_load(Path(config).read_text())
    doc.setdefault("pipeline", {})["torch_schedule"] = True
    path = tmp / "torch-1f1b.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path), "1f1b"


def train(config: str, profile: Path, sched: str, stages: int, args: argparse.Namespace, out: Path) -> dict:
    config, schedule = config_for(config, sched, out.parent)
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "train",
        config,
        "--memory",
        "none",
        "--runtime",
        "distributed",
        "--schedule",
        schedule,
        "--stages",
        str(stages),
        "--window",
        str(args.window),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(10**6),
        "--device",
        "cpu",
        "--clock",
        "rst",
        "--profile",
        str(profile),
        "--metrics",
        str(out),
        "--no-live",
    ]
    if schedule == "interleaved":
        cmd += ["--chunks", str(args.chunks)]
    run(cmd, track_memory=args.memory)
    return [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]


def memory_line(summary: dict) -> str:
    """Each rank's predicted peak against its process's measured allocated peak (a rank's pieces share one)."""
    predicted = summary.get("predicted_stage_peak_bytes") or []
    measured: dict[int, int] = {}
    for st in summary["stages"]:
        rank, peak = int(st.get("pipe_stage", st["stage"])), st.get("peak_allocated_bytes")
        if peak is not None:
            measured[rank] = max(measured.get(rank, 0), int(peak))
    cells = []
    for r, pred in enumerate(predicted):
        got = measured.get(r)
        ratio = f" ({pred / got:.2f})" if got else ""
        cells.append(f"r{r} {pred / 2**20:.2f} / {got / 2**20 if got else float('nan'):.2f}{ratio}")
    return ", ".join(cells) or "not predicted (no profile)"


def has_split(profile: Path) -> bool:
    """Whether the profile has measured B/W halves (what ZB-H1's simulation needs to be fair)."""
    from paci_tune.sim.profile import Profile

    return Profile.load(str(profile)).split_measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--schedules", nargs="+", default=["paci", "1f1b"], choices=SCHEDULES)
    ap.add_argument("--chunks", type=int, default=2, help="interleaved's model chunks per rank (v)")
    ap.add_argument("--memory", action="store_true", help="measure each rank's allocated bytes (slows the steps)")
    ap.add_argument(
        "--quick", action="store_true", help="the tests' tiny model, P=2, 4 steps, 1f1b, zb-h1, 1f1b-torch, interleaved"
    )
    args = ap.parse_args()
    print(f"command: python bench/sim_vs_measured.py {' '.join(sys.argv[1:])}")
    with tempfile.TemporaryDirectory() as tmp:
        calibrate_extra: list[str] = []
        if args.quick:
            args.config = str(Path(tmp) / "quick.yaml")
            Path(args.config).write_text(yaml.safe_dump(QUICK_CONFIG, sort_keys=False))
            args.stages, args.steps, args.window = [2], 4, 4
            args.schedules, args.chunks = ["1f1b", "zb-h1", "1f1b-torch", "interleaved"], 2
            calibrate_extra = ["--repeats", "1", "--microbatch-sizes", "2"]
        for p in args.stages:
            prof = Path(tmp) / f"profile-P{p}.yaml"
            calibrate = [sys.executable, "-m", "paci_tune.cli", "calibrate", args.config, "--stages", str(p)]
            run([*calibrate, "--out", str(prof), *calibrate_extra])
            split = has_split(prof)
            if "zb-h1" in args.schedules and not split:
                print("note: the profile has no measured B/W split; zb-h1's simulation derives one (W = backward/2)")
            for sched in args.schedules:
                s = train(args.config, prof, sched, p, args, Path(tmp) / f"{sched}{p}.jsonl")
                measured = s["pipeline_seconds"] / s["steps"]
                simulated = s["clock"] / s["steps"]
                assert s["numerics_schedule"] == s["schedule"], s  # the schedule itself ran, not a stand-in
                assert math.isfinite(simulated / measured) and simulated > 0, s
                print(
                    f"P={p} {sched:10s} measured {measured * 1e3:7.1f} ms/step  simulated {simulated * 1e3:7.1f} "
                    f"ms/step  sim/measured {simulated / measured:.3f}  (bubble measured "
                    f"{s['bubble_fraction']:.3f}, simulated {s['clock_bubble_fraction']:.3f})"
                )
                if args.memory:
                    print(f"      memory per rank, predicted / measured MiB: {memory_line(s)}")


if __name__ == "__main__":
    main()
