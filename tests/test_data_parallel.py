"""Data parallelism x pipeline parallelism: D replicas of every stage, averaged at that stage's step.

Oracles, none of them the code under test:

- plain single-process gradient accumulation (:func:`test_numerics.plain_training`) on the same
  sequences. Replica r reads micro-batch ``j * D + r`` of the D=1 stream, so D replicas with window
  ``a`` train on exactly the sequences of a D=1 run with window ``D * a`` and the same micro-batch
  size: that is the flush schedules' oracle;
- PACI has no closed form here: the distributed runtime (P x D gloo processes) is checked against
  the emulated one, and both against D=1 for what must not change (the drift records);
- an exact resume: the uninterrupted run's own numbers.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.cli import check_error, check_ok, cli_env, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import plain_training
from helpers.processes import free_port

from paci_tune.config import derive_run
from paci_tune.data import MicroBatchStream
from paci_tune.errors import ConfigError
from paci_tune.pipeline.mesh import check_world, rank_of, reporter_rank
from paci_tune.train.launch import n_processes, torchrun_command

D = 2


def dp_doc(schedule: str, stages: int, window: int = 2, steps: int = 4, **extra: Any) -> dict[str, Any]:
    """Global batch 8 = D (2) x a (2) x b (2); evaluation every 2 batches."""
    optimizer = {"lr": 3e-3, **extra.pop("optimizer", {})}
    return make_config(
        training={"steps": steps, "global_batch": 8, "eval_every": 2, "eval_sequences": 4, **extra.pop("training", {})},
        optimizer=optimizer,
        pipeline={"schedule": schedule, "stages": stages, "window": window, "data_parallel": D} | extra,
    )


def single_replica(doc: dict[str, Any]) -> dict[str, Any]:
    """The D=1 run on the same sequences: D times the window, the same micro-batch size."""
    out = copy.deepcopy(doc)
    out["pipeline"]["window"] *= out["pipeline"]["data_parallel"]
    out["pipeline"]["data_parallel"] = 1
    return out


def test_replica_r_reads_every_dth_microbatch_of_the_single_stream():
    tokens = np.arange(5000) % 97
    one = MicroBatchStream(tokens, 16, 4, seed=3)
    for r in range(3):
        rep = MicroBatchStream(tokens, 16, 4, seed=3, replicas=3, replica=r)
        for j in range(4):
            assert torch.equal(rep.get(j)[0], one.get(j * 3 + r)[0])


@pytest.mark.parametrize(
    ("schedule", "stages", "extra"),
    [
        ("1f1b", 1, {}),
        ("1f1b", 2, {}),
        ("gpipe", 1, {}),
        ("gpipe", 2, {}),
        ("1f1b", 2, {"optimizer": {"grad_clip": 0.05}}),  # clipping must see the averaged gradients
    ],
    ids=["1f1b-P1", "1f1b-P2", "gpipe-P1", "gpipe-P2", "1f1b-P2-clip"],
)
def test_flush_with_two_replicas_equals_plain_training(schedule: str, stages: int, extra: dict[str, Any]):
    doc = dp_doc(schedule, stages, **copy.deepcopy(extra))
    records = run_in_process(doc)
    want, want_val, _ = plain_training(single_replica(doc))
    assert train_losses(records) == pytest.approx(want, abs=1e-5, rel=0)
    summary = summary_of(records)
    assert summary["final_val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)
    assert summary["tokens"] == 4 * 8 * doc["model"]["block_size"]  # the whole global batch counts


def test_resume_with_two_replicas_is_exact(tmp_path: Path):
    """A PACI P=2 x D=2 run resumed from its step-2 checkpoint gives the uninterrupted run's numbers."""
    doc = dp_doc(
        "paci", 2, steps=4, training={"checkpoint_every": 2, "keep_checkpoints": 5, "checkpoint_dir": str(tmp_path)}
    )
    full = run_in_process(doc)
    (tmp_path / "LATEST").write_text("batch_00000002\n")  # as if killed after the first checkpoint
    resumed = run_in_process(doc, resume=True)
    assert [r["resumed_at"] for r in resumed if r["event"] == "start"] == [0, 2]
    assert train_losses(resumed) == train_losses(full)
    assert summary_of(resumed)["final_val_loss"] == summary_of(full)["final_val_loss"]
    assert summary_of(resumed)["stages"][0]["drift_histogram"] == summary_of(full)["stages"][0]["drift_histogram"]


@pytest.mark.slow
def test_a_data_parallel_that_does_not_divide_the_batch_is_refused(tmp_path: Path):
    metrics = tmp_path / "m.jsonl"
    proc = run_cli(write_config(tmp_path, dp_doc("paci", 2)), "--data-parallel", "3", "--metrics", metrics)
    check_error(proc, metrics, "pipeline.data_parallel", "3")
    assert "a divisor of training.global_batch=8" in proc.stderr


@pytest.mark.slow
def test_world_size_must_be_stages_times_replicas(tmp_path: Path):
    check_world(4, 2, 2)
    with pytest.raises(ConfigError, match=r"2 x 2 = 4 must equal the number of launched processes.*\(3\)"):
        check_world(3, 2, 2)
    assert [rank_of(r, s, 3) for r in range(2) for s in range(3)] == list(range(6))
    assert reporter_rank(3) == 2  # replica 0's last stage
    # The worker under a user's own launch of the wrong size (here: one process for P=1 x D=2).
    env = {
        **cli_env(),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    config = write_config(tmp_path, dp_doc("1f1b", 1))
    cmd = [sys.executable, "-m", "paci_tune.worker", str(config), "--data-parallel", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: pipeline.data_parallel: got 2" in proc.stderr and "world size (1)" in proc.stderr


def test_a_distributed_launch_takes_stages_times_replicas_processes(tmp_path: Path):
    cfg = derive_run(dp_doc("paci", 2))
    assert n_processes(cfg) == 4
    cmd = torchrun_command(tmp_path / "run.yaml", n_processes(cfg))
    assert cmd[0] == "torchrun" and "--nproc-per-node=4" in cmd  # what apply --dry-run prints
    # one node, its rendezvous static (no pickled state) on the loopback address
    assert {"--nnodes=1", "--rdzv-backend=static", "--master-addr=127.0.0.1"} <= set(cmd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_overlapped_all_reduce_averages_every_gradient_once(dtype: torch.dtype):
    """One-rank group, reported as a group of 2: every gradient comes back halved, wherever it lives.

    Tiny buckets (several launched during the backward; the last, of a layer no backward reaches,
    only at the step), fp32 gradients on the parameters and bf16 ones on fp32 masters.
    """
    import torch.distributed as dist

    from paci_tune.config.schema import OptimizerConfig
    from paci_tune.pipeline.optim import AliasedOptimizer, release_masters
    from paci_tune.pipeline.replicas import GradientAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(dtype)
        params = list(net.parameters())
        opt = AliasedOptimizer.from_config(params, OptimizerConfig(name="sgd", lr=0.1, momentum=0.0))
        reducer = GradientAllReduce(dist.group.WORLD, 2, torch.device("cpu"), opt, bucket_bytes=64)
        x = torch.randn(5, 4, dtype=dtype)
        net[2](net[1](x)).square().sum().backward()  # an unarmed backward (not the window's last)
        reducer.arm()
        net[2](net[1](x)).square().sum().backward()
        assert reducer._launched, "nothing went out during the backward"
        want = [None if opt.gradient_of(i) is None else opt.gradient_of(i).clone() / 2 for i in range(len(params))]
        reducer.average()
        for i, w in enumerate(want):
            got = opt.gradient_of(i)
            assert (got is None) == (w is None) and (w is None or torch.equal(got, w)), i
        assert sum(w is None for w in want) == 2  # the unused layer keeps no gradient
        release_masters(params)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_paci_two_stages_two_replicas_equals_emulated(tmp_path: Path):
    """4 gloo processes: the emulated runtime's losses, evaluations and drift; its checkpoint resumes exactly."""
    ckpt = tmp_path / "ckpt"
    doc = dp_doc("paci", 2, training={"checkpoint_every": 2, "keep_checkpoints": 5}, partition=[2, 2])  # as resolved
    emulated = run_in_process(doc | {"training": {**doc["training"], "checkpoint_dir": str(tmp_path / "e")}})
    proc = run_cli(
        write_config(tmp_path, doc),
        "--runtime",
        "distributed",
        "--checkpoint-dir",
        ckpt,
        "--metrics",
        tmp_path / "dist.jsonl",
        timeout=300,
    )
    check_ok(proc)
    dist = read_metrics(tmp_path / "dist.jsonl")
    assert train_losses(dist) == pytest.approx(train_losses(emulated), abs=1e-5, rel=0)
    evals = [[r["val_loss"] for r in rs if r["event"] == "eval"] for rs in (dist, emulated)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-5, rel=0)
    got, want = summary_of(dist), summary_of(emulated)
    one = {"global_batch": 4, "checkpoint_every": 2, "checkpoint_dir": str(tmp_path / "1")}
    d1 = summary_of(run_in_process(dp_doc("paci", 2, training=one, data_parallel=1)))  # same P, a, segments; D=1
    a, p = doc["pipeline"]["window"], doc["pipeline"]["stages"]
    for s in range(p):
        assert got["stages"][s]["drift_histogram"] == want["stages"][s]["drift_histogram"]
        assert got["stages"][s]["drift_histogram"] == d1["stages"][s]["drift_histogram"]  # as D=1
        assert got["stages"][s]["max_drift"] == math.ceil((p - s - 1) / a)
    assert got["tokens"] == want["tokens"] == 4 * 8 * doc["model"]["block_size"]
    # Replica 0 wrote one file per stage; the emulated runtime resumes from it at step 2.
    assert sorted(f.name for f in (ckpt / "batch_00000002").glob("stage_*.pt")) == ["stage_0.pt", "stage_1.pt"]
    (ckpt / "LATEST").write_text("batch_00000002\n")
    resumed = run_in_process(doc | {"training": {**doc["training"], "checkpoint_dir": str(ckpt)}}, resume=True)
    assert train_losses(resumed) == pytest.approx(train_losses(dist), abs=1e-5, rel=0)
    assert os.path.exists(ckpt / "batch_00000004" / "meta.json")
