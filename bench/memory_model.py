"""Predicted against measured peak allocated memory per stage, on the distributed runtime (issue 38).

For each depth P and precision: calibrate the model's profile (its bytes: parameters, activations,
saved tensors, and the transients of a unit's training pass, evaluation forward and optimizer step;
paci_tune/calibrate/units.py), train every schedule for a few steps on the distributed runtime, one
process per stage, and compare each stage's measured ``peak_allocated_bytes`` with the memory model's
allocated part (paci_tune/sim/memory.py, ``StageMemory.allocated``). On the CPU the runtime measures it
with its dispatch-mode meter (``PACI_TUNE_TRACK_MEMORY=1``, paci_tune/pipeline/meter.py); on CUDA
(``--device cuda``: every stage process on the one GPU, gloo staging through the host) it reads
``torch.cuda.max_memory_allocated`` of each stage process. All of one P's runs go through one torchrun
launch (bench/memory_worker.py). Prints a table and, last, one JSON line with every row.

    python bench/memory_model.py                 # P = 2 and 4, fp32 and bf16, every schedule
    python bench/memory_model.py --quick         # P = 2, fp32: that it runs (CI)
    python bench/memory_model.py --device cuda   # the same on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paci_tune.base.processes import free_port, loopback_env, worker_env  # noqa: E402

TOLERANCE = 0.10
"""The issue's bar: each stage's prediction within 10% of its measurement."""

VARIANTS: dict[str, dict[str, Any]] = {
    "1f1b": {"schedule": "1f1b"},
    "paci-forward": {"schedule": "paci", "backward_weights": "forward"},
    "paci-current": {"schedule": "paci", "backward_weights": "current"},
    "gpipe": {"schedule": "gpipe"},
    "zb-h1": {"schedule": "zb-h1"},
    "interleaved": {"schedule": "interleaved", "chunks": 2},
    "zb-v": {"schedule": "zb-v", "window": 8},
    "dualpipev": {"schedule": "dualpipev", "window": 8},
}
"""Every schedule, as ``pipeline`` keys (PACI under both ``backward_weights``); the V schedules at a window
of 8 (DualPipeV needs ``a >= 2P``)."""

MODELS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cpu": (
        {"preset": "tiny", "n_layer": 6, "d_model": 64, "n_head": 2, "block_size": 32},
        {"source": "synthetic", "vocab_size": 4096, "branching": 4, "n_train": 20_000, "n_val": 2_000},
    ),
    "cuda": (
        {"preset": "tiny", "n_layer": 6, "d_model": 512, "n_head": 8, "block_size": 256},
        {"source": "synthetic", "vocab_size": 32768, "branching": 4, "n_train": 40_000, "n_val": 8_000},
    ),
}
"""Model and data per device: eight units (embedding, six blocks, head; interleaved 1F1B at P = 4 needs
2 x 4 pieces), the vocabulary large next to the width, so the head's logits and their softmax weigh
what they weigh in a real GPT. On a GPU a wider one, whose stages (hundreds of MiB) dwarf what the
allocator counts besides tensors (cuBLAS's workspaces, tens of MiB)."""


def run_doc(stages: int, precision: str, variant: str, device: str = "cpu", steps: int = 3) -> dict[str, Any]:
    """The config of one measured run: the device's model above, ``steps`` global batches of 4 micro-batches,
    an evaluation every 2 (so PACI's run mid-schedule) and the drained one at the end, of 8 sequences each."""
    model, data = MODELS[device]
    pipe = {
        "stages": stages,
        "window": 4,
        "runtime": "distributed",
        "device": device,
        "precision": precision,
        **VARIANTS[variant],
    }
    training = {
        "global_batch": 16,
        "steps": steps,
        "seed": 0,
        "eval_every": 2,
        "eval_sequences": 16,
        "eval_microbatch_size": 8,
    }
    return {
        "model": model,
        "data": data,
        "training": training,
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8},
        "pipeline": pipe,
    }


def launch(stages: int, docs: dict[str, dict[str, Any]], workdir: Path, timeout: float = 600) -> dict[str, dict]:
    """Train every config of ``docs`` (by name) in one torchrun launch of ``stages`` processes; their summaries."""
    paths = []
    for name, doc in docs.items():
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths.append(str(path))
    out = workdir / f"out-p{stages}"
    out.mkdir(exist_ok=True)
    env = loopback_env(worker_env(1))
    env["PACI_TUNE_TRACK_MEMORY"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--nproc-per-node={stages}",
        str(REPO / "bench" / "memory_worker.py"),
        str(out),
        *paths,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {name: json.loads((out / f"{name}.json").read_text()) for name in docs}


def profile_for(doc: dict[str, Any], workdir: Path) -> Any:
    """The model's profile, measured here: its bytes are what matter (times taken once, quickly)."""
    from paci_tune.calibrate.measure import calibrate
    from paci_tune.config import load_config
    from paci_tune.sim.profile import P2PCost

    path = workdir / "calibrate.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cfg = load_config(str(path))
    return calibrate(
        cfg,
        microbatch_sizes=[cfg.pipeline.microbatch_size],
        repeats=1,
        warmup=0,
        threads=1,
        processes=1,
        p2p=P2PCost(0.0, math.inf),
        allreduce=False,
    )


def measured_per_rank(summary: dict[str, Any]) -> list[int]:
    """Each stage process's ``peak_allocated_bytes`` (an interleaved rank's pieces report its one peak)."""
    by_rank: dict[int, int] = {}
    for st in summary["stages"]:
        by_rank[st.get("pipe_stage", st["stage"])] = st["peak_allocated_bytes"]
    return [by_rank[r] for r in sorted(by_rank)]


def predicted_per_rank(doc: dict[str, Any], profile: Any, partition: list[int], workdir: Path) -> list[Any]:
    """The memory model's prediction per stage process (:func:`paci_tune.pipeline.planning.predicted_stage_memory`)."""
    from paci_tune.config import load_config
    from paci_tune.pipeline.planning import predicted_stage_memory

    path = workdir / "predict.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return predicted_stage_memory(load_config(str(path)), profile, partition)


def rows_for(stages: int, precisions: list[str], variants: list[str], device: str, workdir: Path) -> list[dict]:
    """Measure every (precision, variant) at depth ``stages`` in one launch; a row per stage process."""
    docs = {f"{prec}-{v}": run_doc(stages, prec, v, device) for prec in precisions for v in variants}
    start = time.perf_counter()
    summaries = launch(stages, docs, workdir)
    print(f"P={stages}: {len(docs)} runs in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for prec in precisions:
        start = time.perf_counter()
        profile = profile_for(run_doc(stages, prec, "1f1b", device), workdir)
        print(f"P={stages} {prec}: calibrated in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        for v in variants:
            name = f"{prec}-{v}"
            summary = summaries[name]
            predicted = predicted_per_rank(docs[name], profile, summary["partition"], workdir)
            for s, (pred, meas) in enumerate(zip(predicted, measured_per_rank(summary), strict=True)):
                rows.append(
                    {
                        "P": stages,
                        "precision": prec,
                        "schedule": v,
                        "stage": s,
                        "partition": summary["partition"],
                        "predicted": pred.allocated,
                        "measured": meas,
                        "error": pred.allocated / meas - 1,
                        "parts": pred.to_dict(),
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--schedules", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="P = 2, fp32 only")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.precisions = [2], ["fp32"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.stages:
            rows += rows_for(p, args.precisions, args.schedules, args.device, Path(tmp))
    head = f"{'P':>2} {'precision':9} {'schedule':13} {'stage':>5} {'predicted MiB':>13} {'measured MiB':>12}"
    print(f"{head} {'error':>7}")
    for r in rows:
        print(
            f"{r['P']:>2} {r['precision']:9} {r['schedule']:13} {r['stage']:>5} {r['predicted'] / 2**20:>13.2f} "
            f"{r['measured'] / 2**20:>12.2f} {r['error']:>+7.1%}"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.1%} (bar {TOLERANCE:.0%})")
    print(json.dumps({"rows": rows, "worst": worst}))


if __name__ == "__main__":
    main()
