"""``pipeline.backward_weights``: every backward against the weights its forward used, at one copy per version.

Oracles, none of which is the code under test:

- **a from-scratch PACI** (:mod:`helpers.paci_oracle`): each stage keeps its live weights and its own
  AdamW; at every forward it deep-copies the stage's module and runs the micro-batch through the copy,
  whose gradients are added to the live weights' at the backward; steps after every ``a`` backwards,
  in the stage's own 1F1B order with at most ``min(P - s, inflight)`` in flight; D replicas average
  their gradients before each step. In bf16 the live weights are bf16 with fp32 masters, each
  backward's bf16 gradient summed in fp32, the masters written back after the step.
- **the allocator's record** (the CPU profiler's memory events) for the memory a copy costs.
- **the drift bound** ceil((k - 1)/a) for how many copies may exist.

``current`` mode's numerics are pinned elsewhere (``tests/test_numerics.py``'s float64 simulation runs
both semantics); here it is the control that differs from the oracle.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import check_ok, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.memory_probe import allocated_cpu
from helpers.oracles import CONSTANT_LR, paci_order
from helpers.paci_oracle import oracle_losses

from paci_tune.config import OptimizerConfig
from paci_tune.model import GPTConfig, build_units
from paci_tune.pipeline.stage import Stage
from paci_tune.schedule import copies_bound
from paci_tune.sim import Profile, stage_memory
from paci_tune.sim.memory import stage_copies

# 8 units (embedding, 6 blocks, head): P = 8 is one unit per stage.
MODEL = {"preset": "tiny", "n_layer": 6, "d_model": 32, "n_head": 2, "block_size": 16}


def partition(p: int, n_units: int = 8) -> list[int]:
    """``n_units`` cut into ``p`` contiguous stages, as evenly as counts allow (the first ones larger)."""
    return [n_units // p + (1 if s < n_units % p else 0) for s in range(p)]


def doc_for(p: int, a: int, *, inflight: int | None = None, d: int = 1, bw: str = "forward", **extra: Any) -> dict:
    b = 2
    pipeline: dict[str, Any] = {
        "schedule": "paci",
        "stages": p,
        "window": a,
        "data_parallel": d,
        "backward_weights": bw,
        "partition": partition(p),
        **extra,
    }
    if inflight is not None:
        pipeline["inflight"] = inflight
    return make_config(
        model=MODEL,
        training={"steps": 4, "global_batch": d * a * b, "eval_every": 1000, "eval_sequences": 2},
        optimizer={"lr": 3e-2},
        lr_schedule=CONSTANT_LR,
        pipeline=pipeline,
    )


# ----------------------------------------------------------------------------------- numerics


# P 2..8, a 1..8, in-flight caps; every case has micro-batches that cross an update.
CASES = [(2, 1, None), (3, 2, None), (4, 1, None), (4, 2, 2), (5, 3, 3), (8, 1, None), (8, 4, 4), (8, 8, None)]


@pytest.mark.parametrize(("p", "a", "inflight"), CASES, ids=lambda v: str(v))
def test_forward_mode_equals_a_paci_that_copies_the_weights_at_every_forward(p: int, a: int, inflight: int | None):
    doc = doc_for(p, a, inflight=inflight)
    records = run_in_process(doc)
    got, want = train_losses(records), oracle_losses(doc)
    assert got == pytest.approx(want, abs=1e-6, rel=0)
    # the control: current weights are another algorithm wherever a backward crosses an update
    stages = summary_of(records)["stages"]
    if any(st["max_drift"] for st in stages):
        current = train_losses(run_in_process(doc_for(p, a, inflight=inflight, bw="current")))
        assert max(abs(c - w) for c, w in zip(current, want, strict=True)) > 1e-5
    # what each backward saw: its forward's weights, however many updates it crossed
    for st in stages:
        assert st["max_read_ahead"] == 0 and st["read_ahead_histogram"] == {"0": sum(st["drift_histogram"].values())}
        bound = copies_bound("paci", st["stage"], p, a, inflight)
        assert st["weight_copies_peak"] <= bound == st["weight_copies_bound"]
        assert st["max_drift"] <= bound


def test_inflight_one_is_still_flush_and_takes_no_copy():
    paci = run_in_process(doc_for(4, 2, inflight=1))
    flush = run_in_process(doc_for(4, 2, schedule="1f1b"))
    assert train_losses(paci) == train_losses(flush)
    assert all(st["weight_copies_made"] == 0 for st in summary_of(paci)["stages"])


@pytest.mark.slow
@pytest.mark.parametrize(("p", "a", "d"), [(3, 1, 1), (2, 2, 2)], ids=lambda v: str(v))
def test_distributed_forward_mode_equals_the_oracle(tmp_path: Path, p: int, a: int, d: int):
    doc = doc_for(p, a, d=d)
    doc["training"]["eval_every"] = 2  # evaluations inside the run: drained segments and held versions
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    records = read_metrics(metrics)
    assert train_losses(records) == pytest.approx(oracle_losses(doc), abs=1e-6, rel=0)
    stages = summary_of(records)["stages"]
    assert all(st["max_read_ahead"] == 0 for st in stages)
    assert stages[0]["weight_copies_made"] > 0


def test_data_parallel_forward_mode_equals_the_oracle():
    doc = doc_for(2, 2, d=2)
    assert train_losses(run_in_process(doc)) == pytest.approx(oracle_losses(doc), abs=1e-6, rel=0)


def test_bf16_forward_mode_equals_the_oracle_in_bf16():
    doc = doc_for(4, 2, precision="bf16")
    got, want = train_losses(run_in_process(doc)), oracle_losses(doc, torch.bfloat16)
    fp32 = oracle_losses(doc_for(4, 2))
    # bf16's tolerance: the two bf16 runs agree far better than bf16 agrees with fp32
    gap = max(abs(w - f) for w, f in zip(want, fp32, strict=True))
    assert gap > 1e-4
    assert got == pytest.approx(want, abs=max(1e-3, gap / 20), rel=0)


def test_current_mode_reads_the_current_weights():
    summary = summary_of(run_in_process(doc_for(4, 1, bw="current")))
    for st in summary["stages"]:
        assert st["read_ahead_histogram"] == st["drift_histogram"]
        assert st["weight_copies_made"] == 0 and st["weight_copies_bound"] == 0


@pytest.mark.parametrize("bw", ["forward", "current"])
def test_each_backward_records_the_weight_version_it_read(bw: str):
    """The per-micro-batch record against the local order's own count of steps before each forward and backward."""
    k, window, n = 5, 2, 12
    stage = Stage(
        1,
        6,
        list(build_units(WIDE, 0, indices=[1, 2]).values()),
        window=window,
        optimizer=OptimizerConfig(lr=1e-3),
        lr_at=lambda _: 1e-3,
        device=torch.device("cpu"),
        backward_weights=bw,
    )
    gen = torch.Generator().manual_seed(3)
    steps, at_forward, want = 0, {}, []
    for op, j in paci_order(k, window, n):
        if op == "F":
            at_forward[j] = steps
            stage.forward(j, torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen))
        elif op == "B":
            stage.backward(j, torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen))
            want.append((j, at_forward[j], at_forward[j] if bw == "forward" else steps, steps))
        else:
            stage.step()
            steps += 1
    assert [tuple(r) for r in stage.backward_log] == want
    assert any(f != b for _, f, _, b in want)  # some backward crossed an update


# ------------------------------------------------------------------------------------- memory

WIDE = GPTConfig(n_layer=2, n_head=2, d_model=128, block_size=8, vocab_size=32)


def stage_peak(bw: str, k: int, window: int, dtype: torch.dtype = torch.float32) -> tuple[int, Stage]:
    """Peak bytes allocated while a middle stage (s = 1 of P = 6) runs 12 micro-batches, ``k`` in flight."""
    stage = Stage(
        1,
        6,
        list(build_units(WIDE, 0, indices=[1, 2]).values()),
        window=window,
        optimizer=OptimizerConfig(lr=1e-3),
        lr_at=lambda _: 1e-3,
        device=torch.device("cpu"),
        dtype=dtype,
        backward_weights=bw,
    )
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen).to(dtype) for _ in range(12)]
    gs = [torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen).to(dtype) for _ in range(12)]

    def run(base: int) -> None:
        for op, j in paci_order(k, window, 12):
            if op == "F":
                stage.forward(base + j, xs[j])
            elif op == "B":
                stage.backward(base + j, gs[j])
            else:
                stage.step()

    run(0)  # optimizer state and gradient buffers exist before measuring, as mid-run
    _, peak = allocated_cpu(lambda: run(100))
    return peak, stage


def predicted_copy_bytes(stage: Stage, window: int, k: int, dtype: torch.dtype) -> int:
    """The memory model's ``weight_copies`` for the stage (s = 1 of P = 6, ``k`` in flight), from a hand profile
    holding the stage's real parameter count (``param_bytes`` is 4 bytes per parameter in either dtype)."""
    n_params = sum(p.numel() for p in stage.params)
    units = [
        {
            "param_bytes": 4 * n_params,
            "optimizer_s": 0.0,
            "microbatch": {1: {"forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 0, "saved_bytes": 0}},
        }
    ]
    profile = Profile.from_dict(
        {
            "seq_len": WIDE.block_size,
            "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
            "units": units,
            "p2p": {"latency_s": 0.0, "bandwidth_Bps": math.inf},
        }
    )
    copies = stage_copies("paci", 1, 6, window, k, backward_weights="forward")
    return stage_memory(profile, [0], 1, k, last=False, copies=copies).weight_copies


@pytest.mark.slow
@pytest.mark.parametrize(("window", "dtype"), [(1, torch.float32), (4, torch.float32), (2, torch.bfloat16)], ids=str)
def test_forward_mode_costs_at_most_its_copy_bound_in_weights(window: int, dtype: torch.dtype):
    weight_bytes = None
    for k in (1, 2, 3, 5):  # 1 .. P - s micro-batches in flight
        cur, _ = stage_peak("current", k, window, dtype)
        fwd, stage = stage_peak("forward", k, window, dtype)
        weight_bytes = stage.parameter_bytes()  # in bf16 the bf16 weights: the masters are never copied
        bound = copies_bound("paci", 1, 6, window, k)
        assert bound == math.ceil((k - 1) / window)
        assert stage.versions.peak_copies <= bound
        assert fwd - cur <= bound * weight_bytes, (k, fwd - cur, bound, weight_bytes)
        if bound:  # the copies are real memory, not bookkeeping: the record sees them
            assert fwd - cur >= stage.versions.peak_copies * weight_bytes * 0.9, (k, fwd - cur, weight_bytes)
        # The prediction agrees: the memory model's copy bytes for this stage, from a profile that knows
        # only its parameter count, are what forward mode measurably costs over current (within 10%).
        predicted = predicted_copy_bytes(stage, window, k, dtype)
        assert predicted == bound * weight_bytes
        assert fwd - cur <= predicted and (bound == 0 or fwd - cur >= 0.9 * predicted), (k, fwd - cur, predicted)
    assert weight_bytes and weight_bytes > 100_000 * dtype.itemsize / 4
