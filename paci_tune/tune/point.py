"""One point of a search space: the schedule and layout a trial runs, and what it changes in the run.

A point is what a study's sampler proposes and what a trial, the verdict and the report read back;
it knows how to say itself (a label) and how to become a run (dotted overrides), and nothing about
which points a space allows (:mod:`.space`). It lives apart from the space so that readers of a
search's results (the verdict, the report) need not import the space's parsing. May import:
:mod:`paci_tune.config` (the :class:`~paci_tune.config.layout.Layout`) and the tune layer's
:mod:`.choices` and :mod:`.recipes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.layout import Layout
from ..config.memory import format_bytes
from .choices import DEFAULT_BACKWARD_WEIGHTS
from .recipes import OFF, recipe_overrides


@dataclass(frozen=True)
class TrialParams:
    """One point of the space: everything a trial changes in the run configuration."""

    schedule: str
    stages: int
    window: int
    microbatch_size: int
    lr_scale: float = 1.0
    data_parallel: int = 1
    backward_weights: str | None = None  # PACI's pipeline.backward_weights; None: the run's own (flush: always)
    chunks: int = 1  # v model chunks per stage (pipeline.chunks): > 1 under interleaved only
    optimizer: str | None = None  # an optimizer recipe (:mod:`.recipes`); None: the run's own optimizer
    staleness: str | None = None  # PACI's staleness recipe; None: the run's own controls (flush: always)

    @property
    def layout(self) -> Layout:
        """The point's pipeline layout (its cut chosen when the trial's run is resolved)."""
        return Layout(
            self.schedule, self.stages, self.data_parallel, self.window, self.microbatch_size, chunks=self.chunks
        )

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

    @property
    def devices(self) -> int:
        return self.layout.devices

    def overrides(self) -> dict[str, Any]:
        """Dotted run-config overrides (``pipeline.window`` ...) that make a run this point."""
        out = self.layout.overrides()
        if self.backward_weights is not None:
            out["pipeline.backward_weights"] = self.backward_weights
        return {**out, **recipe_overrides(self.optimizer, self.staleness)}

    def label(self) -> str:
        """``paci P=4 D=2 a=8 b=4 w=current [nadam betas=0.99,0.999] +predict_weights lr x0.5``: D, v
        (``interleaved P=2 v=2 ...``), the backward's weights, the optimizer and staleness recipes and the
        LR scale only where they are not the default (D=1, v=1, ``forward`` or the run's own, x1)."""
        lr = f" lr x{self.lr_scale:.2g}" if self.lr_scale != 1.0 else ""
        bw = self.backward_weights
        w = f" w={bw}" if bw is not None and bw != DEFAULT_BACKWARD_WEIGHTS else ""
        opt = f" [{self.optimizer}]" if self.optimizer is not None else ""
        stale = f" +{self.staleness.replace(' ', ' +')}" if self.staleness not in (None, OFF) else ""
        return f"{self.layout.label()}{w}{opt}{stale}{lr}"


@dataclass(frozen=True)
class MemoryDrop:
    """A point one schedule cannot run under ``hardware.memory``: its predicted peak on the leanest cut.

    Dropped before any trial (:func:`paci_tune.tune.setup.drop_over_budget`), as Alpa prices a stage
    over the device's memory at infinity; kept so the summary, best.yaml and the report can say which
    points went and by how much. ``params`` is the point at LR x1 (the LR changes no byte).
    """

    params: TrialParams
    peak_bytes: int  # the most loaded stage's prediction
    stage: int
    cut: tuple[int, ...]
    cap_bytes: int

    def matches(self, q: TrialParams) -> bool:
        """Whether a proposed point is this one (any LR: memory does not depend on it)."""
        p = self.params
        return (
            q.schedule,
            q.stages,
            q.window,
            q.microbatch_size,
            q.backward_weights,
            q.chunks,
            q.optimizer,
            q.staleness,
        ) == (p.schedule, p.stages, p.window, p.microbatch_size, p.backward_weights, p.chunks, p.optimizer, p.staleness)

    def reason(self) -> str:
        return (
            f"{self.params.label()}: predicted peak {format_bytes(self.peak_bytes)} on stage {self.stage} "
            f"(cut {list(self.cut)}) > hardware.memory {format_bytes(self.cap_bytes)}"
        )

    def to_doc(self) -> dict[str, Any]:
        """best.yaml's and the report's entry: the point, its predicted peak and the cap, in bytes."""
        p = self.params
        doc: dict[str, Any] = {
            "schedule": p.schedule,
            "stages": p.stages,
            "data_parallel": p.data_parallel,
            "window": p.window,
            "microbatch_size": p.microbatch_size,
        }
        doc.update(
            {
                k: v
                for k, v in (
                    ("backward_weights", p.backward_weights),
                    ("optimizer", p.optimizer),
                    ("staleness", p.staleness),
                )
                if v is not None
            }
        )
        if p.chunks > 1:
            doc["chunks"] = p.chunks
        return {
            **doc,
            "predicted_peak_bytes": self.peak_bytes,
            "stage": self.stage,
            "cut": list(self.cut),
            "memory_bytes": self.cap_bytes,
            "reason": self.reason(),
        }
