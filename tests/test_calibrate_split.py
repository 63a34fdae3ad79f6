"""Calibration measures the backward's two halves, B (input gradient) and W (weight gradient).

A zero-bubble schedule runs them apart (paci_tune/calibrate/split.py); the simulator times ZB-H1
from them. Checked here: the split computes exactly the whole backward's gradients (a weight used
twice included); on one machine in one run B + W is the whole backward plus the split's own
overhead; a half with nothing to run is exactly 0 (W of a frozen unit, B of the first unit whose
input needs no gradient); and a profile written from them says its split was measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from paci_tune.calibrate.pattern import StagePattern, pooled_costs
from paci_tune.calibrate.split import SplitBackward
from paci_tune.calibrate.units import measure_unit
from paci_tune.config.schema import OptimizerConfig
from paci_tune.model import load_model, next_token_loss
from paci_tune.sim.profile import P2PCost, Profile, UnitProfile

CPU = torch.device("cpu")
VOCAB = 64


def _units(n_layer: int, d_model: int = 32, block_size: int = 16) -> list[nn.Module]:
    model = load_model({"preset": "tiny", "n_layer": n_layer, "d_model": d_model, "block_size": block_size}, VOCAB, 0)
    return [model.units[i] for i in range(model.n_units)]


def _freeze(unit: nn.Module) -> None:
    for p in unit.parameters():
        p.requires_grad_(False)


def _grads(units: list[nn.Module], split: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every parameter's gradient and every unit input's gradient, from one micro-batch's backward,
    whole (``backward()`` per unit) or split (all B halves, then all W halves)."""
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
    for u in units:
        u.zero_grad(set_to_none=True)
    inputs, outputs, h = [], [], x
    for i, unit in enumerate(units):
        inp = h.detach().requires_grad_() if h.is_floating_point() else h
        h = unit(inp)
        if i == len(units) - 1:
            h = next_token_loss(h, y)
        inputs.append(inp if inp.is_floating_point() else None)
        outputs.append(h)
    grad, input_grads, halves = None, [], []
    for i in reversed(range(len(units))):
        if split:
            half = SplitBackward(outputs[i], inputs[i], list(units[i].parameters()), grad)
            grad = half.input_half()
            halves.append(half)
        else:
            outputs[i].backward(grad)
            grad = inputs[i].grad if inputs[i] is not None else None
        if grad is not None:
            input_grads.append(grad)
    for half in halves:
        half.weight_half()
    return [p.grad.clone() for u in units for p in u.parameters()], input_grads


def test_split_backward_computes_the_whole_backwards_gradients_exactly() -> None:
    units = _units(2)
    whole, whole_inputs = _grads(units, split=False)
    split, split_inputs = _grads(units, split=True)
    assert len(whole) == len(split) and len(whole_inputs) == len(split_inputs) == 3
    assert all(torch.equal(a, b) for a, b in zip(whole + whole_inputs, split + split_inputs, strict=True))


class _Twice(nn.Module):
    """One weight used twice, one behind the other: two junctions of one group (split.py's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_a_weight_used_twice_is_counted_once() -> None:
    torch.manual_seed(0)
    unit, x, g = _Twice(), torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    unit(x).backward(g)
    expected = [p.grad.clone() for p in unit.parameters()] + [x.grad.clone()]
    unit.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    half = SplitBackward(unit(leaf), leaf, list(unit.parameters()), g)
    dx = half.input_half()
    assert all(p.grad is None for p in unit.parameters())  # B computed no weight gradient
    half.weight_half()
    got = [p.grad for p in unit.parameters()] + [dx]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, got, strict=True))


@pytest.mark.alone
def test_b_plus_w_is_the_whole_backward_plus_the_splits_overhead() -> None:
    """Stage pattern, one process, whole and split backwards alternating micro-batch by micro-batch:
    per block (big enough for the arithmetic to dominate), B + W is at least 0.9x the whole backward --
    the halves do all of its arithmetic, so less is noise -- and at most 1.6x: the split's own cost (the
    graph walk in B, a second autograd pass per parameter group in W) measured 1.1-1.35x on a 2-core
    CPU; a split that ran the input path again in W would be ~1.7x. The fastest of 32 samples of each
    is compared: other work on the machine only ever adds time."""
    units = _units(2, d_model=128, block_size=128)
    pattern = StagePattern(
        units,
        vocab_size=VOCAB,
        n_classes=VOCAB,
        seq_len=128,
        device=CPU,
        dtype="fp32",
        window=4,
        inflight=2,
        optimizer=OptimizerConfig(lr=1e-4),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one stage's share of a 2-core machine, as calibration times it
    try:
        pattern.measure(4, repeats=8, warmup=1)
    finally:
        torch.set_num_threads(threads)
    s = pattern.samples
    for i in (1, 2):
        whole, b_half, w_half = (min(x[4][i]) for x in (s.backward, s.backward_input, s.backward_weight))
        ratio = (b_half + w_half) / whole
        print(f"block{i - 1}: whole {whole * 1e3:.2f} ms B {b_half * 1e3:.2f} W {w_half * 1e3:.2f} ratio {ratio:.2f}")
        assert 0.9 <= ratio <= 1.6
        assert b_half > w_half > 0  # attention's parameter-free work is all in B
    assert all(t == 0.0 for t in s.backward_input[4][0])  # the embedding's input is token ids: no B
    assert min(s.backward_weight[4][0]) > 0


def test_a_half_with_nothing_to_run_is_zero() -> None:
    """A frozen unit has no W; the first unit whose input needs no gradient (behind a frozen prefix) no B;
    a frozen unit with nothing trainable before it neither. Stage pattern and isolated measurement alike."""
    units = _units(3)  # embed, block0, block1, block2, head
    _freeze(units[2])  # block1, trainable units before and after it
    pattern = StagePattern(
        units,
        vocab_size=VOCAB,
        n_classes=VOCAB,
        seq_len=16,
        device=CPU,
        dtype="fp32",
        window=2,
        inflight=2,
        optimizer=OptimizerConfig(lr=1e-4),
    )
    pattern.measure(2, repeats=2, warmup=0)
    costs = pooled_costs([pattern.samples], {2: [[i] for i in range(5)]}, {2: [(1, 1)] * 5})
    split = [(c[2].backward_input_s, c[2].backward_weight_s) for c in costs]
    assert split[0][0] == 0.0 and split[0][1] > 0  # the embedding: nothing upstream
    assert split[2][0] > 0 and split[2][1] == 0.0  # frozen block1: B passes the gradient on, no W
    assert all(b > 0 and w > 0 for b, w in split[1:2] + split[3:])

    units = _units(2)
    _freeze(units[0])
    _freeze(units[1])  # a frozen prefix: block1 is the first unit that trains
    x = torch.randint(0, VOCAB, (2, 16))
    h = units[1](units[0](x)).detach()
    frozen = measure_unit(
        units[1], units[0](x).detach(), last=False, device=CPU, dtype="fp32", repeats=2, warmup=0, input_grad=False
    )
    first = measure_unit(units[2], h, last=False, device=CPU, dtype="fp32", repeats=2, warmup=0, input_grad=False)
    assert (frozen.backward_s, frozen.backward_input_s, frozen.backward_weight_s) == (0.0, 0.0, 0.0)
    assert first.backward_input_s == 0.0 and first.backward_weight_s is not None and first.backward_weight_s > 0


def test_a_measured_split_is_marked_measured_and_round_trips(tmp_path: Path) -> None:
    units = _units(1)
    x = torch.randint(0, VOCAB, (2, 16))
    cost = measure_unit(units[1], units[0](x).detach(), last=False, device=CPU, dtype="fp32", repeats=2, warmup=0)
    assert cost.split_measured and cost.backward_input_s > 0 and cost.backward_weight_s > 0
    profile = Profile(units=[UnitProfile("block0", 4, 0.0, {2: cost})], p2p=P2PCost(0.0, 1e9), seq_len=16)
    assert profile.split_measured
    profile.save(tmp_path / "p.yaml")
    again = Profile.load(tmp_path / "p.yaml")
    assert again.split_measured and again.units[0].costs[2] == cost


def test_split_bytes_of_the_first_unit_under_a_torch_that_refuses_an_empty_b(monkeypatch: pytest.MonkeyPatch):
    """torch 2.11's ``stage_backward_input`` (the H200's, 2026-12-04) refuses a B with no input to
    differentiate -- the first unit's are token ids -- where 2.13 runs it as nothing: calibrate on CUDA
    failed there. Under such a torch the first unit's B holds nothing beyond its saved tensors (0), and a
    unit with a floating input measures what it does under ours."""
    from torch.distributed.pipelining import _backward

    from paci_tune.calibrate.memory import measure_split_bytes

    units = _units(2)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden = units[0](tokens).detach()
    kw = {"last": False, "device": CPU, "dtype": "fp32"}
    ours = measure_split_bytes(units[1], hidden, **kw)
    original = _backward.stage_backward_input

    def strict(outputs, output_grads, inputs, weights):
        if not inputs:
            raise ValueError("grad requires non-empty inputs.")
        return original(outputs, output_grads, inputs, weights)

    monkeypatch.setattr(_backward, "stage_backward_input", strict)
    assert measure_split_bytes(units[0], tokens, **kw, input_grad=False) == 0
    assert measure_split_bytes(units[1], hidden, **kw) == ours != 0
