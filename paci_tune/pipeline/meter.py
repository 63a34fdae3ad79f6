"""A stage's peak of allocated tensor bytes on the CPU, as ``torch.cuda.max_memory_allocated`` is on a GPU.

The memory model (:mod:`paci_tune.sim.memory`) predicts tensor bytes: weights, masters, gradients,
optimizer state, in-flight activations, weight copies and the temporaries of the action in progress.
On a GPU the caching allocator counts exactly those (``max_memory_allocated``). A CPU has no such
counter, and the process's peak resident set counts the interpreter and ~300 MB of libraries, so it
cannot check the model. :class:`AllocationMeter` counts the same thing on any device: a
``TorchDispatchMode`` that sees every operator's outputs, counts a storage as allocated when an
operator returns one that aliases none of its inputs (a view, an in-place or ``out=`` result is no
new memory), and uncounts it when the storage dies (a weak reference to torch's storage object, which
lives exactly as long as its memory). The stage's state that existed before the meter started --
parameters, buffers, fp32 masters, optimizer state, gradients -- is counted once, by
:meth:`AllocationMeter.track_external`. The peak is taken at every new allocation.

What it misses: temporaries a kernel allocates inside itself without going through the dispatcher
(a GPU's allocator counts them; on a CPU they are small next to the outputs), and tensors made on
other threads than the stage's (a CPU backward runs on the calling thread, so that is none in
training). Its cost is a Python call per operator: opt-in, with ``PACI_TUNE_TRACK_MEMORY=1`` in the
environment (:func:`tracking_requested`); on CUDA the allocator's own counter is read and no meter
runs. May import: torch.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

TRACK_ENV = "PACI_TUNE_TRACK_MEMORY"
"""Set to 1 to measure each stage's allocated tensor bytes on the CPU (summary key ``peak_allocated_bytes``)."""


def tracking_requested() -> bool:
    """Whether the environment asks for the CPU meter (``PACI_TUNE_TRACK_MEMORY=1``)."""
    return os.environ.get(TRACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _storages(values: Iterable[object]) -> Iterator[torch.UntypedStorage]:
    """The storages behind the tensors among ``values`` (flattened), on any device but ``meta``."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            try:
                yield v.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
                continue


class AllocationMeter(TorchDispatchMode):
    """Live and peak tensor storage bytes of what runs inside it, plus what :meth:`track_external` adds.

    Re-entrant as a context (``with meter:`` any number of times); the count carries across entries,
    so a stage's training segments, warm-up and evaluations make one running peak. :meth:`reset_peak`
    starts a new peak from what is live now.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        return st._cdata

    def _count(self, st: torch.UntypedStorage) -> None:
        """Count ``st`` if it is new; follow a resize of one already counted."""
        key, nbytes = self._key(st), st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
        elif old == nbytes:
            return
        self._sizes[key] = nbytes
        self.live += nbytes - (old or 0)
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def track_external(self, tensors: Iterable[object]) -> None:
        """Count tensors that exist already (a stage's weights, masters, gradients, optimizer state)."""
        for st in _storages(tensors):
            self._count(st)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {self._key(st) for st in _storages(tree_flatten((args, kwargs))[0])}
        for st in _storages(tree_flatten(out)[0]):
            key = self._key(st)
            if key not in inputs or key in self._sizes:
                self._count(st)
        return out


def stage_tensors(stages: Iterable[object]) -> list[torch.Tensor]:
    """Every tensor a stage holds between actions: its module's parameters and buffers, the optimizer's
    masters, their gradients and the optimizer's state (what :meth:`AllocationMeter.track_external` takes)."""
    out: list[torch.Tensor] = []
    for stage in stages:
        module, optim = stage.module, stage.optim  # type: ignore[attr-defined]
        out += [*module.parameters(), *module.buffers()]
        out += [p.grad for p in module.parameters() if p.grad is not None]
        out += [*optim.masters, *(m.grad for m in optim.masters if m.grad is not None)]
        torch_opts = optim.optimizer if isinstance(optim.optimizer, (list, tuple)) else [optim.optimizer]
        for opt in torch_opts:
            for state in getattr(opt, "state", {}).values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class StageMeter:
    """One process's measurement of its stages' allocated bytes: CUDA's counter, or the CPU meter when
    asked for (:func:`tracking_requested`), or nothing (``peak_bytes`` None)."""

    def __init__(self, device: torch.device, stages: Iterable[object], *, enabled: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        on = tracking_requested() if enabled is None else enabled
        self.meter = AllocationMeter() if on and not self.cuda else None
        self._depth = 0  # nested activations enter the mode once
        if self.meter is not None:
            self.meter.track_external(stage_tensors(stages))

    @contextmanager
    def active(self) -> Iterator[None]:
        """Measure what runs inside (a no-op on CUDA, whose allocator counts by itself, and when off)."""
        if self.meter is None or self._depth:
            yield
            return
        self._depth += 1
        try:
            with self.meter:
                yield
        finally:
            self._depth -= 1

    @property
    def peak_bytes(self) -> int | None:
        """Peak allocated tensor bytes so far: ``max_memory_allocated`` on CUDA, the meter's on the CPU."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return None if self.meter is None else int(self.meter.peak)

    @property
    def measured_with(self) -> str | None:
        """How :attr:`peak_bytes` was measured, for the run summary."""
        if self.cuda:
            return "torch.cuda.max_memory_allocated"
        return None if self.meter is None else "dispatch-mode storage meter (PACI_TUNE_TRACK_MEMORY)"
