"""The emulated runtime: every stage in one process, on one device.

It executes the very same per-stage action lists as the distributed runtime, in an order that
respects every dependency, so its numerics are the distributed runtime's. Its pipeline timing
comes from replaying the measured per-action compute times on the schedule (zero transfer cost),
which is the pipeline the schedule would give on P identical devices. May import: torch, the
pipeline layer's modules, :mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import time

import torch

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Action, build, execution_order, inflight_cap, replay
from .runtime import (
    ActionRunner,
    BatchLosses,
    OnBatch,
    SegmentReport,
    StageTiming,
    run_warmup_action,
    stage_stats,
    validation_loss,
    warmup_actions,
)
from .stage import Stage


class Mailbox:
    """In-process transport: tensors wait in a dict until their receiver takes them."""

    def __init__(self) -> None:
        self._box: dict[tuple[int, str, int], torch.Tensor] = {}

    def send(self, src: int, dst: int, kind: str, mb: int, tensor: torch.Tensor) -> None:
        self._box[(dst, kind, mb)] = tensor

    def recv(self, src: int, dst: int, kind: str, mb: int) -> torch.Tensor:
        return self._box.pop((dst, kind, mb))


class EmulatedRuntime:
    """All stages of the pipeline in this process."""

    is_reporter = True

    def __init__(
        self,
        stages: list[Stage],
        units: list[range],
        stream: MicroBatchStream,
        val: ValidationSet,
        schedule: str,
        inflight: int | None = None,
    ) -> None:
        self.stages, self.units, self.val = stages, units, val
        self.schedule, self.inflight = schedule, inflight
        self.n_stages = len(stages)
        self.window = stages[0].window
        self.device = stages[0].device
        box = Mailbox()
        self.runners = [ActionRunner(st, box, stream) for st in stages]
        self.sync_steps = self.window if schedule != "paci" and stages[0].grad_clip else None
        self._norm: tuple[int, float] = (-1, 0.0)
        if self.sync_steps:
            for r in self.runners:
                r.global_grad_norm = self._global_grad_norm

    def _global_grad_norm(self, batch: int) -> float:
        """The whole model's gradient norm of ``batch``: computed at the first stage to step, then kept."""
        if self._norm[0] != batch:
            self._norm = (batch, sum(st.grad_sq_norm() for st in self.stages) ** 0.5)
        return self._norm[1]

    @property
    def local_stages(self) -> list[int]:
        return list(range(self.n_stages))

    def warmup(self) -> None:
        n = inflight_cap(self.schedule, 0, self.n_stages, self.window, self.inflight)
        lists = [warmup_actions(s, self.n_stages, n) for s in range(self.n_stages)]
        for s, act in execution_order(lists):
            run_warmup_action(self.runners[s], act)

    def run_segment(self, first_batch: int, n_batches: int, on_batch: OnBatch) -> SegmentReport:
        lists = build(self.schedule, self.n_stages, self.window, first_batch, n_batches, self.inflight)
        self.runners[-1].losses = BatchLosses(self.window, on_batch)
        seg = [StageTiming() for _ in self.stages]
        durations: dict[tuple[int, Action], float] = {}
        t0 = time.perf_counter()
        for s, act in execution_order(lists, self.sync_steps):
            durations[(s, act)] = self.runners[s].run(act, seg[s])
        wall = time.perf_counter() - t0
        timeline = replay(lists, lambda s, a: durations[(s, a)], sync_steps=self.sync_steps)
        for t in seg:
            t.idle = timeline.makespan - t.busy
            t.span = timeline.makespan
        return SegmentReport(n_batches, wall, timeline.makespan, seg)

    def evaluate(self) -> float:
        return validation_loss(self.stages, self.val)

    def agree(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def state_dicts(self) -> dict[int, dict]:
        return {s: st.state_dict() for s, st in enumerate(self.stages)}

    def load_state_dicts(self, states: dict[int, dict]) -> None:
        for s, st in enumerate(self.stages):
            st.load_state_dict(states[s])

    def stats(self, timing: list[StageTiming], makespan: float) -> list[dict]:
        """Per-stage summary entries, given the run's accumulated timing."""
        return [
            stage_stats(st, timing[s], makespan, self.units[s], self.device, self.schedule)
            for s, st in enumerate(self.stages)
        ]

    def close(self) -> None:
        pass
