"""The emulated runtime: every stage in one process, on one device.

It executes the very same per-stage programs as the distributed runtime, in an order that respects
every dependency, so its numerics are the distributed runtime's. Its pipeline timing comes from
placing the measured per-action compute times on the schedule as they run (zero transfer cost,
evaluation left out), which is the pipeline the schedule would give on P identical devices.
May import: torch, the pipeline layer's modules, :mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import time

import torch

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Op, Placer, Program, execution_order, inflight_cap, sweep
from .evaluation import EvalPlan
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
    """In-process transport: tensors (and their flags) wait in a dict until their receiver takes them."""

    def __init__(self) -> None:
        self._box: dict[tuple[int, str, int], tuple[torch.Tensor, int]] = {}

    def send(self, src: int, dst: int, kind: str, mb: int, tensor: torch.Tensor, flag: int = 0) -> None:
        self._box[(dst, kind, mb)] = (tensor, flag)

    def recv(self, src: int, dst: int, kind: str, mb: int) -> tuple[torch.Tensor, int]:
        return self._box.pop((dst, kind, mb))

    def expect(self, src: int, items: list[tuple[str, int]]) -> None:
        """Nothing to post ahead in one process."""


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
        self.runners = [ActionRunner(st, box, stream, val) for st in stages]
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

    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Batches ``first_batch`` on (``n_batches``, or until the plan ends the run), drained at the end."""
        end = None if n_batches is None else first_batch + n_batches - 1
        programs = [
            Program(self.schedule, s, self.n_stages, self.window, first_batch, end, inflight=self.inflight,
                    eval_at=plan.eval_at)
            for s in range(self.n_stages)
        ]  # fmt: skip
        for runner, program in zip(self.runners, programs, strict=True):
            runner.begin(program, plan)
        self.runners[-1].losses = BatchLosses(self.window, on_batch)
        seg = [StageTiming() for _ in self.stages]
        placer = Placer(self.n_stages, sync_steps=self.sync_steps)
        t0 = time.perf_counter()
        for s, act in sweep([iter(p) for p in programs], self.sync_steps):
            seconds = self.runners[s].run(act, seg[s])
            if act.op is not Op.EVAL:
                placer.place(s, act, seconds)
        eval_seconds = sum(r.eval_seconds for r in self.runners)
        wall = time.perf_counter() - t0 - eval_seconds
        for t in seg:
            t.idle = placer.makespan - t.busy
            t.span = placer.makespan
        assert programs[0].end is not None
        return SegmentReport(programs[0].end - first_batch + 1, wall, placer.makespan, seg, eval_seconds)

    def evaluate(self) -> float:
        return validation_loss(self.stages, self.val)

    def agree(self, flag: bool) -> bool:
        return flag

    def share(self, value: object) -> object:
        """The reporting stage's ``value``, on every rank (here: one process)."""
        return value

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
