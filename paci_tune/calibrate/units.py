"""Measuring one unit at a time: bytes it saves and sends, and its isolated forward/backward time.

The byte counts (output activation, autograd's saved tensors) are exact and what the memory model
needs. The *times* measured here are of a unit alone on a hot cache, which under-predicts a
pipeline stage (see :mod:`paci_tune.calibrate`); :func:`measure_units` remains for quick checks and
as the fallback when the whole model with its micro-batches in flight does not fit on a GPU.

Precision is the stage's own scheme: in bf16 a unit's parameters are converted to bf16
(:func:`to_compute`) and nothing runs under autocast, so the saved bytes are the bf16 activations
and count no weight copy; the optimizer step is the stage's (fp32 masters, written back in place),
and a weight copy (:func:`measure_copy`) clones the bf16 weights.

Frozen parameters are measured as a stage runs them: a unit's input needs a gradient only where a
unit before it trains (``input_grad``, :func:`paci_tune.model.input_grads`), so a frozen prefix saves
nothing and runs no backward, and identical units that differ in what is frozen are not pooled.
May import: :mod:`paci_tune.pipeline` (the stage's dtype and optimizer step),
:mod:`paci_tune.model`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from ..config.schema import OptimizerConfig
from ..model import LoadedModel, input_grads, next_token_loss
from ..pipeline.optim import AliasedOptimizer
from ..pipeline.precision import to_compute_dtype
from ..pipeline.stage import compute_dtype
from ..sim.profile import UnitCost, UnitProfile
from .split import SplitBackward

Log = Callable[[str], None]
T = TypeVar("T")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_compute(unit: nn.Module, device: torch.device, dtype: str) -> nn.Module:
    """``unit`` on ``device`` with its parameters in the compute dtype, as a stage holds it (in place; the
    buffers a stage keeps exact stay so, :mod:`paci_tune.pipeline.precision`)."""
    unit.to(device)
    if compute_dtype(dtype) != torch.float32:
        to_compute_dtype(unit, compute_dtype(dtype))
    return unit


def fp32_param_bytes(unit: nn.Module, *, trainable: bool = False) -> int:
    """A profile's ``param_bytes``: 4 bytes per parameter whatever the compute dtype (:mod:`paci_tune.sim.profile`).

    ``trainable=True``: its ``trainable_bytes``, the parameters with ``requires_grad`` only.
    """
    return 4 * sum(p.numel() for p in unit.parameters() if p.requires_grad or not trainable)


def _like(x: torch.Tensor, unit: nn.Module) -> torch.Tensor:
    """A floating input in the unit's parameter dtype (token ids as they are)."""
    first = next(unit.parameters(), None)
    if first is not None and x.is_floating_point() and x.dtype != first.dtype:
        return x.to(first.dtype)
    return x


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``; tensors without one count their own size."""
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def _saved_bytes(unit: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd saves during ``run()``: distinct storages, parameters' own storages excluded."""
    params = {_storage_key(p)[0] for p in unit.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in params:
            seen[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def signature(unit: nn.Module, x: torch.Tensor, input_grad: bool = True) -> str:
    """Units with equal signatures cost the same on ``x``: their forward, and their backward (``input_grad``)."""
    return f"{unit_signature(unit)}|{tuple(x.shape)}|{x.dtype}|{input_grad}"


def unit_signature(unit: nn.Module) -> str:
    """Units with equal signatures have equal optimizer steps (same class, structure, parameter shapes, frozen ones)."""
    frozen = [n for n, p in unit.named_parameters() if not p.requires_grad]
    return f"{type(unit).__module__}.{type(unit).__qualname__}|{unit!r}|frozen={frozen}"


@dataclass(frozen=True)
class Probe:
    """What one unit's forward on an input shows without timing anything."""

    activation_bytes: int
    saved_bytes: int
    output: torch.Tensor  # detached: the next unit's input


def probe(
    unit: nn.Module, x: torch.Tensor, *, last: bool, device: torch.device, dtype: str, input_grad: bool = True
) -> Probe:
    """Output activation bytes and saved bytes of ``unit`` on ``x`` (the last unit with its loss).

    ``input_grad``: whether the unit's input needs a gradient (a unit before it trains).
    """
    x = _like(x, unit)
    with torch.no_grad():
        out = unit(x)
    forward = _training_forward(unit, x, out if last else None, device, dtype, input_grad)
    return Probe(out.numel() * out.element_size(), _saved_bytes(unit, lambda: forward()[1]), out.detach())


def _training_forward(
    unit: nn.Module,
    x: torch.Tensor,
    logits: torch.Tensor | None,
    device: torch.device,
    dtype: str,
    input_grad: bool = True,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A forward of ``unit`` on ``x`` as training runs it: ``(input, output)``, the input a fresh leaf.

    With ``logits`` (the last unit) the output is the loss against random targets of their shape.
    ``input_grad``: whether ``x`` needs a gradient (as at a stage)."""
    targets = None if logits is None else torch.randint(0, logits.shape[-1], logits.shape[:-1], device=device)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        inp = _like(x, unit)
        inp = inp.detach().requires_grad_(input_grad) if inp.is_floating_point() else inp
        y = unit(inp)
        if targets is not None:
            return inp, next_token_loss(y, targets)
        return inp, y

    return forward


def measure_unit(
    unit: nn.Module,
    x: torch.Tensor,
    *,
    last: bool,
    device: torch.device,
    dtype: str,
    repeats: int,
    warmup: int = 2,
    input_grad: bool = True,
) -> UnitCost:
    """Time one unit alone, forward and backward on input ``x`` (ids for the first unit).

    Median of ``repeats`` after ``warmup`` untimed passes. This is the *isolated* cost, which
    under-predicts a pipeline stage (see :mod:`paci_tune.calibrate`); calibration uses the stage
    pattern and keeps this for quick checks and as a fallback. ``input_grad``: whether the input needs
    a gradient (a unit before it trains); a unit whose output then needs none runs no backward (0 s).
    Each pass also times the backward split into its input and weight halves (:mod:`.split`) on a
    second forward, so the two are measured beside the whole backward.
    """
    seen = probe(unit, x, last=last, device=device, dtype=dtype, input_grad=input_grad)
    grad = None if last else torch.randn_like(seen.output)
    forward = _training_forward(unit, x, seen.output if last else None, device, dtype, input_grad)
    params = [p for p in unit.parameters() if p.requires_grad]
    fwd, bwd, b_half, w_half = [], [], [], []
    for r in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        inp, out = forward()
        sync(device)
        t1 = time.perf_counter()
        if out.requires_grad:  # else nothing in or before this unit trains: no backward
            out.backward(grad)
        sync(device)
        t2 = time.perf_counter()
        inp, out = forward()
        split = SplitBackward(out, inp if inp.is_floating_point() else None, params, grad)
        b_s = timed(split.input_half, device)[0] if split.has_input_half else 0.0
        w_s = timed(split.weight_half, device)[0] if split.has_weight_half else 0.0
        if r >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1 if out.requires_grad else 0.0)
            b_half.append(b_s)
            w_half.append(w_s)
        del inp, out, split
    med = statistics.median
    return UnitCost(med(fwd), med(bwd), seen.activation_bytes, seen.saved_bytes, med(b_half), med(w_half))


def timed(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """Seconds ``fn()`` takes (the device synchronised on both sides), and what it returned."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def measure_optimizer(
    unit: nn.Module,
    *,
    device: torch.device,
    repeats: int,
    warmup: int = 2,
    optimizer: OptimizerConfig | None = None,
    hidden: bool = False,
) -> float:
    """Median seconds of one ``optimizer`` step (default AdamW) over ``unit``'s parameters alone (0 for a
    unit without any); ``hidden``: the unit lies between the model's first and last (Muon steps its matrices).

    The stage's own step (:class:`~paci_tune.pipeline.optim.AliasedOptimizer`: fp32 masters for
    bf16 parameters), on clones so the unit's weights are untouched. Isolated, hence optimistic:
    see the package docstring for the step :func:`calibrate` measures.
    """
    params = [p.detach().clone().requires_grad_(True) for p in unit.parameters() if p.requires_grad]
    if not params:
        return 0.0
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    cfg = optimizer or OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt = AliasedOptimizer.from_config(params, dataclasses.replace(cfg, grad_clip=None), [hidden] * len(params))
    times = []
    for r in range(warmup + repeats):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy(unit: nn.Module, *, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one clone of ``unit``'s weights as a stage holds them (0 for a unit without any).

    What ``pipeline.backward_weights: forward`` does at a step that keeps a version for in-flight
    backwards (:meth:`paci_tune.pipeline.versions.WeightVersions.preserve`): a clone of each distinct
    parameter storage, in the compute dtype (the fp32 masters are never copied). Timed alone, on a
    hot cache: a little optimistic, like the isolated optimizer step.
    """
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in unit.parameters() if p.requires_grad}
    if not storages:
        return 0.0
    times = []
    with torch.no_grad():
        for r in range(warmup + max(repeats, 3)):
            sync(device)
            t0 = time.perf_counter()
            copies = [s.clone() for s in storages.values()]
            sync(device)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
            del copies
    return statistics.median(times)


def measure_copies(units: Sequence[nn.Module], *, device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    """:func:`measure_copy` of every unit, once per distinct unit (identical units pool, as the costs do)."""
    seen: dict[str, float] = {}
    out = []
    for unit in units:
        sig = unit_signature(unit)
        if sig not in seen:
            seen[sig] = measure_copy(unit, device=device, repeats=repeats, warmup=warmup)
        out.append(seen[sig])
    return out


def measure_units(
    model: LoadedModel,
    vocab_size: int,
    microbatch_sizes: Sequence[int],
    *,
    device: torch.device,
    dtype: str,
    repeats: int,
    warmup: int = 2,
    log: Log | None = None,
    optimizer: OptimizerConfig | None = None,
) -> list[UnitProfile]:
    """Profile every unit of ``model`` *in isolation* at each micro-batch size (identical units once);
    ``optimizer``: whose step to time (default AdamW).

    The isolated measurement (see :func:`measure_unit`); :func:`calibrate` measures the stage
    pattern instead and uses this only where that does not fit on the device.
    """
    units = [to_compute(model.units[i], device, dtype) for i in range(model.n_units)]
    needs_grad = input_grads(model.trainable)
    seq = model.block_size
    costs: list[dict[int, UnitCost]] = [{} for _ in units]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for b in microbatch_sizes:
        x = torch.randint(0, vocab_size, (b, seq), generator=gen).to(device)
        measured: dict[str, UnitCost] = {}
        for i, unit in enumerate(units):
            sig = signature(unit, x, needs_grad[i])
            if sig not in measured:
                if log:
                    log(f"unit {i} ({model.names[i]}), micro-batch {b}")
                measured[sig] = measure_unit(
                    unit,
                    x,
                    last=i == len(units) - 1,
                    device=device,
                    dtype=dtype,
                    repeats=repeats,
                    warmup=warmup,
                    input_grad=needs_grad[i],
                )
            costs[i][b] = measured[sig]
            if i < len(units) - 1:
                with torch.no_grad():
                    x = unit(_like(x, unit))
    out: list[UnitProfile] = []
    opt_seen: dict[tuple[str, bool], float] = {}
    copy_s = measure_copies(units, device=device, repeats=repeats, warmup=warmup)
    for i, unit in enumerate(units):
        param_bytes = fp32_param_bytes(unit)
        hidden = 0 < i < len(units) - 1
        sig = (unit_signature(unit), hidden)
        if sig not in opt_seen:
            opt_seen[sig] = measure_optimizer(
                unit, device=device, repeats=repeats, warmup=warmup, optimizer=optimizer, hidden=hidden
            )
        out.append(
            UnitProfile(
                model.names[i],
                param_bytes,
                opt_seen[sig],
                costs[i],
                copy_s=copy_s[i],
                trainable_bytes=fp32_param_bytes(unit, trainable=True),
            )
        )
    for unit in units:
        unit.zero_grad(set_to_none=True)
    return out
