"""The emulated runtime: every stage in one process, on one device.

It executes the very same per-stage programs as the distributed runtime, in an order that respects
every dependency, so its numerics are the distributed runtime's. Its pipeline timing comes from
placing the measured per-action compute times on the schedule as they run (zero transfer cost,
evaluation left out), which is the pipeline the schedule would give on P identical devices.

Data parallelism (D replicas): D explicit copies of every stage, each with its own optimizer and
its own micro-batches, are the exact model of the distributed runtime's P x D processes. Every
action the schedule yields for stage s runs on replica 0, 1, ..., D-1 in turn, so when stage s
reaches its step all D replicas have finished that window's backwards; the first replica to step
averages the D gradient lists in replica order (:func:`.replicas.average_gradients`, the
all-reduce's arithmetic) and every replica then takes the same step on the same weights. Copies,
rather than one stage run D times with its gradients kept apart, cost D x the stage's memory on
one device, but leave the stage, its in-flight bookkeeping and its drift record exactly as the
distributed runtime's, and need no second code path. A pipeline action is placed on the timeline
at the longest of its D replicas' times (the replicas would run side by side; the all-reduce, like
a transfer, is given no cost).

Parameters tied across stages (:mod:`.tied`): every holder has its own copy; at a step the holders'
gradients are summed in process (:func:`.tied.sum_tied`, after the replicas' average). Every holder's
gradient must be complete by then, so a run with tied parameters synchronises its steps as a
global-norm clip does (each waits for every stage's last backward of its batch; a flush schedule
reaches that point anyway). May import: torch, the pipeline layer's modules,
:mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import torch

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Op, Placer, execution_order, sweep
from .evaluation import EvalPlan
from .replicas import ReplicaLosses, average_gradients
from .runtime import (
    ActionRunner,
    BatchLosses,
    OnBatch,
    RuntimeBase,
    SegmentReport,
    StageTiming,
    metered,
    run_warmup_action,
)
from .stage import Stage
from .tied import TiedParameter, mark_counted_elsewhere, sum_tied


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

    def settle(self, dst: int, payloads: int) -> None:
        """Nothing pending in one process."""


class EmulatedRuntime(RuntimeBase):
    """All stages of the pipeline, and all D replicas of each (``replicas[r][s]``), in this process.

    A :class:`~.runtime.Runtime`.
    """

    is_reporter = True

    def __init__(
        self,
        replicas: list[list[Stage]],
        units: list[range],
        streams: list[MicroBatchStream],
        val: ValidationSet,
        schedule: str,
        inflight: int | None = None,
        tied: list[TiedParameter] | None = None,
    ) -> None:
        super().__init__(replicas[0][0], units, val, schedule, inflight)
        # first_replica: replica 0's stages, the ones a checkpoint saves and the summary describes
        self.replicas, self.first_replica, self.n_replicas = replicas, replicas[0], len(replicas)
        self.runners = [
            [ActionRunner(st, box, stream, val) for st in replica]
            for replica, stream, box in zip(replicas, streams, [Mailbox() for _ in replicas], strict=True)
        ]
        for extra in self.runners[1:]:
            for runner in extra:
                runner.evaluator.scores = False  # replica 0 scores; the weights are the same
        self.tied = [t for t in tied or () if t.trainable]  # a frozen one's copies never change
        self.sync_steps = self.window if self.clips_whole_model or self.tied else None
        self._norm: tuple[int, float] = (-1, 0.0)
        self._averaged: list[int] = [-1] * self.stages  # per stage: the last batch whose gradients are averaged
        self._summed: list[int] = [-1] * len(self.tied)  # per tied parameter: the last batch summed
        for row in self.runners:
            for r in row:
                mark_counted_elsewhere(r.stage, self.tied)
                if self.clips_whole_model:
                    r.global_grad_norm = self._global_grad_norm
                holds = any(r.stage.index in t.names for t in self.tied)
                if (self.n_replicas > 1 and r.stage.trains) or holds:  # nothing to train: nothing to average
                    r.grad_sync = self._sync_stage(r.stage.index)
        self._meter([st for row in replicas for st in row])  # one process: its peak is every stage's together

    def _sync_stage(self, s: int) -> Callable[[int], None]:
        return lambda batch: self._sync(s, batch)

    def _sync(self, s: int, batch: int) -> None:
        """Stage ``s``'s gradients of ``batch`` as its step applies them: averaged over the replicas, then
        its tied parameters summed over their holders (each once per step, at the first to step)."""
        self._average(s, batch)
        for k, t in enumerate(self.tied):
            if s in t.names and self._summed[k] != batch:
                self._summed[k] = batch
                for h in t.stages:
                    self._average(h, batch)
                for rep in self.replicas:
                    sum_tied([(rep[h], t.index_in(rep[h])) for h in t.stages])

    def _average(self, s: int, batch: int) -> None:
        if self.n_replicas > 1 and self.first_replica[s].trains and self._averaged[s] != batch:
            self._averaged[s] = batch  # once per step, at the first replica to step
            average_gradients([rep[s].gradients() for rep in self.replicas])

    def _global_grad_norm(self, batch: int) -> float:
        """The whole model's gradient norm of ``batch``: computed at the first stage to step, then kept."""
        if self._norm[0] != batch:
            for s in range(self.stages):  # every stage's gradients as they will step (a flush steps together)
                self._sync(s, batch)
            self._norm = (batch, sum(st.grad_sq_norm() for st in self.first_replica) ** 0.5)
        return self._norm[1]

    @property
    def local_stages(self) -> list[int]:
        return list(range(self.stages))

    @metered
    def warmup(self) -> None:
        lists = [self._warmup_actions(s) for s in range(self.stages)]
        for s, act in execution_order(lists):
            for row in self.runners:
                run_warmup_action(row[s], act)

    def _plans(self, plan: EvalPlan) -> list[EvalPlan]:
        """Replica 0's stage 0 decides each evaluation's control; the other replicas' stage 0 take its decision."""
        if self.n_replicas == 1:
            return [plan]
        decided: dict[int, tuple[bool, bool]] = {}

        def lead(k: int, news: int) -> tuple[bool, bool]:
            decided.clear()
            decided[k] = plan.control(k, news)
            return decided[k]

        def follow(k: int, news: int) -> tuple[bool, bool]:
            return decided[k]

        return [dataclasses.replace(plan, control=lead)] + [dataclasses.replace(plan, control=follow)] * (
            self.n_replicas - 1
        )

    @metered
    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Batches ``first_batch`` on (``n_batches``, or until the plan ends the run), drained at the end."""
        programs = [self._program(s, first_batch, n_batches, plan) for s in range(self.stages)]
        for row, rplan in zip(self.runners, self._plans(plan), strict=True):
            for runner, program in zip(row, programs, strict=True):
                runner.begin(program, rplan)  # the replicas share each stage's program: they end together
        if self.n_replicas == 1:
            self.runners[0][-1].losses = BatchLosses(self.window, on_batch)
        else:
            combined = ReplicaLosses(self.n_replicas, on_batch)
            for r, row in enumerate(self.runners):
                row[-1].losses = BatchLosses(self.window, combined.for_replica(r))
        seg = [[StageTiming() for _ in self.first_replica] for _ in self.runners]
        timing = [StageTiming() for _ in self.first_replica]  # per stage: the slowest replica's time of each action
        placer = Placer(self.stages, sync_steps=self.sync_steps)
        t0 = time.perf_counter()
        for s, act in sweep([iter(p) for p in programs], self.sync_steps):
            seconds = max(row[s].run(act, seg[r][s]) for r, row in enumerate(self.runners))
            if act.op is not Op.EVAL:
                placer.place(s, act, seconds)
                timing[s].busy += seconds
        eval_seconds = sum(r.eval_seconds for row in self.runners for r in row)
        wall = time.perf_counter() - t0 - eval_seconds
        for t in timing:
            t.idle = placer.makespan - t.busy
            t.span = placer.makespan
        assert programs[0].end is not None
        return SegmentReport(programs[0].end - first_batch + 1, wall, placer.makespan, timing, eval_seconds)

    @metered
    def evaluate(self) -> float:
        """Mean loss over the validation set, running every stage in this process (a drained pipeline)."""
        losses = []
        for x, y in self.val:
            for st in self.first_replica[:-1]:
                x = st.evaluate(x)
            losses.append(float(self.first_replica[-1].evaluate(x, y)))
        return self.val.mean_loss(losses)

    def agree(self, flag: bool) -> bool:
        return flag

    def share(self, value: object) -> object:
        """The reporting stage's ``value``, on every rank (here: one process)."""
        return value

    def barrier(self) -> None:
        pass

    def state_dicts(self) -> dict[int, dict]:
        """Replica 0's stages: the replicas are identical, so one copy of each stage is the checkpoint."""
        return {s: st.state_dict() for s, st in enumerate(self.first_replica)}

    def load_state_dicts(self, states: dict[int, dict]) -> None:
        """Every replica from the one copy; each gets its own tensors (loading shares a state's optimizer tensors)."""
        for r, replica in enumerate(self.replicas):
            for s, st in enumerate(replica):
                st.load_state_dict(states[s] if r == 0 else copy.deepcopy(states[s]))

    def stats(self, timing: list[StageTiming], makespan: float) -> list[dict]:
        """Per-stage summary entries (replica 0's: every replica has the same drift), given the run's timing."""
        return [self._stage_entry(st, timing[s], makespan) for s, st in enumerate(self.first_replica)]

    def close(self) -> None:
        pass
