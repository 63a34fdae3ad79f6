"""One pipeline stage: no weight copy, PACI's backward against the current weights, drift, windows.

Oracles: storage pointers seen by autograd's saved-tensor hooks, closed-form gradients of a
linear layer, and plain torch optimizers stepping a deep copy of the same module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.memory_probe import SavedTensors
from torch import nn

from paci_tune.config import OptimizerConfig
from paci_tune.model import GPTConfig, build_units
from paci_tune.pipeline.stage import Stage

CPU = torch.device("cpu")
SMALL = GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=32)


def make_stage(index: int, stages: int, units: list[nn.Module], window: int = 1, lr_at=None, **opt) -> Stage:
    cfg = OptimizerConfig(**opt)
    return Stage(index, stages, units, window=window, optimizer=cfg, lr_at=lr_at or (lambda k: cfg.lr), device=CPU)


# ----------------------------------------------------------------------------- no second copy


@pytest.mark.parametrize("index", [1, 2])
def test_forward_saves_weights_by_reference_and_step_keeps_storage(index: int):
    """A middle (or last) stage of real GPT blocks: autograd keeps the live weights, never a copy."""
    units = build_units(SMALL, seed=0, indices=[1, 2, 3] if index == 2 else [1, 2])
    stage = make_stage(index, 3, list(units.values()), window=1, lr_at=lambda k: 1e-2)
    x = torch.randn(2, SMALL.block_size, SMALL.d_model)
    y = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    ptrs = {id(p): p.data_ptr() for p in stage.params}
    before = [p.detach().clone() for p in stage.params]

    with SavedTensors() as rec:
        out = stage.forward(0, x, y if stage.is_last else None)
    saved = rec.storages()
    for p in stage.params:  # every weight is needed for the input gradient, so autograd saves it: by reference
        assert p.untyped_storage().data_ptr() in saved, f"a {tuple(p.shape)} weight was not saved by reference"
    param_storages = {p.untyped_storage().data_ptr() for p in stage.params}
    for t in rec.saved:
        if t.untyped_storage().data_ptr() in param_storages:
            continue
        for p in stage.params:
            clone = t.shape == p.shape and t.dtype == p.dtype and torch.equal(t, p.detach())
            assert not clone, f"autograd saved a copy of a {tuple(p.shape)} weight"

    grad = None if stage.is_last else torch.randn_like(out)
    stage.backward(0, grad)
    stage.step()
    assert {id(p): p.data_ptr() for p in stage.params} == ptrs, "step() moved a parameter to new storage"
    assert all(a.data_ptr() == p.data_ptr() for a, p in zip(stage.optim.aliases, stage.params, strict=True))
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, stage.params, strict=True)), "no update"


# --------------------------------------------------------------------------- PACI semantics


def test_backward_after_a_step_uses_the_new_weights():
    """Middle stage, one Linear: F0, F1, B0, STEP, B1. mb1's input grad must be g1 @ W_new."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3, bias=False)
    lr = 0.1
    stage = make_stage(1, 3, [lin], window=1, lr_at=lambda k: lr, name="sgd", momentum=0.0, weight_decay=0.0)
    x0, x1 = torch.randn(4, 5), torch.randn(4, 5)
    g0, g1 = torch.randn(4, 3), torch.randn(4, 3)
    w_old = lin.weight.detach().clone()

    out0 = stage.forward(0, x0)
    out1 = stage.forward(1, x1)
    torch.testing.assert_close(out0, x0 @ w_old.T)
    torch.testing.assert_close(out1, x1 @ w_old.T)
    gin0 = stage.backward(0, g0)
    torch.testing.assert_close(gin0, g0 @ w_old)
    assert stage.drift.maximum == 0 and stage.drift.count == 1  # mb0 crossed no update
    stage.step()
    w_new = w_old - lr * (g0.T @ x0)  # SGD on dL/dW = g0^T x0, computed by hand
    torch.testing.assert_close(lin.weight.detach(), w_new)

    gin1 = stage.backward(1, g1)  # no "modified by an inplace operation" error
    torch.testing.assert_close(gin1, g1 @ w_new)
    assert not torch.allclose(gin1, g1 @ w_old, atol=1e-4), "backward used the stale weights"
    # the weight gradient uses the activation saved at forward time
    torch.testing.assert_close(lin.weight.grad, g1.T @ x1)
    # drift: mb1 crossed exactly one update, mb0 none
    assert stage.drift.histogram == {0: 1, 1: 1}
    assert stage.drift.maximum == 1 and stage.drift.mean == pytest.approx(0.5)
    assert stage.updates == 1 and stage.backwards == 2


def test_checkpoint_refused_with_microbatches_in_flight():
    stage = make_stage(1, 2, [nn.Linear(3, 3)], window=1)
    stage.forward(0, torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="in flight"):
        stage.state_dict()


# ------------------------------------------------------------------ windows against torch


def _tiny_lm(vocab: int = 11, d: int = 6) -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, vocab)]


@pytest.mark.parametrize("grad_clip", [None, 0.05])
def test_window_step_equals_torch_adamw_on_a_copy(grad_clip):
    """Single stage (first and last): a window of 3 micro-batches, two steps, vs plain torch."""
    vocab, window = 11, 3
    units = _tiny_lm(vocab)
    oracle = copy.deepcopy(nn.Sequential(*units))
    lrs = [3e-2, 1e-2]
    opt_cfg = dict(name="adamw", lr=1.0, betas=(0.8, 0.9), weight_decay=0.3, eps=1e-7, grad_clip=grad_clip)
    stage = make_stage(0, 1, units, window=window, lr_at=lambda k: lrs[k], **opt_cfg)

    params = list(oracle.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.3},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1.0,
        betas=(0.8, 0.9),
        eps=1e-7,
    )
    gen = torch.Generator().manual_seed(5)
    for k in range(2):
        batch = [(torch.randint(0, vocab, (2, 4), generator=gen), torch.randint(0, vocab, (2, 4), generator=gen))]
        batch += [(torch.randint(0, vocab, (2, 4), generator=gen), torch.randint(0, vocab, (2, 4), generator=gen))]
        batch += [(torch.randint(0, vocab, (2, 4), generator=gen), torch.randint(0, vocab, (2, 4), generator=gen))]
        # the stage: forwards, then backwards, then one step
        losses = [stage.forward(10 * k + j, x, y) for j, (x, y) in enumerate(batch)]
        for j in range(window):
            assert stage.backward(10 * k + j) is None  # the first stage has no input gradient
        stage.step()
        # plain gradient accumulation: the mean of the window's losses
        for j, (x, y) in enumerate(batch):
            loss = F.cross_entropy(oracle(x).flatten(0, -2), y.flatten())
            torch.testing.assert_close(losses[j], loss.detach())  # the stage reports the unscaled loss
            (loss / window).backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        for g in opt.param_groups:
            g["lr"] = lrs[k]
        opt.step()
        opt.zero_grad(set_to_none=True)
        for p, q in zip(stage.params, params, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for p in stage.params), "gradients must not leak into the next window"
    assert stage.updates == 2


def test_last_stage_scales_loss_by_window_and_middle_stage_does_not():
    """Two stages of one Linear each, window 2: weight grads equal d(mean loss)/dW, by hand."""
    torch.manual_seed(2)
    a_lin, b_lin = nn.Linear(4, 4, bias=False), nn.Linear(4, 3, bias=False)
    wa, wb = a_lin.weight.detach().clone().requires_grad_(), b_lin.weight.detach().clone().requires_grad_()
    s0 = make_stage(0, 2, [a_lin], window=2, name="sgd", momentum=0.0, weight_decay=0.0)
    s1 = make_stage(1, 2, [b_lin], window=2, name="sgd", momentum=0.0, weight_decay=0.0)
    xs = [torch.randn(5, 4), torch.randn(5, 4)]
    ys = [torch.randint(0, 3, (5,)), torch.randint(0, 3, (5,))]
    for j in range(2):
        h = s0.forward(j, xs[j])
        s1.forward(j, h, ys[j])
    for j in range(2):
        g = s1.backward(j)
        s0.backward(j, g)
    mean = sum(F.cross_entropy(x @ wa.T @ wb.T, y) for x, y in zip(xs, ys, strict=True)) / 2
    mean.backward()
    torch.testing.assert_close(b_lin.weight.grad, wb.grad)
    torch.testing.assert_close(a_lin.weight.grad, wa.grad)
