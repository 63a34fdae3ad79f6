"""The CUDA path, checked against oracles that do not depend on it (skipped without a GPU).

CI has no GPU; these run on a lent one through ``bash bench/gpu_check.sh``. What only a GPU shows:
device placement of every unit, batch and transfer; bf16 with fp32 master weights on CUDA kernels
(the checks of tests/test_bf16.py, run on the GPU: weights saved by reference, allocated bytes at
one micro-batch in flight against P - s, plain bf16 training, bf16 against fp32); CUDA memory
accounting; the backend choice (NCCL with a GPU per stage, host-staged gloo when stages share
one); calibration timed with CUDA synchronisation. The oracles: plain single-process training on
the CPU (tests/test_numerics.py) or in bf16 on the GPU (tests/test_bf16.py), the same run on the
CPU, an analytic lower bound on memory.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import REPO
from helpers.bf16 import (
    GAP_TOL,
    bf16_fp32_gap,
    check_memory_does_not_grow_beyond_activations,
    check_saves_weights_by_reference,
    plain_bf16_training,
)
from helpers.cli import check_ok, cli_env, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import CONSTANT_LR, numerics_doc, plain_training

from paci_tune.data import load_source
from paci_tune.model import load_model
from paci_tune.pipeline.backend import choose_backend, visible_gpus
from paci_tune.pipeline.factory import resolve_device, resolve_precision

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_config(**pipeline: Any) -> dict[str, Any]:
    return make_config(pipeline={"device": "cuda", "precision": "fp32", **pipeline})


def test_auto_means_cuda_bf16_and_nccl_here():
    dev = resolve_device("auto")
    assert dev.type == "cuda"
    assert resolve_precision("auto", dev) == "bf16"
    assert choose_backend("auto", "auto", 1, visible_gpus()) == "nccl"


def test_flush_on_cuda_trains_like_plain_training_on_cpu():
    doc = cuda_config(schedule="1f1b", stages=2, window=4)
    records = run_in_process(doc)
    want, want_val, _ = plain_training(make_config(pipeline={"schedule": "1f1b", "stages": 2, "window": 4}))
    assert summary_of(records)["device"].startswith("cuda")
    assert train_losses(records) == pytest.approx(want, rel=1e-4)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, rel=1e-4)


def test_paci_on_cuda_matches_paci_on_cpu():
    got = run_in_process(cuda_config(schedule="paci", stages=3, window=2))
    want = run_in_process(make_config(pipeline={"schedule": "paci", "stages": 3, "window": 2}))
    assert train_losses(got) == pytest.approx(train_losses(want), rel=1e-4)
    assert summary_of(got)["max_drift"] == summary_of(want)["max_drift"]


@pytest.mark.parametrize("controls", [{"optimizer": "nadam"}, {"optimizer": "adamw", "predict_weights": True}])
def test_staleness_controls_on_cuda_match_cpu(controls: dict[str, Any]):
    """NAdam and weight prediction (issue 37) on CUDA train the CPU's numbers: placement of moments and masters."""
    optimizer = {"name": controls["optimizer"], "lr": 3e-3}
    pipeline = {"schedule": "paci", "stages": 3, "window": 2, "predict_weights": controls.get("predict_weights", False)}
    got = run_in_process(make_config(optimizer=optimizer, pipeline={"device": "cuda", "precision": "fp32", **pipeline}))
    want = run_in_process(make_config(optimizer=optimizer, pipeline=pipeline))
    assert train_losses(got) == pytest.approx(train_losses(want), rel=1e-4)


def test_muon_on_cuda_is_torchs_bf16_step_and_tracks_the_cpus_fp32():
    """On CUDA Muon is torch's step (Newton-Schulz in bf16); on the CPU it iterates in fp32 (pipeline/muon.py).

    The oracle is the CPU run: bf16 iterations change each update by ~1e-2 relative, so the losses
    agree to the bf16 gap of tests/test_bf16.py, not to float rounding (4e-5 on a CPU with bf16 iterations).
    """
    optimizer = {"name": "muon", "lr": 2e-2}
    pipeline = {"schedule": "paci", "stages": 2, "window": 2}
    got = run_in_process(make_config(optimizer=optimizer, pipeline={"device": "cuda", "precision": "fp32", **pipeline}))
    want = run_in_process(make_config(optimizer=optimizer, pipeline=pipeline))
    assert summary_of(got)["device"].startswith("cuda")
    gaps = [abs(a - b) for a, b in zip(train_losses(got), train_losses(want), strict=True)]
    assert max(gaps) < GAP_TOL
    assert max(gaps) > 0


def test_bf16_tracks_fp32():
    """bf16 with fp32 masters against fp32, PACI over 50 steps on the GPU: tests/test_bf16.py's tolerance."""
    fp32, bf16, s32, s16 = bf16_fp32_gap("paci", device="cuda")
    assert s16["precision"] == "bf16" and s16["device"].startswith("cuda")
    assert bf16 != fp32  # bf16 really ran
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < GAP_TOL
    assert abs(s16["final_val_loss"] - s32["final_val_loss"]) < GAP_TOL


def test_bf16_saves_weights_by_reference_on_cuda():
    check_saves_weights_by_reference(torch.device("cuda"))


def test_bf16_memory_does_not_grow_with_inflight_on_cuda():
    """torch.cuda's allocated bytes at 1 and P - s = 4 in flight (and the autocast control)."""
    check_memory_does_not_grow_beyond_activations(torch.device("cuda"))


@pytest.mark.parametrize("stages", [2, 4])
def test_bf16_1f1b_equals_plain_bf16_on_cuda(stages: int):
    """Tolerance 1e-4, ten times the CPU's: the same CUDA kernels run in both, but some (embedding
    backward) sum with atomics in any order, and a reordered sum can round to another bf16 value."""
    doc = numerics_doc("1f1b", stages, CONSTANT_LR, precision="bf16", device="cuda")
    want, want_val = plain_bf16_training(doc, "cuda")
    records = run_in_process(doc)
    assert train_losses(records) == pytest.approx(want, abs=1e-4, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=1e-4, rel=0)


def peak_and_params(**pipeline: Any) -> tuple[int, int]:
    """The peak memory a PACI P=2 CUDA training reports, and its model's parameter count."""
    doc = cuda_config(schedule="paci", stages=2, window=4, **pipeline)
    torch.cuda.reset_peak_memory_stats()
    peak = summary_of(run_in_process(doc))["peak_memory_bytes"]
    source = load_source(doc["data"], None)
    model = load_model(doc["model"], source.vocab_size, 0)
    return peak, sum(p.numel() for u in model.units.values() for p in u.parameters())


def test_peak_memory_is_cuda_memory_and_covers_the_training_state():
    peak, n_params = peak_and_params()
    # fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter at least.
    assert 16 * n_params <= peak < 2**30


def test_bf16_peak_memory_covers_weights_masters_grads_and_moments():
    peak, n_params = peak_and_params(precision="bf16")
    # bf16 weights 2 + fp32 masters 4 + fp32 gradients 4 + AdamW's two fp32 moments 8 bytes per parameter.
    assert 18 * n_params <= peak < 2**30


def test_distributed_on_cuda_equals_emulated(tmp_path: Path):
    doc = cuda_config(schedule="paci", stages=2, window=4)
    emu, dist = tmp_path / "emu.jsonl", tmp_path / "dist.jsonl"
    config = write_config(tmp_path, doc)
    check_ok(run_cli(config, "--metrics", emu))
    proc = run_cli(config, "--runtime", "distributed", "--metrics", dist)
    check_ok(proc)
    if visible_gpus() < 2:
        assert "share 1 GPU" in proc.stderr  # host-staged gloo, said out loud
    got, want = read_metrics(dist), read_metrics(emu)
    assert summary_of(got)["device"].startswith("cuda")
    assert train_losses(got) == pytest.approx(train_losses(want), abs=1e-5, rel=1e-5)


def test_bf16_distributed_on_cuda_equals_emulated(tmp_path: Path):
    """Tolerance 1e-4 (fp32's is 1e-5): bf16 sums that CUDA kernels reorder round to other values."""
    doc = cuda_config(schedule="paci", stages=2, window=4, precision="bf16")
    emu, dist = tmp_path / "emu.jsonl", tmp_path / "dist.jsonl"
    config = write_config(tmp_path, doc)
    check_ok(run_cli(config, "--metrics", emu))
    check_ok(run_cli(config, "--runtime", "distributed", "--metrics", dist))
    got, want = read_metrics(dist), read_metrics(emu)
    assert summary_of(got)["precision"] == "bf16"
    assert train_losses(got) == pytest.approx(train_losses(want), abs=1e-4, rel=0)


def test_single_stage_on_nccl(tmp_path: Path):
    doc = cuda_config(schedule="paci", stages=1, window=4, backend="nccl")
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    want = run_in_process(cuda_config(schedule="paci", stages=1, window=4))
    assert train_losses(read_metrics(metrics)) == pytest.approx(train_losses(want), abs=1e-5, rel=1e-5)


@pytest.mark.parametrize(("schedule", "chunks"), [("zb-h1", None), ("interleaved", 2)])
def test_torch_schedules_on_nccl_equal_flush_on_cuda(tmp_path: Path, schedule: str, chunks: int | None):
    """torch's own schedule classes on CUDA stages over NCCL (one stage per GPU: P = the GPUs, at most 2;
    interleaved with its 2 pieces per rank), against paci-tune's own 1F1B on the emulated runtime on
    CUDA: the same flush numbers (fp32, 1e-5)."""
    stages = min(visible_gpus(), 2)
    doc = cuda_config(schedule=schedule, stages=stages, window=4, backend="nccl", chunks=chunks)
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    got = read_metrics(metrics)
    assert summary_of(got)["numerics_schedule"] == schedule and summary_of(got)["device"].startswith("cuda")
    want = run_in_process(cuda_config(schedule="1f1b", stages=stages, window=4))
    assert train_losses(got) == pytest.approx(train_losses(want), abs=1e-5, rel=1e-5)


def test_explicit_nccl_with_more_stages_than_gpus_is_refused(tmp_path: Path):
    n = visible_gpus()
    doc = cuda_config(schedule="paci", stages=n + 1, window=4, backend="nccl")
    proc = run_cli(write_config(tmp_path, doc), "--runtime", "distributed")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("error: pipeline.backend: got 'nccl'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_calibrate_on_cuda(tmp_path: Path):
    out = tmp_path / "profile.yaml"
    config = write_config(tmp_path, make_config())
    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "calibrate",
        str(config),
        "--out",
        str(out),
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--microbatch-sizes",
        "2,4",
        "--repeats",
        "2",
    ]
    check_ok(subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=cli_env(), check=False))
    doc = yaml.safe_load(out.read_text())
    assert doc["dtype"] == "bf16" and doc["device"] == torch.cuda.get_device_name(0)
    for unit in doc["units"]:
        two, four = unit["microbatch"][2], unit["microbatch"][4]
        assert two["forward_s"] > 0 and two["backward_s"] > 0
        assert four["activation_bytes"] == 2 * two["activation_bytes"]  # activations are exactly linear in b


def test_memory_model_per_stage_on_cuda(tmp_path: Path):
    """Issue 38 on a GPU: every stage process of the distributed runtime on the one GPU (gloo, staged
    through the host) reads its own ``torch.cuda.max_memory_allocated``, and the memory model's allocated
    peak per stage, from a profile calibrated on CUDA, is within 10% of it, for 1f1b, PACI under both
    ``backward_weights``, P = 2, in bf16 -- the GPU's precision (bench/memory_model.py; fp32 and gpipe are
    ``python bench/memory_model.py --device cuda``). Two 2026-12-04 leases ran out inside a larger version
    of this test (both precisions, gpipe too), so it is sized for a lease and prints how long each part
    took. zb-h1 and interleaved run on torch's schedules, which need NCCL for CUDA stages, and NCCL takes
    one GPU per rank: on one GPU they are checked on the CPU only (tests/test_memory_model.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_model_bench_gpu", REPO / "bench" / "memory_model.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    variants = ["1f1b", "paci-forward", "paci-current"]
    start = time.perf_counter()
    rows = bench.rows_for(2, ["bf16"], variants, "cuda", tmp_path)
    print(f"memory model on CUDA: {time.perf_counter() - start:.0f} s for {len(variants)} runs and a calibration")
    assert len(rows) == 2 * len(variants)
    for r in rows:
        assert r["measured"] > r["parts"]["params"] + r["parts"]["optimizer_state"]
    table = "\n".join(
        f"{r['precision']} {r['schedule']} stage {r['stage']}: predicted {r['predicted'] / 2**20:.1f} "
        f"MiB, measured {r['measured'] / 2**20:.1f} MiB ({r['error']:+.1%})"
        for r in rows
    )
    print(table)
    assert all(abs(r["error"]) <= bench.TOLERANCE for r in rows), table
