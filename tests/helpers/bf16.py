"""The bf16 oracles shared by tests/test_bf16.py (on the CPU) and tests/test_gpu.py (the same checks on
CUDA): a bf16 stage of wide GPT blocks, the weight copies and bytes it holds, plain bf16 training
written from scratch, and the bf16/fp32 precision gap. The module docstring of test_bf16 says what
each oracle sees.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helpers.cli import run_in_process, summary_of, train_losses
from helpers.configs import make_config
from helpers.memory_probe import SavedTensors, allocated_cpu, allocated_cuda
from helpers.oracles import oracle_lr, paci_order
from paci_tune.calibrate.measure import torch_threads as torch_threads  # re-exported: the package's one copy
from paci_tune.config import OptimizerConfig
from paci_tune.data import MicroBatchStream, ValidationSet, load_source
from paci_tune.model import GPTConfig, build_units, load_model
from paci_tune.pipeline.stage import Stage

CPU = torch.device("cpu")
BF16 = torch.bfloat16
# Wide and short: a block's bf16 weights (~400 KB) dwarf one micro-batch's activations (~65 KB), so
# a weight copy per micro-batch in flight cannot hide in the activations' share.
WIDE = GPTConfig(n_layer=2, n_head=2, d_model=128, block_size=8, vocab_size=32)


def bf16_stage(
    index: int,
    stages: int,
    units: list[nn.Module],
    *,
    device: torch.device = CPU,
    dtype: torch.dtype = BF16,
    window: int = 1,
    lr: float = 1e-2,
    **opt: Any,
) -> Stage:
    cfg = OptimizerConfig(lr=lr, **opt)
    return Stage(index, stages, units, window=window, optimizer=cfg, lr_at=lambda k: lr, device=device, dtype=dtype)


def weight_copies(saved: list[torch.Tensor], params: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """Shapes of the weights of which a saved tensor is a copy (in any dtype, maybe transposed), not the
    weight's own storage."""
    own = {p.untyped_storage().data_ptr() for p in params}
    out = []
    for t in saved:
        if t.untyped_storage().data_ptr() in own:
            continue
        for view, p in itertools.product([t, t.mT] if t.dim() == 2 else [t], params):
            if view.shape == p.shape and torch.equal(view.float(), p.detach().to(t.dtype).float()):
                out.append(tuple(p.shape))
    return out


def check_saves_weights_by_reference(device: torch.device) -> None:
    """A middle and a last stage of GPT blocks in bf16: autograd keeps the live bf16 weights, never a copy."""
    for index, indices in ((1, [1, 2]), (2, [1, 2, 3])):
        stage = bf16_stage(index, 3, list(build_units(WIDE, 0, indices=indices).values()), device=device)
        assert all(p.dtype == BF16 for p in stage.params)
        x = torch.randn(2, WIDE.block_size, WIDE.d_model, device=device)
        y = torch.randint(0, WIDE.vocab_size, (2, WIDE.block_size), device=device)
        ptrs = [p.data_ptr() for p in stage.params]
        for mb in range(2):  # twice: the second micro-batch saves the same storages again
            with SavedTensors() as rec:
                out = stage.forward(mb, x, y if stage.is_last else None)
            for p in stage.params:
                assert p.untyped_storage().data_ptr() in rec.storages(), (
                    f"{tuple(p.shape)} weight not saved by reference"
                )
            assert weight_copies(rec.saved, stage.params) == [], "autograd saved a copy of a weight"
        for mb in range(2):
            stage.backward(mb, None if stage.is_last else torch.randn_like(out))
        stage.step()
        assert [p.data_ptr() for p in stage.params] == ptrs, "step() moved a parameter to new storage"
        assert all(a.data_ptr() == p.data_ptr() for a, p in zip(stage.optim.aliases, stage.params, strict=True))
        for p, m in zip(stage.params, stage.optim.masters, strict=True):
            assert m.dtype == torch.float32 and m.data_ptr() != p.data_ptr()
            assert torch.equal(p.detach(), m.to(BF16)), "the bf16 weight is not its master rounded"


def inflight_memory(k: int, device: torch.device, dtype: torch.dtype, autocast: bool = False) -> dict[str, int]:
    """A middle stage (s = 1 of P = 5, so P - s = 4) run with at most ``k`` micro-batches in flight.

    ``held``: bytes allocated by the first ``k`` forwards (what ``k`` in flight hold); ``peak``:
    the most allocated at any point of 8 micro-batches and 2 optimizer steps, after a warm-up run
    of the same (optimizer state and gradient buffers exist before measuring, as mid-run).
    """
    stage = bf16_stage(
        1, 5, list(build_units(WIDE, 0, indices=[1, 2]).values()), device=device, dtype=dtype, window=4, lr=1e-3
    )
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen).to(device, dtype) for _ in range(8)]
    gs = [torch.randn(1, WIDE.block_size, WIDE.d_model, generator=gen).to(device, dtype) for _ in range(8)]
    cast = (lambda: torch.autocast(device.type, dtype=BF16)) if autocast else contextlib.nullcontext

    def run(ops: list[tuple[str, int]], base: int) -> None:
        for op, j in ops:
            if op == "F":
                with cast():
                    stage.forward(base + j, xs[j])
            elif op == "B":
                stage.backward(base + j, gs[j])
            else:
                stage.step()

    ops = paci_order(k, 4, 8)  # a step every 4 backwards
    run(ops, 0)
    meter = allocated_cuda if device.type == "cuda" else allocated_cpu
    held, peak_a = meter(lambda: run(ops[:k], 100))
    net_b, peak_b = meter(lambda: run(ops[k:], 100))
    assert stage.inflight == 0 and stage.updates == 4
    return {"held": held, "peak": max(peak_a, held + peak_b), "net": held + net_b}


def activation_bytes(device: torch.device) -> int:
    """What one micro-batch pins at the stage, from saved-tensor hooks: saved storages that are not
    parameters, plus its output (the backward's root). On CUDA each storage is counted as the caching
    allocator hands it out, rounded up to its 512-byte blocks."""
    stage = bf16_stage(1, 5, list(build_units(WIDE, 0, indices=[1, 2]).values()), device=device)
    params = {p.untyped_storage().data_ptr() for p in stage.params}
    x = torch.randn(1, WIDE.block_size, WIDE.d_model, device=device, dtype=BF16)
    with SavedTensors() as rec:
        out = stage.forward(0, x)
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in rec.saved}
    sizes[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    block = 512 if device.type == "cuda" else 1
    return sum(-(-n // block) * block for ptr, n in sizes.items() if ptr not in params)


def check_memory_does_not_grow_beyond_activations(device: torch.device) -> dict[str, Any]:
    """In bf16, P - s = 4 in flight against 1: held and peak bytes grow by 3 micro-batches' activations
    at most (no slack: the allocator's record is exact). Control: the old scheme grows by at least a
    bf16 copy of the weights per extra micro-batch in flight."""
    k = 4
    act = activation_bytes(device)
    weights_bf16 = 2 * sum(p.numel() for u in build_units(WIDE, 0, indices=[1, 2]).values() for p in u.parameters())
    assert act < weights_bf16 / 4, "the test model must make a weight copy stand out against activations"
    new = {n: inflight_memory(n, device, BF16) for n in (1, k)}
    assert 0 < new[1]["held"] <= act
    assert new[k]["held"] - new[1]["held"] <= (k - 1) * act
    assert new[k]["peak"] - new[1]["peak"] <= (k - 1) * act
    if device.type == "cpu":  # (a CUDA library may keep a workspace it allocated on first use)
        assert new[1]["net"] == new[k]["net"] == 0, "a drained stage keeps nothing new"
    old = {n: inflight_memory(n, device, torch.float32, autocast=True) for n in (1, k)}
    assert old[k]["held"] - old[1]["held"] >= (k - 1) * weights_bf16
    return {"activation_bytes": act, "bf16_weight_bytes": weights_bf16, "bf16": new, "fp32_autocast": old}


def plain_bf16_training(doc: dict[str, Any], device: str = "cpu") -> tuple[list[float], float]:
    """Single-process mixed precision: per-batch losses and the final val loss (module docstring)."""
    t, opt_doc, a = doc["training"], doc["optimizer"], doc["pipeline"]["window"]
    source = load_source(doc["data"], None)
    loaded = load_model(doc["model"], source.vocab_size, t["seed"])
    net = nn.Sequential(*(loaded.units[i] for i in range(loaded.n_units))).to(device=device, dtype=BF16)
    params = [p for p in net.parameters() if p.requires_grad]  # frozen ones are computed with, never stepped
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(
        [
            {"params": [m for m in masters if m.dim() >= 2], "weight_decay": opt_doc["weight_decay"]},
            {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0},
        ],
        lr=opt_doc["lr"],
        betas=tuple(opt_doc["betas"]),
        eps=opt_doc["eps"],
    )

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x.to(device)).float().flatten(0, -2), y.to(device).flatten())

    stream = MicroBatchStream(source.train, loaded.block_size, t["global_batch"] // a, t["seed"])
    losses = []
    for k in range(t["steps"]):
        sums = [torch.zeros_like(m) for m in masters]
        total = 0.0
        for j in range(k * a, k * a + a):
            loss = loss_of(*stream.get(j))
            (loss / a).backward()
            total += loss.item()
            for s, p in zip(sums, params, strict=True):
                s += p.grad.float()
                p.grad = None
        for m, s in zip(masters, sums, strict=True):
            m.grad = s
        for g in opt.param_groups:
            g["lr"] = oracle_lr(doc, k)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
        losses.append(total / a)
    val = ValidationSet(source.val, loaded.block_size, t["eval_sequences"], 32)
    with torch.no_grad():
        val_loss = val.mean_loss([loss_of(x, y).item() for x, y in val])
    return losses, val_loss


GAP_STEPS = 50
GAP_TOL = 0.01
"""Largest |bf16 - fp32| train loss allowed over 50 steps of the tiny GPT (nats). Measured 0.0015 at
most (0.0004 on average) for PACI P=2, a=4 on this CPU: bf16 rounds weights and activations to
8 significant bits (relative 2^-9), and with fp32 masters and fp32 gradient sums those errors do not
compound across steps. 0.01 leaves a factor ~6 and is 150x below the ~1.5 nats the loss falls over
the run."""


def bf16_fp32_gap(schedule: str, device: str = "cpu") -> tuple[list[float], list[float], dict, dict]:
    runs = {}
    for precision in ("fp32", "bf16"):
        doc = make_config(
            training={"steps": GAP_STEPS},
            pipeline={"schedule": schedule, "stages": 2, "window": 4, "precision": precision, "device": device},
        )
        runs[precision] = run_in_process(doc)
    fp32, bf16 = train_losses(runs["fp32"]), train_losses(runs["bf16"])
    return fp32, bf16, summary_of(runs["fp32"]), summary_of(runs["bf16"])
