"""Measuring what a unit allocates beyond what it holds: the memory model's transients, per unit.

A profile's ``saved_bytes`` and ``activation_bytes`` (:mod:`.units`) are what a micro-batch in flight
holds; the memory model (:mod:`paci_tune.sim.memory`) also needs what an action makes and frees while it
runs -- a training forward and backward's temporaries, an evaluation forward's, an optimizer step's, and
what torch's split backward keeps between ``B`` and ``W`` -- since the largest of them decides a stage's
peak (the head's logits and their softmax above all). Each is read as an allocator reads it:
:class:`Allocations` (CUDA's counters, or the CPU meter of :mod:`paci_tune.pipeline.meter`).
May import: :mod:`paci_tune.pipeline` (the meter, the stage's optimizer), :mod:`paci_tune.model`,
:mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from ..config.schema import OptimizerConfig
from ..model import next_token_loss
from ..pipeline.meter import AllocationMeter
from ..pipeline.optim import AliasedOptimizer, release_masters
from .units import _like, _training_forward, sync, unit_signature


class Allocations:
    """Bytes allocated from a starting point on: CUDA's counters, or on the CPU the runtime's meter
    (:class:`paci_tune.pipeline.meter.AllocationMeter`, which counts what is made inside it).

    ``live`` and ``peak`` are relative to what was allocated when the context was entered.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.meter = None if self.cuda else AllocationMeter()
        self._base = 0

    def __enter__(self) -> Allocations:
        if self.cuda:
            sync(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self.meter is not None
            self.meter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.meter is not None:
            self.meter.__exit__(*exc)

    @property
    def live(self) -> int:
        if self.cuda:
            sync(self.device)
            return torch.cuda.memory_allocated(self.device) - self._base
        assert self.meter is not None
        return self.meter.live

    @property
    def peak(self) -> int:
        if self.cuda:
            sync(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        assert self.meter is not None
        return self.meter.peak

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self.meter is not None
            self.meter.reset_peak()


def measure_transients(
    unit: nn.Module,
    x: torch.Tensor,
    *,
    last: bool,
    device: torch.device,
    dtype: str,
    input_grad: bool = True,
) -> tuple[int, int]:
    """``(transient_bytes, eval_bytes)`` of ``unit`` (a profile's, :mod:`paci_tune.sim.profile`).

    ``transient_bytes``: the peak allocated during a training forward and backward of ``x`` as a stage
    runs it -- the gradient from the next stage arriving, the parameters' gradients already there (so a
    backward's new weight gradient is the transient it is at a stage in steady state; in bf16 it is folded
    into an fp32 master and freed, as the stage's optimizer does) -- above what the forward leaves held
    (saved tensors and output). ``eval_bytes``: the peak of a no-grad forward of ``x`` as an evaluation
    runs it, that input included (linear in the micro-batch size: a profile takes it to the evaluation's
    size by :meth:`~paci_tune.sim.profile.UnitProfile.at`). The last unit's include its loss.
    """
    x = _like(x, unit)
    eval_x = x
    params = [p for p in unit.parameters() if p.requires_grad]
    opt = AliasedOptimizer.from_config(params, OptimizerConfig(lr=1e-4), None) if params else None
    targets = None
    with torch.no_grad():
        out = unit(x)
        if last:
            targets = torch.randint(0, out.shape[-1], out.shape[:-1], device=device)
    forward = _training_forward(unit, x, out if last else None, device, dtype, input_grad)
    grad = None if last else torch.randn_like(out)
    del out
    inp, y = forward()  # a first pass leaves the gradients a stage keeps between its backwards
    if y.requires_grad:
        y.backward(grad)
    del inp, y
    with Allocations(device) as alloc:
        inp, y = forward()
        held = alloc.live
        g = None if grad is None else grad.clone()  # the gradient a stage receives is new memory
        if y.requires_grad:
            y.backward(g)
        transient = max(alloc.peak - held, 0)
        del inp, y, g
    eval_in = eval_x.numel() * eval_x.element_size()
    with torch.no_grad(), Allocations(device) as alloc:
        out = unit(eval_x)
        if last:
            eval_targets = torch.randint(0, out.shape[-1], out.shape[:-1], device=device)
            next_token_loss(out, eval_targets)
        evaluation = alloc.peak + eval_in
        del out
    if opt is not None:
        opt.discard_grads()
        release_masters(params)
    del targets
    return transient, evaluation


def measure_step_bytes(
    unit: nn.Module, *, device: torch.device, optimizer: OptimizerConfig | None = None, hidden: bool = False
) -> int:
    """Peak bytes one optimizer step over ``unit``'s parameters allocates above the state it keeps (the
    second step: the first makes the state), on clones so the unit is untouched; 0 with nothing to train.

    Which implementation torch picks (one ``foreach`` call over every parameter of a stage, on CUDA; one
    parameter at a time, on the CPU) decides how units' figures add up at a stage
    (:func:`paci_tune.sim.memory.step_transient`)."""
    params = [p.detach().clone().requires_grad_(True) for p in unit.parameters() if p.requires_grad]
    if not params:
        return 0
    cfg = optimizer or OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt = AliasedOptimizer.from_config(params, dataclasses.replace(cfg, grad_clip=None), [hidden] * len(params))
    peak = 0
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.gradients()  # the gradients where the step reads them (folded into the fp32 masters in bf16)
        with Allocations(device) as alloc:
            opt.step()
            peak = max(alloc.peak - max(alloc.live, 0), 0)
    return peak


def measure_split_bytes(
    unit: nn.Module, x: torch.Tensor, *, last: bool, device: torch.device, dtype: str, input_grad: bool = True
) -> int:
    """How many bytes the input half ``B`` of a backward at ``unit`` adds to what its micro-batch holds
    until the weight half ``W`` (negative: frees), as torch's zero-bubble schedules split it
    (``torch.distributed.pipelining``'s ``stage_backward_input`` keeps the graph and stashes the weight
    layers' output gradients for ``W``, and frees the rest): a profile's ``split_bytes`` is the unit's
    ``saved_bytes`` plus this (:func:`paci_tune.calibrate.measure.calibrate`). Under a torch whose private
    split API differs (missing, or another signature) B is taken to hold all of it: 0."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:
        return 0
    x = _like(x, unit)
    with torch.no_grad():
        out = unit(x)
    forward = _training_forward(unit, x, out if last else None, device, dtype, input_grad)
    grad = None if last else torch.randn_like(out)
    del out
    with Allocations(device) as alloc:  # the forward inside: what B frees of it counts too
        inp, y = forward()
        if not y.requires_grad:
            return 0
        held = alloc.live
        inputs = [inp] if inp.is_floating_point() and inp.requires_grad else []
        g = None if grad is None else [grad.clone()]
        try:
            grads_in, groups = stage_backward_input([y], g, inputs, unit.parameters())
        except (AttributeError, TypeError):  # another torch's signature
            return 0
        except ValueError:  # torch before 2.13 refuses a B with nothing to differentiate: the first
            if inputs:  # unit's token ids. B computes nothing there; the whole backward is W.
                raise
            return 0
        del grads_in, g
        retained = alloc.live - held
    stage_backward_weight(unit.parameters(), groups)
    del groups, inp, y
    for p in unit.parameters():
        p.grad = None
    return retained


def step_transients(units: Sequence[nn.Module], device: torch.device, optimizer: OptimizerConfig) -> list[int]:
    """Every unit's :func:`measure_step_bytes` (identical units measured once)."""
    seen: dict[tuple[str, bool], int] = {}
    out = []
    for i, unit in enumerate(units):
        hidden = 0 < i < len(units) - 1
        key = (unit_signature(unit), hidden)
        if key not in seen:
            seen[key] = measure_step_bytes(unit, device=device, optimizer=optimizer, hidden=hidden)
        out.append(seen[key])
    return out
