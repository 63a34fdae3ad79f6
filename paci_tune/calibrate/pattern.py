"""The stage pattern: the whole model run the way a pipeline stage runs its units, timed per unit.

Units run chained (one forward through all of them, one backward call over the chain), 1F1B with
``inflight`` micro-batches in flight, each micro-batch with its own data, the last unit's forward
including the loss scaled by 1/window as the real last stage computes it, and an optimizer step
after every ``window`` backwards -- through the real stage's aliased step
(:class:`~paci_tune.pipeline.optim.AliasedOptimizer`), one per unit so each unit's share can be
timed. In bf16 the units hold bf16 parameters with fp32 masters, as a stage does (no autocast).
Per-unit times come from timestamps between the units' forwards and, in the backward, from hooks
on the tensors at the unit boundaries. May import: :mod:`paci_tune.pipeline`,
:mod:`paci_tune.model`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`, torch.
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
from .units import sync, to_compute, unit_signature

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
class PatternSamples:
    """Seconds per unit from a :class:`StagePattern`: ``forward[b][i]`` is unit i's samples at size b."""

    forward: dict[int, list[list[float]]] = field(default_factory=dict)
    backward: dict[int, list[list[float]]] = field(default_factory=dict)
    optimizer: list[list[float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "forward": {str(b): v for b, v in self.forward.items()},
            "backward": {str(b): v for b, v in self.backward.items()},
            "optimizer": self.optimizer,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PatternSamples:
        return cls(
            {int(b): v for b, v in doc["forward"].items()},
            {int(b): v for b, v in doc["backward"].items()},
            doc["optimizer"],
        )


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
        self.optimizers = [AliasedOptimizer.from_config(ps, optimizer) if ps else None for ps in params]
        self.samples = PatternSamples(optimizer=[[] for _ in self.units])
        self._pending: deque[_Pending] = deque()
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
            per_unit = self.samples.forward.setdefault(b, [[] for _ in range(n)])
            for i, s in enumerate(times):
                per_unit[i].append(s)
        self._pending.append(_Pending(b, h, record, marks))

    def backward(self) -> None:
        """Backward of the oldest micro-batch in flight; an optimizer step when a window is complete."""
        mb = self._pending.popleft()
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
            per_unit = self.samples.backward.setdefault(mb.size, [[] for _ in range(n)])
            for i in range(n):
                per_unit[i].append(max(edges[i] - edges[i + 1], 0.0))
        self._backwards += 1
        if self._backwards % self.window == 0:
            self.step(mb.record)

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

    def microbatch(self, b: int, record: bool) -> None:
        """One 1F1B step: forward a new micro-batch; backward the oldest once ``inflight`` are in flight."""
        self.forward(b, record)
        if len(self._pending) >= self.inflight:
            self.backward()

    def drain(self) -> None:
        while self._pending:
            self.backward()

    def measure(self, b: int, *, repeats: int, warmup: int, on_batch: Callable[[], None] | None = None) -> None:
        """``warmup`` untimed then ``repeats`` timed global batches at size ``b``, drained at the end."""
        for k in range(warmup + repeats):
            for _ in range(self.window):
                self.microbatch(b, record=k >= warmup)
            if on_batch:
                on_batch()
        self.drain()


def pooled_costs(
    samples: Sequence[PatternSamples], groups: dict[int, list[list[int]]], nbytes: dict[int, list[tuple[int, int]]]
) -> list[dict[int, UnitCost]]:
    """Per unit and size: the median over every process's samples of every unit in its group.

    ``groups[b]`` partitions the unit indices into identical units; ``nbytes[b][i]`` is unit i's
    (activation bytes, saved bytes) at size b.
    """
    n = len(next(iter(nbytes.values())))
    costs: list[dict[int, UnitCost]] = [{} for _ in range(n)]
    for b, members in groups.items():
        for group in members:
            fwd = statistics.median(s for smp in samples for i in group for s in smp.forward[b][i])
            bwd = statistics.median(s for smp in samples for i in group for s in smp.backward[b][i])
            for i in group:
                costs[i][b] = UnitCost(fwd, bwd, *nbytes[b][i])
    return costs


def pooled_optimizer(samples: Sequence[PatternSamples], units: Sequence[nn.Module]) -> list[float]:
    """Per unit: the median optimizer step over every process and every unit of the same structure."""
    by_sig: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        by_sig.setdefault(unit_signature(unit), []).append(i)
    out = [0.0] * len(units)
    for members in by_sig.values():
        pooled = [s for smp in samples for i in members for s in smp.optimizer[i]]
        for i in members:
            out[i] = statistics.median(pooled) if pooled else 0.0
    return out
