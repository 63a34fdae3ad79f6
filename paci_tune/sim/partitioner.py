"""Memory-aware pipeline partitioning from a measured cost profile.

A pipeline runs at the pace of its slowest stage, so the cut minimises the largest stage time:
forward plus backward of one micro-batch, plus the optimizer step amortised over the ``a``
micro-batches of a window, and with ``D`` data-parallel replicas the step's gradient all-reduce
amortised the same way (the ring cost of :mod:`.profile` is linear in the stage's gradient bytes
plus a constant per stage, so it adds per unit and per stage; 0 when ``D = 1``). Memory is per
device -- one stage of one replica at micro-batch ``b`` -- and does not depend on ``D``. Under PACI
with ``backward_weights="forward"`` a stage that keeps weight copies (:func:`.memory.stage_copies`,
all but the last stage at the default cap) holds them in memory and clones its weights at every
steady-state step: its time adds the profile's ``copy_s`` amortised over the window, like the
step (:mod:`.simulator`); ``current`` and the flush schedules add nothing. Unlike
:func:`paci_tune.schedule.balanced_partition` (FLOP estimates, no memory), this uses measured
times and rejects cuts whose predicted memory (:mod:`paci_tune.sim.memory`) does not fit the
device: the in-flight count differs per stage (``P - s`` under 1F1B/PACI), so the memory limit
depends on *where* a stage sits, and the cheapest balanced cut can be infeasible on the first
stages while a slightly slower one fits.

The search is a dynamic program over (stages used, units covered): stage ``p`` covering units
``j..i-1`` is allowed when it fits, and ``best[p][i] = min_j max(best[p-1][j], time(j, i))``.
It is exact, O(P n^2) cost evaluations. It cuts one piece per stage: a schedule whose ranks hold
several chunks (interleaved, ZB-V, DualPipeV) is cut into ``v * P`` balanced pieces by
:func:`paci_tune.pipeline.planning.interleaved_cut` instead, and refused here. May import:
:mod:`.memory`, :mod:`.profile`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.layout import Layout
from ..config.memory import format_bytes
from ..config.schema import BACKWARD_WEIGHTS
from ..errors import ConfigError
from ..schedule import NAMES, min_max_partition, schedule_of
from .memory import DEFAULT_OVERHEAD_BYTES, stage_copies, stage_memory
from .profile import Profile


@dataclass(frozen=True)
class Partition:
    """A chosen cut and what the profile predicts for each of its stages."""

    sizes: list[int]
    stage_time_s: list[float]
    memory_bytes: list[int]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_time_s)


class PartitionModel:
    """Per-stage time and memory of candidate cuts, for one profile, schedule and batching.

    ``backward_weights``: PACI's ``pipeline.backward_weights`` (``forward`` counts the weight copies,
    module docstring).
    """

    def __init__(
        self,
        profile: Profile,
        layout: Layout,
        *,
        optimizer: str = "adamw",
        overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
        backward_weights: str = "forward",
    ) -> None:
        n, stages, schedule, window = profile.n_units, layout.stages, layout.schedule, layout.window
        microbatch_size, inflight, data_parallel = layout.microbatch_size, layout.inflight, layout.data_parallel
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
            raise ConfigError("pipeline.stages", stages, f"1..{n} (the model has {n} pipeline units)")
        one_chunk = [n for n in NAMES if not schedule_of(n).multi_chunk]
        if schedule not in one_chunk:  # several chunks a rank cut v*P pieces: not this partitioner's
            raise ConfigError("pipeline.schedule", schedule, "one of: " + ", ".join(one_chunk))
        if backward_weights not in BACKWARD_WEIGHTS:
            raise ConfigError("pipeline.backward_weights", backward_weights, "one of: " + ", ".join(BACKWARD_WEIGHTS))
        self.profile, self.stages, self.schedule, self.spec = profile, stages, schedule, schedule_of(schedule)
        self.window, self.microbatch_size, self.inflight = window, microbatch_size, inflight
        self.optimizer, self.overhead_bytes = optimizer, overhead_bytes
        costs = profile.at(microbatch_size)
        units = zip(costs, profile.units, strict=True)
        ring = profile.allreduce
        # ring_s(bytes, D) = per_byte * bytes + per_stage: split into a per-unit and a per-stage part
        self._reduce_stage = ring.ring_s(0, data_parallel) / window
        per_byte = (ring.ring_s(1.0, data_parallel) - ring.ring_s(0, data_parallel)) / window
        per_unit = [c.forward_s + c.backward_s + u.optimizer_s / window + per_byte * u.trained_bytes for c, u in units]
        self._prefix = [0.0]
        for t in per_unit:
            self._prefix.append(self._prefix[-1] + t)
        self._copy_prefix = [0.0]
        for u in profile.units:
            self._copy_prefix.append(self._copy_prefix[-1] + (u.copy_s or 0.0) / window)
        self.copies = [
            stage_copies(schedule, s, stages, window, inflight, backward_weights=backward_weights)
            for s in range(stages)
        ]

    def time(self, stage: int, first: int, stop: int) -> float:
        """F+B of one micro-batch plus the optimizer step (and all-reduce, and a weight copy) amortised
        over the window."""
        copy = self._copy_prefix[stop] - self._copy_prefix[first] if self.copies[stage] else 0.0
        return self._prefix[stop] - self._prefix[first] + self._reduce_stage + copy

    def memory(self, stage: int, first: int, stop: int) -> int:
        """Predicted peak bytes of ``stage`` owning units ``first..stop-1``."""
        cap = self.spec.inflight_cap(stage, self.stages, self.window, self.inflight)
        return stage_memory(
            self.profile,
            list(range(first, stop)),
            self.microbatch_size,
            cap,
            last=stage == self.stages - 1,
            optimizer=self.optimizer,
            overhead_bytes=self.overhead_bytes,
            copies=self.copies[stage],
        ).total

    def describe(self, sizes: list[int]) -> Partition:
        times, mems, start = [], [], 0
        for s, size in enumerate(sizes):
            times.append(self.time(s, start, start + size))
            mems.append(self.memory(s, start, start + size))
            start += size
        return Partition(list(sizes), times, mems)

    def fastest(self, memory_bytes: float | None = None) -> Partition:
        """The fastest contiguous cut into ``stages`` that fits ``memory_bytes`` (see :func:`partition`)."""
        n, stages = self.profile.n_units, self.stages
        fits = None if memory_bytes is None else (lambda s, j, i: self.memory(s, j, i) <= memory_bytes)
        sizes = min_max_partition(n, stages, self.time, fits)
        if sizes is None:
            assert memory_bytes is not None
            plan = self.leanest()
            leanest = plan.sizes
            worst = max(range(stages), key=lambda s: plan.memory_bytes[s])
            raise ConfigError(
                "pipeline.stages",
                stages,
                f"a depth whose stages fit the device: even the leanest cut {leanest} ({self.schedule}, micro-batch "
                f"{self.microbatch_size}) is predicted {format_bytes(plan.memory_bytes[worst])} vs "
                f"{format_bytes(memory_bytes)} available on stage {worst}; use more stages, a smaller micro-batch "
                f"or a schedule with fewer micro-batches in flight",
            )
        return self.describe(sizes)

    def leanest(self) -> Partition:
        """The cut whose most loaded stage needs the least memory: what a device budget must hold at least."""
        sizes = min_max_partition(self.profile.n_units, self.stages, lambda s, j, i: float(self.memory(s, j, i)))
        assert sizes is not None
        return self.describe(sizes)


def partition(profile: Profile, layout: Layout, *, memory_bytes: float | None = None, **costs: Any) -> Partition:
    """The fastest contiguous cut of the profile's units into ``layout.stages`` that fits ``memory_bytes``.

    ``memory_bytes`` is one device's memory (``None``: unlimited). When no cut fits, raises
    ``ConfigError("pipeline.stages", ...)`` with the prediction of the cut that needs the least
    memory, so the user sees how far off they are and on which stage. The layout's cut is ignored
    (this chooses it); ``costs``: the keywords of :class:`PartitionModel` (optimizer, overhead,
    ``backward_weights``).
    """
    return PartitionModel(profile, layout, **costs).fastest(memory_bytes)
