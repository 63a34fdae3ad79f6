"""What a simulation predicts: each stage's share (:class:`StageResult`) and the run's (:class:`SimResult`).

:func:`.simulator.simulate` fills them; the report, the search's memory figure, the calibration's
predictions and ``simulate --json`` (:meth:`SimResult.to_dict`) read them. Throughput, bubbles,
drift and memory are the timeline's figures; the analytic bubble is the registry's textbook formula
for the layout (ZB-H1's on the stages' mean costs). May import: :mod:`.memory`,
:mod:`paci_tune.schedule` (a schedule's bubble, the timeline), :mod:`paci_tune.config` (the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config.layout import Layout
from ..schedule import schedule_of
from ..schedule.replay import Timeline
from .memory import StageMemory


@dataclass
class StageResult:
    """One stage's share of a simulated run."""

    stage: int
    units: range  # with several chunks: the first chunk's (``chunk_units`` has them all)
    busy_s: float
    idle_s: float
    bubble_fraction: float
    steady_bubble_fraction: float
    peak_inflight: int
    memory: StageMemory
    max_drift: int
    mean_drift: float
    drift_bound: int
    drift_histogram: dict[int, int] = field(default_factory=dict)
    allreduce_s: float = 0.0  # one gradient all-reduce in the stage's dp group (0 when D = 1)
    tied_allreduce_s: float = 0.0  # one step's all-reduces of tied parameters among their holders
    weight_copies_made: int = 0  # forward mode: steps that cloned the weights (module docstring)
    weight_copies_peak: int = 0  # forward mode: most weight copies held at once
    copy_s: float = 0.0  # one clone of the stage's weights (the profile's ``copy_s``)
    chunk_units: tuple[range, ...] = ()  # several chunks: the units of each chunk the stage holds

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.total

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "units": [self.units.start, self.units.stop],
            "busy_s": self.busy_s,
            "idle_s": self.idle_s,
            "bubble_fraction": self.bubble_fraction,
            "steady_bubble_fraction": self.steady_bubble_fraction,
            "peak_inflight": self.peak_inflight,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory": self.memory.to_dict(),
            "max_drift": self.max_drift,
            "mean_drift": self.mean_drift,
            "drift_bound": self.drift_bound,
            "drift_histogram": {str(k): v for k, v in sorted(self.drift_histogram.items())},
            "allreduce_s": self.allreduce_s,
            "tied_allreduce_s": self.tied_allreduce_s,
            "weight_copies_made": self.weight_copies_made,
            "weight_copies_peak": self.weight_copies_peak,
            "copy_s": self.copy_s,
            **({"chunk_units": [[r.start, r.stop] for r in self.chunk_units]} if len(self.chunk_units) > 1 else {}),
        }


@dataclass
class SimResult:
    """Predicted performance of one schedule; ``to_dict()`` is what ``simulate --json`` prints."""

    layout: Layout  # its cut set
    seq_len: int
    n_batches: int
    makespan_s: float
    step_time_s: float
    steady_step_time_s: float
    bubble_fraction: float
    steady_bubble_fraction: float
    per_stage: list[StageResult]
    timeline: Timeline = field(repr=False)
    backward_weights: str = "forward"
    backward_split: str | None = None  # split B/W: "measured" or "derived" (the profile's split, :mod:`.costs`)
    mean_costs: tuple[float, float, float] = (0.0, 0.0, 0.0)  # F, B, W of a stage, averaged over stages

    @property
    def allreduce_fraction(self) -> float:
        """Share of the run each stage spends in gradient all-reduces (dp and tied), averaged over stages."""
        span = self.timeline.makespan
        if span <= 0:
            return 0.0
        reduce = sum(st.allreduce_s + st.tied_allreduce_s for st in self.per_stage)
        return reduce * self.n_batches / (span * len(self.per_stage))

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the whole simulated run (fill and drain included)."""
        return self.layout.global_batch * self.seq_len / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def steady_tokens_per_s(self) -> float:
        return self.layout.global_batch * self.seq_len / self.steady_step_time_s if self.steady_step_time_s > 0 else 0.0

    @property
    def analytic_bubble_fraction(self) -> float:
        """Textbook bubble with equal stages and free transfers (the registry's ``Schedule.bubble``: 0 for
        PACI, (P-1)/(m+P-1) for a flush, interleaved (P-1)/(v m + P-1), a V schedule's own); ZB-H1's on the
        stages' mean F, B, W: (P-1)(F+B-W) / (m(F+B+W) + (P-1)(F+B-W)) (Qi et al.; (P-1)/(3m+P-1) when equal)."""
        lay, spec = self.layout, schedule_of(self.layout.schedule)
        p, m = lay.stages, lay.window
        if spec.split_backward and not spec.multi_chunk:
            f, b, w = self.mean_costs
            idle = (p - 1) * max(f + b - w, 0.0)
            return idle / (m * (f + b + w) + idle) if idle else 0.0
        return spec.bubble(p, m, lay.chunks)

    @property
    def max_drift(self) -> int:
        return max(st.max_drift for st in self.per_stage)

    @property
    def peak_memory_bytes(self) -> int:
        return max(st.peak_memory_bytes for st in self.per_stage)

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "schedule": lay.schedule,
            "n_stages": lay.stages,  # the JSON's name for P since its first version (``stages`` is the per-stage list)
            "chunks": lay.chunks,
            "backward_split": self.backward_split,
            "data_parallel": lay.data_parallel,
            "backward_weights": self.backward_weights,
            "devices": lay.devices,
            "window": lay.window,
            "microbatch_size": lay.microbatch_size,
            "global_batch": lay.global_batch,
            "seq_len": self.seq_len,
            "partition": list(lay.partition or ()),
            "n_batches": self.n_batches,
            "tokens_per_s": self.tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "step_time_s": self.step_time_s,
            "steady_step_time_s": self.steady_step_time_s,
            "makespan_s": self.makespan_s,
            "bubble_fraction": self.bubble_fraction,
            "steady_bubble_fraction": self.steady_bubble_fraction,
            "analytic_bubble_fraction": self.analytic_bubble_fraction,
            "max_drift": self.max_drift,
            "peak_memory_bytes": self.peak_memory_bytes,
            "allreduce_fraction": self.allreduce_fraction,
            "stages": [st.to_dict() for st in self.per_stage],
        }
