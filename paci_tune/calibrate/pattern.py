"""The stage pattern: the whole model run the way a pipeline stage runs its units, timed per unit.

Units run chained (one forward through all of them, one backward call over the chain), 1F1B with
``inflight`` micro-batches in flight, each micro-batch with its own data, the last unit's forward
including the loss scaled by 1/window as the real last stage computes it, and an optimizer step
after every ``window`` backwards -- through the real stage's aliased step
(:class:`~paci_tune.pipeline.optim.AliasedOptimizer`), one per unit so each unit's share can be
timed. In bf16 the units hold bf16 parameters with fp32 masters, as a stage does (no autocast).
Per-unit times come from timestamps between the units' forwards and, in the backward, from hooks
on the tensors at the unit boundaries.

**The backward's two halves** (``B``, the input gradient, and ``W``, the weight gradient: what a
zero-bubble schedule runs apart, :mod:`.split`) are timed in the same run: every measured
micro-batch with a whole backward is followed by one whose backward is *split*, each unit's input a
leaf of its own, the backward run unit by unit as all the ``B`` halves (last unit first), then all
the ``W`` halves. The two kinds alternate micro-batch by micro-batch in one 1F1B stream (the
optimizer stepping every ``window`` backwards of either kind), so both are timed on the same
machine state; ``backward_s`` stays the whole backward's time, what every other schedule runs.
May import: :mod:`paci_tune.pipeline`, :mod:`paci_tune.model`, :mod:`paci_tune.sim`,
:mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config.schema import OptimizerConfig
from ..model import LoadedModel, next_token_loss
from ..pipeline.optim import AliasedOptimizer
from ..sim.profile import UnitCost
from .split import SplitBackward
from .units import sync, timed, to_compute, unit_signature

DATA_POOL = 4
"""Distinct micro-batches of data per size, cycled, so micro-batches in flight differ."""


@dataclass
class _Pending:
    """A micro-batch between its forward and its backward in the stage pattern."""

    size: int
    loss: torch.Tensor
    record: bool
    marks: list[float | None]  # when the gradient of unit i's output was complete (set by hooks)


@dataclass
class _SplitPending:
    """A micro-batch in flight whose backward will run split: each unit's input and output kept apart."""

    size: int
    record: bool
    inputs: list[torch.Tensor | None]  # unit i's input as a leaf; None where it needs no gradient (token ids)
    outputs: list[torch.Tensor]  # unit i's output; the last unit's is its loss


_SERIES = ("forward", "backward", "backward_input", "backward_weight")


@dataclass
class PatternSamples:
    """Seconds per unit from a :class:`StagePattern`: ``forward[b][i]`` is unit i's samples at size b.

    ``backward_input`` / ``backward_weight``: the two halves of a split backward (module docstring),
    empty when the pattern ran without split batches.
    """

    forward: dict[int, list[list[float]]] = field(default_factory=dict)
    backward: dict[int, list[list[float]]] = field(default_factory=dict)
    optimizer: list[list[float]] = field(default_factory=list)
    backward_input: dict[int, list[list[float]]] = field(default_factory=dict)
    backward_weight: dict[int, list[list[float]]] = field(default_factory=dict)

    def add(self, series: str, b: int, times: Sequence[float]) -> None:
        """One sample per unit of ``series`` (``forward``, ``backward``, ``backward_input`` ...) at size ``b``."""
        per_unit = getattr(self, series).setdefault(b, [[] for _ in times])
        for i, s in enumerate(times):
            per_unit[i].append(s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: {str(b): v for b, v in getattr(self, name).items()} for name in _SERIES}
        out["optimizer"] = self.optimizer
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PatternSamples:
        series = {name: {int(b): v for b, v in doc.get(name, {}).items()} for name in _SERIES}
        return cls(optimizer=doc["optimizer"], **series)


class StagePattern:
    """The whole model run the way a pipeline stage runs its units (module docstring).

    ``microbatch(b)`` is one 1F1B step: a forward of a new micro-batch, then, once ``inflight``
    are in flight, the backward of the oldest, and after every ``window`` backwards an optimizer
    step. Passes started with ``record=True`` add their per-unit times to :attr:`samples`.
    Weights change as training would change them (the stage's own aliased step), so run it on a
    model you can throw away.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        *,
        vocab_size: int,
        n_classes: int,
        seq_len: int,
        device: torch.device,
        dtype: str,
        window: int,
        inflight: int,
        optimizer: OptimizerConfig,
        seed: int = 0,
    ) -> None:
        self.units = [to_compute(u, device, dtype) for u in units]
        self.vocab_size, self.n_classes, self.seq_len = vocab_size, n_classes, seq_len
        self.device, self.dtype = device, dtype
        self.window, self.inflight = max(window, 1), max(inflight, 1)
        params = [[p for p in u.parameters() if p.requires_grad] for u in self.units]
        self._params = params
        last = len(self.units) - 1  # Muon takes the matrices of the units between the first and the last
        self.optimizers = [
            AliasedOptimizer.from_config(ps, optimizer, [0 < i < last] * len(ps)) if ps else None
            for i, ps in enumerate(params)
        ]
        self.samples = PatternSamples(optimizer=[[] for _ in self.units])
        self._pending: deque[_Pending | _SplitPending] = deque()
        self._backwards = 0
        self._data: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._turn = 0
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    @classmethod
    def from_spec(cls, model: LoadedModel, spec: dict[str, Any], *, device: torch.device, seed: int) -> StagePattern:
        """The pattern over all of ``model``'s units, set up as a measurement's ``spec`` says.

        ``spec`` is what :func:`paci_tune.calibrate.measure` writes (JSON types: a co-run child reads
        it back from a file); ``seed`` seeds the pattern's data.
        """
        opt = spec["optimizer"]
        return cls(
            [model.units[i] for i in range(model.n_units)],
            vocab_size=spec["vocab_size"],
            n_classes=spec["n_classes"],
            seq_len=model.block_size,
            device=device,
            dtype=spec["dtype"],
            window=spec["window"],
            inflight=spec["inflight"],
            optimizer=OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])}),
            seed=seed,
        )

    def _batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b not in self._data:
            shape = (b, self.seq_len)
            self._data[b] = [
                (
                    torch.randint(0, self.vocab_size, shape, generator=self._gen).to(self.device),
                    torch.randint(0, self.n_classes, shape, generator=self._gen).to(self.device),
                )
                for _ in range(DATA_POOL)
            ]
        self._turn += 1
        return self._data[b][self._turn % DATA_POOL]

    def _mark(self, marks: list[float | None], i: int) -> Callable[[torch.Tensor], None]:
        device = self.device

        def hook(grad: torch.Tensor) -> None:
            sync(device)
            marks[i] = time.perf_counter()

        return hook

    def forward(self, b: int, record: bool) -> None:
        """Forward a new micro-batch of size ``b`` through every unit; it is then in flight."""
        x, y = self._batch(b)
        n = len(self.units)
        times = [0.0] * n
        marks: list[float | None] = [None] * (n - 1)
        h = x
        sync(self.device)
        t = time.perf_counter()
        for i, unit in enumerate(self.units):
            h = unit(h)
            if i == n - 1:
                h = next_token_loss(h, y) / self.window
            elif h.requires_grad:
                h.register_hook(self._mark(marks, i))
            sync(self.device)
            now = time.perf_counter()
            times[i], t = now - t, now
        if record:
            self.samples.add("forward", b, times)
        self._pending.append(_Pending(b, h, record, marks))

    def forward_split(self, b: int, record: bool) -> None:
        """Forward a new micro-batch whose backward will run split: each unit's input a leaf of its own."""
        x, y = self._batch(b)
        n = len(self.units)
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []
        h = x
        for i, unit in enumerate(self.units):
            inp = h.detach().requires_grad_(h.requires_grad) if h.is_floating_point() else h
            h = unit(inp)
            if i == n - 1:
                h = next_token_loss(h, y) / self.window
            inputs.append(inp if inp.requires_grad else None)
            outputs.append(h)
        self._pending.append(_SplitPending(b, record, inputs, outputs))

    def backward(self) -> None:
        """Backward of the oldest micro-batch in flight; an optimizer step when a window is complete."""
        mb = self._pending.popleft()
        if isinstance(mb, _SplitPending):
            self._backward_split(mb)
        else:
            self._backward_whole(mb)
        self._backwards += 1
        if self._backwards % self.window == 0:
            self.step(mb.record)

    def _backward_whole(self, mb: _Pending) -> None:
        """One backward call over the chain, timed per unit by the hooks at the unit boundaries."""
        n = len(self.units)
        sync(self.device)
        t0 = time.perf_counter()
        mb.loss.backward()
        sync(self.device)
        t_end = time.perf_counter()
        # edges[k]: when unit k's backward ended (= unit k-1's began); edges[n] is the start.
        edges: list[float] = [t_end] + [0.0] * n
        edges[n] = t0
        for k in range(n - 1, 0, -1):
            mark = mb.marks[k - 1]
            # No mark: no gradient reached unit k-1's output (nothing before unit k trains), so unit k's
            # backward ran to the end of the call and the units before it ran none.
            edges[k] = mark if mark is not None else t_end
        if mb.record:
            self.samples.add("backward", mb.size, [max(edges[i] - edges[i + 1], 0.0) for i in range(n)])

    def _backward_split(self, mb: _SplitPending) -> None:
        """Every unit's ``B`` (last unit first, each passing its input gradient on), then every ``W``.

        A half with nothing to run is 0 s, not timed: ``B`` of a unit whose input needs no gradient,
        ``W`` of a unit with nothing to train.
        """
        n = len(self.units)
        halves: list[SplitBackward] = []
        b_times, w_times = [0.0] * n, [0.0] * n
        grad: torch.Tensor | None = None
        for i in range(n - 1, -1, -1):
            half = SplitBackward(mb.outputs[i], mb.inputs[i], self._params[i], grad)
            halves.append(half)
            if half.has_input_half:
                b_times[i], grad = timed(half.input_half, self.device)
            else:
                grad = None
        for i, half in zip(range(n - 1, -1, -1), halves, strict=True):
            if half.has_weight_half:
                w_times[i], _ = timed(half.weight_half, self.device)
        if mb.record:
            self.samples.add("backward_input", mb.size, b_times)
            self.samples.add("backward_weight", mb.size, w_times)

    def step(self, record: bool) -> None:
        """One optimizer step per unit, in order, with the stage's own step (clipping included when configured)."""
        sync(self.device)
        t = time.perf_counter()
        for i, opt in enumerate(self.optimizers):
            if opt is not None:
                opt.step()
            sync(self.device)
            now = time.perf_counter()
            if record:
                self.samples.optimizer[i].append(now - t)
            t = now

    def microbatch(self, b: int, record: bool, split: bool = False) -> None:
        """One 1F1B step: forward a new micro-batch (its backward ``split`` into B and W, or whole);
        backward the oldest once ``inflight`` are in flight."""
        if split:
            self.forward_split(b, record)
        else:
            self.forward(b, record)
        if len(self._pending) >= self.inflight:
            self.backward()

    def drain(self) -> None:
        while self._pending:
            self.backward()

    def measure(
        self, b: int, *, repeats: int, warmup: int, on_batch: Callable[[], None] | None = None, split: bool = True
    ) -> None:
        """``warmup`` untimed then ``repeats`` timed global batches at size ``b``, drained at the end.

        ``split``: each micro-batch with a whole backward is followed by one with a split backward
        (module docstring), so both are timed as often, side by side.
        """
        for k in range(warmup + repeats):
            for _ in range(self.window):
                self.microbatch(b, record=k >= warmup)
                if split:
                    self.microbatch(b, record=k >= warmup, split=True)
            if on_batch:
                on_batch()
        self.drain()


def pooled_costs(
    samples: Sequence[PatternSamples], groups: dict[int, list[list[int]]], nbytes: dict[int, list[tuple[int, int]]]
) -> list[dict[int, UnitCost]]:
    """Per unit and size: the median over every process's samples of every unit in its group.

    ``groups[b]`` partitions the unit indices into identical units; ``nbytes[b][i]`` is unit i's
    (activation bytes, saved bytes) at size b. The backward's split is there when the pattern ran
    split batches at that size, else None.
    """
    n = len(next(iter(nbytes.values())))
    costs: list[dict[int, UnitCost]] = [{} for _ in range(n)]

    def median(series: str, b: int, group: list[int]) -> float | None:
        pooled = [s for smp in samples for i in group for s in getattr(smp, series).get(b, [[]] * n)[i]]
        return statistics.median(pooled) if pooled else None

    for b, members in groups.items():
        for group in members:
            fwd, bwd = median("forward", b, group), median("backward", b, group)
            assert fwd is not None and bwd is not None, f"no samples at micro-batch size {b}"
            b_half, w_half = median("backward_input", b, group), median("backward_weight", b, group)
            if b_half is None or w_half is None:
                b_half = w_half = None
            for i in group:
                costs[i][b] = UnitCost(fwd, bwd, *nbytes[b][i], b_half, w_half)
    return costs


def pooled_optimizer(samples: Sequence[PatternSamples], units: Sequence[nn.Module]) -> list[float]:
    """Per unit: the median optimizer step over every process and every unit of the same structure."""
    by_sig: dict[tuple[str, bool], list[int]] = {}
    for i, unit in enumerate(units):  # the first and last unit step otherwise under Muon: never pooled with a block
        by_sig.setdefault((unit_signature(unit), 0 < i < len(units) - 1), []).append(i)
    out = [0.0] * len(units)
    for members in by_sig.values():
        pooled = [s for smp in samples for i in members for s in smp.optimizer[i]]
        for i in members:
            out[i] = statistics.median(pooled) if pooled else 0.0
    return out
