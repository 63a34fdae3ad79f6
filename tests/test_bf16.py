"""bf16 PACI with fp32 master weights: no hidden weight copy, the current weights in every backward.

Oracles, none of which is the code under test:

- **storages** seen by autograd's saved-tensor hooks (a weight saved by reference is the
  parameter's own storage; a cast copy is a new storage with the weight's values);
- **allocated bytes**, from the allocator's own record (the CPU profiler's memory events, or
  ``torch.cuda`` statistics), at one micro-batch in flight against ``P - s``;
- **closed forms** of a linear layer's forward, input gradient and SGD step;
- **plain bf16 training** written here from scratch: one process, the units chained in bf16,
  torch's AdamW stepping fp32 copies of the weights, each micro-batch's bf16 gradient summed in
  fp32, the copies written back into the bf16 weights after each step;
- **fp32 training** of the same run, for the precision gap.

The old scheme (fp32 parameters under ``torch.autocast``) is measured by the same oracles as a
control: they do see its per-micro-batch weight copies. The oracles (``tests/helpers/bf16.py``) take
a device, so ``tests/test_gpu.py`` runs the same checks on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.bf16 import (
    BF16,
    CPU,
    GAP_TOL,
    WIDE,
    bf16_fp32_gap,
    bf16_stage,
    check_memory_does_not_grow_beyond_activations,
    check_saves_weights_by_reference,
    plain_bf16_training,
    torch_threads,
    weight_copies,
)
from helpers.cli import check_ok, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.memory_probe import SavedTensors
from helpers.oracles import CONSTANT_LR, numerics_doc
from torch import nn

from paci_tune.base.processes import threads_per_process
from paci_tune.model import build_units
from paci_tune.pipeline.stage import Stage

# ------------------------------------------------------------------------- no weight copy


def test_bf16_forward_saves_weights_by_reference():
    check_saves_weights_by_reference(CPU)


def test_control_autocast_saves_a_bf16_copy_of_every_matrix_per_microbatch():
    """The old scheme, seen by the same oracle: fp32 parameters under autocast stash bf16 copies."""
    stage = bf16_stage(1, 3, list(build_units(WIDE, 0, indices=[1, 2]).values()), dtype=torch.float32)
    x = torch.randn(2, WIDE.block_size, WIDE.d_model)
    with SavedTensors() as rec, torch.autocast("cpu", dtype=BF16):
        stage.forward(0, x)
    matrices = sorted(tuple(p.shape) for p in stage.params if p.dim() == 2)
    assert sorted(weight_copies(rec.saved, stage.params)) == matrices


# ---------------------------------------------------------------------- PACI's semantics


def ulps(actual: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor | float = 1.0) -> float:
    """Largest |actual - exact| in bf16 ulps of ``exact * scale`` (one ulp of x is at most |x| 2^-7)."""
    err = (actual.float() - exact).abs() - 1e-6 * exact.abs()  # fp32's own rounding is not counted
    return float((err / ((exact * scale).abs() * 2**-7 + 1e-30)).max())


def test_bf16_backward_after_a_step_uses_the_new_weights():
    """Middle stage, one bf16 Linear: F0, F1, B0, STEP, B1. mb1's input gradient is g1 @ W_new.

    Tolerance: one bf16 ulp. Each result is one bf16 rounding of an fp32-accumulated product
    (forward, input and weight gradients), and the fp32 master moves by lr times a gradient so
    rounded. The step moves the weights by ~0.2, about 50 ulps of their size.
    """
    torch.manual_seed(0)
    lin = nn.Linear(5, 3, bias=False)
    lr = 0.1
    stage = bf16_stage(1, 3, [lin], lr=lr, name="sgd", momentum=0.0, weight_decay=0.0)
    assert lin.weight.dtype == BF16
    x0, x1 = torch.randn(4, 5, dtype=BF16), torch.randn(4, 5, dtype=BF16)
    g0, g1 = torch.randn(4, 3, dtype=BF16), torch.randn(4, 3, dtype=BF16)
    w_old = lin.weight.detach().clone()
    f = torch.Tensor.float

    out0, out1 = stage.forward(0, x0), stage.forward(1, x1)
    assert out0.dtype == BF16
    assert ulps(out0, f(x0) @ f(w_old).T) <= 1 and ulps(out1, f(x1) @ f(w_old).T) <= 1
    assert ulps(stage.backward(0, g0), f(g0) @ f(w_old)) <= 1
    stage.step()
    master = stage.optim.masters[0]
    dw0 = f(g0).T @ f(x0)
    assert ulps(master - f(w_old), -lr * dw0) <= 1  # SGD by hand, on the fp32 master
    assert torch.equal(lin.weight.detach(), master.to(BF16)), "the step did not write the master into the weight"

    gin1 = stage.backward(1, g1)  # no "modified by an inplace operation" error
    w_new = lin.weight.detach()
    assert ulps(gin1, f(g1) @ f(w_new)) <= 1
    assert ulps(gin1, f(g1) @ f(w_old)) > 10, "backward used the stale weights"
    assert lin.weight.grad is None, "the bf16 gradient must be folded into the fp32 master gradient"
    assert master.grad.dtype == torch.float32
    assert ulps(master.grad, f(g1).T @ f(x1)) <= 1  # the activation saved at forward time
    assert stage.drift.histogram == {0: 1, 1: 1} and stage.updates == 1


def test_window_gradients_accumulate_in_fp32():
    """Three backwards at a bf16 stage: each master gradient is exactly the fp32 sum of the three
    bf16 gradients, each computed alone by the same blocks built afresh in bf16 (bit-exact: same
    kernels, same inputs)."""
    stage = bf16_stage(1, 3, list(build_units(WIDE, 0, indices=[1, 2]).values()), window=3)
    oracle = nn.Sequential(*build_units(WIDE, 0, indices=[1, 2]).values()).to(BF16)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, WIDE.block_size, WIDE.d_model, generator=gen).to(BF16) for _ in range(3)]
    gs = [torch.randn(2, WIDE.block_size, WIDE.d_model, generator=gen).to(BF16) for _ in range(3)]
    for j in range(3):
        stage.forward(j, xs[j])
    for j in range(3):
        stage.backward(j, gs[j])
    alone = []
    for x, g in zip(xs, gs, strict=True):
        oracle(x.detach().requires_grad_()).backward(g)
        alone.append([p.grad for p in oracle.parameters()])
        oracle.zero_grad(set_to_none=True)
    fp32_sums = [a.float() + b.float() + c.float() for a, b, c in zip(*alone, strict=True)]
    for m, want in zip(stage.optim.masters, fp32_sums, strict=True):
        assert torch.equal(m.grad, want)
    bf16_sums = [a + b + c for a, b, c in zip(*alone, strict=True)]  # what accumulating in .grad would give
    assert any(not torch.equal(s.float(), w) for s, w in zip(bf16_sums, fp32_sums, strict=True))


def test_bf16_checkpoint_restores_the_fp32_masters_exactly(tmp_path: Path):
    """Save a bf16 stage mid-run, load it into a stage built from other weights: both continue bit for bit."""

    def units(seed: int) -> list[nn.Module]:
        return list(build_units(WIDE, seed, indices=[1, 2]).values())

    gen = torch.Generator().manual_seed(4)
    data = [
        (torch.randn(2, 8, 128, generator=gen).to(BF16), torch.randn(2, 8, 128, generator=gen).to(BF16))
        for _ in range(4)
    ]

    def train(stage: Stage, batches: list) -> None:
        for x, g in batches:
            stage.forward(0, x)
            stage.backward(0, g)
            stage.step()

    a = bf16_stage(1, 3, units(0), lr=1e-3)
    train(a, data[:2])
    assert any(not torch.equal(m.to(BF16).float(), m) for m in a.optim.masters), "masters carry no extra bits"
    torch.save(a.state_dict(), tmp_path / "stage.pt")
    b = bf16_stage(1, 3, units(1), lr=1e-3)
    b.load_state_dict(torch.load(tmp_path / "stage.pt", weights_only=False))
    train(a, data[2:])
    train(b, data[2:])
    for pa, pb, ma, mb in zip(a.params, b.params, a.optim.masters, b.optim.masters, strict=True):
        assert torch.equal(pa, pb) and torch.equal(ma, mb)
    # A checkpoint of fp32 weights (no masters in it) gives masters equal to those weights.
    c = bf16_stage(1, 3, units(2), dtype=torch.float32)
    d = bf16_stage(1, 3, units(3))
    d.load_state_dict(c.state_dict())
    assert all(torch.equal(m, p) for m, p in zip(d.optim.masters, c.params, strict=True))


# ------------------------------------------------------------------- memory in flight


def test_bf16_memory_does_not_grow_with_inflight_beyond_activations():
    check_memory_does_not_grow_beyond_activations(CPU)


def test_memory_model_counts_what_a_bf16_stage_holds():
    """stage_memory for a bf16 profile = the bytes of a real bf16 stage's tensors mid-window:
    bf16 weights, fp32 masters, fp32 gradients, AdamW's two fp32 moments."""
    from paci_tune.calibrate.units import fp32_param_bytes
    from paci_tune.sim import P2PCost, Profile, stage_memory
    from paci_tune.sim.profile import UnitCost, UnitProfile

    units = list(build_units(WIDE, 0, indices=[1, 2]).values())
    cost = {1: UnitCost(1e-3, 2e-3, 1, 0)}
    p2p = P2PCost(0.0, float("inf"))
    prof = Profile(
        units=[UnitProfile(f"b{i}", fp32_param_bytes(u), 1e-3, cost) for i, u in enumerate(units)],
        p2p=p2p,
        seq_len=WIDE.block_size,
        dtype="bf16",
    )
    stage = bf16_stage(1, 3, units)
    for mb in range(2):  # a window and its step (optimizer state exists), then a backward (gradients exist)
        stage.forward(mb, torch.randn(1, 8, 128))
        stage.backward(mb, torch.randn(1, 8, 128))
        if mb == 0:
            stage.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    state = [t for s in stage.optim.optimizer.state.values() for t in s.values() if t.dim() > 0]
    mem = stage_memory(prof, [0, 1], 1, 0, last=False, overhead_bytes=0)
    assert mem.params == nbytes(stage.params) == 2 * sum(p.numel() for p in stage.params)
    assert mem.masters == nbytes(stage.optim.masters)
    assert mem.grads == nbytes([m.grad for m in stage.optim.masters])
    assert mem.optimizer_state == nbytes(state)
    assert mem.total == 18 * sum(p.numel() for p in stage.params)
    fp32 = stage_memory(Profile(prof.units, p2p, 8, dtype="fp32"), [0, 1], 1, 0, last=False, overhead_bytes=0)
    assert (fp32.params, fp32.masters, fp32.total) == (mem.masters, 0, 16 * sum(p.numel() for p in stage.params))


def test_calibration_probes_bf16_without_weight_copies():
    """A profile's saved bytes in bf16 are the bf16 activations: less than in fp32, with no weight copy."""
    from paci_tune.calibrate.units import probe, to_compute

    x = torch.randn(1, WIDE.block_size, WIDE.d_model)
    saved = {}
    for dtype in ("fp32", "bf16"):
        unit = to_compute(build_units(WIDE, 0, indices=[1])[1], CPU, dtype)
        saved[dtype] = probe(unit, x, last=False, device=CPU, dtype=dtype).saved_bytes
    assert saved["bf16"] < saved["fp32"]


# -------------------------------------------------------------------------------- training


@pytest.mark.parametrize("stages", [2, 4])
def test_bf16_1f1b_equals_plain_bf16_training(stages: int):
    """Tolerance 1e-5 (as for fp32): the pipeline runs the oracle's operations on the same bf16 tensors;
    only the order of float additions of reported losses may differ."""
    doc = numerics_doc("1f1b", stages, CONSTANT_LR, precision="bf16")
    records = run_in_process(doc)
    want, want_val = plain_bf16_training(doc)
    assert summary_of(records)["precision"] == "bf16"
    assert train_losses(records) == pytest.approx(want, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)


@pytest.mark.slow
def test_bf16_tracks_fp32_over_50_steps():
    fp32, bf16, s32, s16 = bf16_fp32_gap("paci")
    assert s16["precision"] == "bf16" and s32["precision"] == "fp32"
    assert bf16 != fp32, "bf16 did not run in bf16"
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < GAP_TOL
    assert abs(s16["final_val_loss"] - s32["final_val_loss"]) < GAP_TOL
    assert fp32[0] - fp32[-1] > 1.0, "the run must learn for the gap to mean something"


@pytest.mark.slow
def test_bf16_distributed_equals_emulated(tmp_path: Path):
    """PACI P=2 in bf16 with an evaluation mid-run (a bf16 snapshot): the two runtimes agree to 1e-5,
    as in fp32 (the same per-stage actions on the same tensors; bf16 activations cross the wire).

    The emulated run computes with the threads each distributed worker gets: CPU bf16 kernels split
    their sums by thread count, and a split rounds differently in bf16 (measured: the losses move by
    up to 7e-5 over these 8 steps at 2 threads against 1; in fp32 they are bit-identical)."""
    doc = make_config(
        training={"steps": 8, "eval_every": 4},
        pipeline={"schedule": "paci", "stages": 2, "window": 4, "precision": "bf16"},
    )
    with torch_threads(threads_per_process(2)):
        emulated = run_in_process(doc)
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    got = read_metrics(metrics)
    assert summary_of(got)["precision"] == "bf16"
    assert train_losses(got) == pytest.approx(train_losses(emulated), abs=1e-5, rel=0)
    evals = [[r["val_loss"] for r in recs if r["event"] == "eval"] for recs in (got, emulated)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-5, rel=0)
