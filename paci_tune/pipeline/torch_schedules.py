"""Synchronous schedules run for real through torch's own classes, on the distributed runtime's stages.

ZB-H1, ZB-V and DualPipeV split each backward into its input half ``B`` and weight half ``W``;
interleaved 1F1B, ZB-V and DualPipeV cut the model into several chunks per rank. paci-tune's own
runtimes do neither, so the emulated runtime trains 1F1B's numbers for them while the simulator
times their action lists (:mod:`paci_tune.train.timed`). On the distributed runtime they run for
real: each of this rank's :class:`~.stage.Stage` modules is wrapped in torch's ``PipelineStage`` (its
group: this replica's pipe group, :mod:`.mesh`) and every global batch is one ``step()`` of the class
``torch.distributed.pipelining.schedules.get_schedule_class`` knows by the registry's ``torch_class``
(:mod:`paci_tune.schedule.registry`) -- the rank's pieces, placed as the schedule places them
(:mod:`.distributed`: ``s, s + P, ...`` looped; ``s`` and ``2P - 1 - s`` in a V), a ``PipelineStage``
each, in one schedule -- and 1F1B's for ``1f1b`` with ``pipeline.torch_schedule: true`` (an A/B
against paci-tune's own 1F1B). So ``--clock wall`` measures the schedule itself, transfers included.

Everything around the step is the distributed runtime's (:class:`.distributed.DistributedRuntime`,
subclassed): the mesh, the replicas' gradient average and tied parameters' sums at the step, the
whole model's clip norm, the optimizer step through the stage's aliases, evaluations and their
control messages, drained evaluation, checkpoints and the summary. The numerics are plain gradient
accumulation, as 1F1B-flush's: the loss is divided by the window before its backward (torch's
``scale_grads`` off), exactly as :meth:`.Stage.forward` does; in bf16 each ``W`` is folded into the
fp32 master gradients as it completes (torch writes ``.grad`` by hand there, past the fold hook).

Every compute call torch makes is recorded in order (:attr:`TorchScheduleRuntime.trace`, ``F``,
``B``, ``W`` on their chunk, then ``STEP``), so a test can hold the run to the schedule's action list.
A whole backward in a schedule that splits them (DualPipeV's ``FULL_BACKWARD``, alone or inside an
``OVERLAP_F_B``) is recorded as its ``B`` then its ``W``: the two halves, done at once. News that a
target was reached, which paci-tune's own runtime carries on gradients, is shared by a small
all-reduce of the pipe group at each evaluation point instead. In a V the last piece -- the losses,
an evaluation's score -- is on rank 0, the reporter on rank ``P - 1``: each batch's losses and each
evaluation's result are relayed there by a broadcast of the pipe group. May import: torch, the
pipeline layer's modules, :mod:`paci_tune.schedule`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from ..errors import ConfigError
from ..schedule import FLUSH, NAMES, Action, Op, Program, schedule_of
from .distributed import DistributedRuntime
from .evaluation import NEAR, REACHED, EvalPlan, EvalResult
from .mesh import rank_of
from .records import broadcast_json
from .runtime import OnBatch, SegmentReport, StageTiming, metered
from .stage import Stage

TRACE_LIMIT = 100_000
"""Actions :attr:`TorchScheduleRuntime.trace` keeps (the run's first ones): enough for any test."""


class _TracedStage(PipelineStage):
    """torch's stage over a :class:`Stage`'s module (piece ``chunk`` of its rank), recording each compute
    call and its seconds.

    Micro-batch ids are torch's, 0..a-1 within the step; :attr:`first_mb` turns them into the run's
    micro-batch numbers.
    """

    def __init__(self, owner: TorchScheduleRuntime, stage: Stage, chunk: int, group: dist.ProcessGroup) -> None:
        super().__init__(stage.module, stage.index, stage.stages, stage.device, group=group)
        self.owner, self.piece, self.chunk, self.first_mb = owner, stage, chunk, 0
        self._fold = stage.optim.mixed  # bf16: W's gradients go to the fp32 masters as they are made
        self._splits = owner.spec.split_backward  # a whole backward is recorded as its B and W

    def _record(self, op: Op, mb: int, t0: float | None = None) -> None:
        if t0 is not None:
            self.owner.busy += time.perf_counter() - t0
        if self.owner.tracing and len(self.owner.trace) < TRACE_LIMIT:
            self.owner.trace.append(Action(op, self.first_mb + mb, self.chunk))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record(Op.FORWARD, fwd_chunk_id, t0)
        return out

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        t0 = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self._record(Op.BACKWARD, bwd_chunk_id, t0)  # whole (1F1B), or the input half B (its list says W)
        if full_backward and self._splits:
            self._record(Op.WEIGHT, bwd_chunk_id)  # both halves at once: B then W, its time already counted
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        if self._fold:
            self.piece.optim.gradients()  # folds the bf16 .grad torch set by hand into the masters
        self._record(Op.WEIGHT, bwd_chunk_id, t0)
        return out


def torch_schedule_names() -> list[str]:
    """The schedules this runtime runs: those the registry gives a torch class."""
    return [n for n in NAMES if schedule_of(n).torch_class is not None]


class TorchScheduleRuntime(DistributedRuntime):
    """This rank's stage replica, each global batch run by torch's schedule class (module docstring).

    A :class:`~.runtime.Runtime`. Raises :class:`ConfigError` for a schedule it does not run and for
    CUDA stages on gloo (torch's stages send from the stage's device, which gloo cannot).
    """

    def __init__(self, stage: Stage | Sequence[Stage], *args: Any, **kwargs: Any) -> None:
        """The distributed runtime's arguments (:class:`.distributed.DistributedRuntime`), unchanged."""
        super().__init__(stage, *args, **kwargs)
        if self.spec.torch_class is None:
            why = f"one of {torch_schedule_names()} for torch's schedules"
            raise ConfigError("pipeline.schedule", self.schedule, why)
        if self.wire != self.stage.device:
            raise ConfigError(
                "pipeline.backend",
                dist.get_backend(),
                f"nccl for schedule {self.schedule} on CUDA "
                "stages (torch's schedules send from the stage's device; gloo cannot)",
            )
        self.stream = self.runner.stream
        for runner in self.runners:  # a drained pipeline evaluates: each piece may wait on the next to take its chunks
            runner.evaluator.pending = self.eval_pending(runner.stage.index)
        self.trace: list[Action] = []
        self.tracing = True
        self.busy = 0.0  # compute seconds inside torch's steps (forward, B, W calls), since the run started
        self._losses: list[torch.Tensor] = []
        self.relays = self.loss_place != self.stages - 1  # a V: the last piece is not on the reporter's rank
        self._loss_src = rank_of(self.replica, self.loss_place, self.stages)  # global rank of the last piece
        self._plan: EvalPlan | None = None  # the segment's plan as the trainer gave it (the reporter reports)
        self._held: EvalResult | None = None  # the last piece's evaluation, until relayed
        self._relayed_news = 0  # the reporter's word on the relayed evaluations (REACHED | NEAR)
        self.pipes = [_TracedStage(self, p, c, self.mesh.pp_group) for c, p in enumerate(self.pieces)]
        cls = get_schedule_class(self.spec.torch_class)
        stages: Any = self.pipes if issubclass(cls, PipelineScheduleMulti) else self.pipes[0]
        self.torch_schedule = cls(stages, n_microbatches=self.window, loss_fn=self._loss, scale_grads=False)

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The stage's loss divided by the window, as :meth:`.Stage.forward` does; keeps it unscaled.
        Its time is compute (torch calls it after the forward), as the profile's last unit counts it."""
        t0 = time.perf_counter()
        loss = self.stage.loss_fn(out, target)
        self._losses.append(loss.detach())
        scaled = loss / self.window
        self.busy += time.perf_counter() - t0
        return scaled

    def _torch_step(self, k: int, timing: StageTiming) -> None:
        """Global batch ``k``: one ``step()`` of torch's schedule over its ``a`` micro-batches."""
        st, a = self.stage, self.window
        parts = [self.stream.get(m) for m in range(k * a, (k + 1) * a)]
        args = (torch.cat([x for x, _ in parts]).to(st.device),) if st.is_first else ()
        target = torch.cat([y for _, y in parts]).to(st.device) if self.pieces[-1].is_last else None
        for pipe in self.pipes:
            pipe.first_mb = k * a
        self._losses = []
        busy0, t0 = self.busy, time.perf_counter()
        self.torch_schedule.step(*args, target=target, return_outputs=False)
        if st.device.type == "cuda":
            torch.cuda.synchronize(st.device)
        busy = self.busy - busy0
        timing.busy += busy
        timing.idle += time.perf_counter() - t0 - busy

    @metered
    def warmup(self) -> None:
        """One untraced batch through torch's schedule (its shape inference and buffers included),
        gradients dropped: numerically inert, and timing starts warm."""
        self.tracing = False
        try:
            self._torch_step(0, StageTiming())
        finally:
            self.tracing = True
        for p in self.pieces:
            p.optim.discard_grads()
        self.busy = 0.0

    def _batch_losses(self) -> list[torch.Tensor]:
        """This batch's micro-batch losses where they are collected (the reporter's rank of each pipe):
        the last piece's own, or in a V broadcast from it over the pipe (every rank of the pipe calls)."""
        if not self.relays:
            return self._losses
        here = self.rank == self._loss_src
        t = torch.stack(self._losses).float().to(self.wire) if here else torch.empty(self.window, device=self.wire)
        dist.broadcast(t, src=self._loss_src, group=self.mesh.pp_group)
        return list(t.to(self.device).unbind())

    def _batch_done(self, k: int) -> None:
        """After batch ``k``'s step(): its losses out, each piece's backward and drift counts kept
        (no update ever falls between a micro-batch's forward and backward here: drift 0)."""
        losses = self._batch_losses()
        if self.batch_losses is not None:
            assert len(losses) == self.window
            for i, loss in enumerate(losses):
                self.batch_losses.add(k * self.window + i, loss)
        for st in self.pieces:
            st.backwards += self.window
            if st.trains:
                for _ in range(self.window):
                    st.drift.add(0, 0)

    def _begin(self, program: Program, plan: EvalPlan, on_batch: OnBatch) -> None:
        """As the distributed runtime's; in a V the last piece's evaluations are held for the relay."""
        self._plan, self._held, self._relayed_news = plan, None, 0
        if self.relays and any(p.is_last for p in self.pieces):
            plan = dataclasses.replace(plan, on_eval=self._hold)
        super()._begin(program, plan, on_batch)

    def _hold(self, result: EvalResult) -> int:
        """The last piece's report of an evaluation, kept for :meth:`_relay_eval`; the news comes later."""
        self._held = result
        return 0

    def _relay_eval(self) -> None:
        """After an evaluation point in a V: the last piece's result, if it scored, reaches the reporter's
        rank of the pipe, which reports it; its news joins the next :meth:`_share_news`. The wait for the
        last piece's score is evaluation time, as the last stage's own wait for its inputs is."""
        assert self._plan is not None
        t0 = time.perf_counter()
        held, self._held = self._held, None
        mine = None if held is None else dataclasses.asdict(held)
        got = broadcast_json(mine, src=self._loss_src, group=self.mesh.pp_group)
        if got is not None and self.s == self.stages - 1:
            news = int(self._plan.on_eval(EvalResult(**got)))
            self._relayed_news = news | (self._relayed_news & REACHED)
        spent = time.perf_counter() - t0
        self.runners[-1].eval_seconds += spent
        self._plan.spent(spent)

    def _share_news(self) -> None:
        """Before an evaluation point: every stage of the pipe learns whether any heard the target was
        reached, and the last stage's word on nearness (paci-tune's own runtime carries these on gradients,
        torch's steps carry nothing); in a V the reporter's word on the relayed evaluations."""
        evaluators = [r.evaluator for r in self.runners]
        reached = any(ev.news & REACHED for ev in evaluators) or bool(self._relayed_news & REACHED)
        near = any(ev.news & NEAR for ev in evaluators if ev.stage.is_last) or bool(self._relayed_news & NEAR)
        flags = torch.tensor([int(reached), int(near)], device=self.wire)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
        for ev in evaluators:
            ev.news = (REACHED if flags[0].item() else 0) | (NEAR if flags[1].item() else 0)

    @metered
    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Batches ``first_batch`` on (``n_batches``, or until the plan ends the run), a torch step each.

        1F1B-flush's program gives the segment's shape -- each batch drained, then ``STEP(k)`` and
        maybe ``EVAL(k)``, and an end decided at an evaluation -- and its forwards and backwards are
        replaced by the torch step at the batch's first forward. A step and an evaluation visit the
        rank's pieces in order.
        """
        end = None if n_batches is None else first_batch + n_batches - 1
        program = Program(FLUSH, self.s, self.stages, self.window, first_batch, end, eval_at=plan.eval_at)
        self._begin(program, plan, on_batch)
        mine = StageTiming()
        t0 = time.perf_counter()
        for act in program:
            if act.op is Op.FORWARD and act.mb % self.window == 0:
                k = act.mb // self.window
                self._torch_step(k, mine)
                self._batch_done(k)
            elif act.op is Op.STEP:
                if len(self.trace) < TRACE_LIMIT:
                    self.trace.append(act)
                for runner in self.runners:
                    runner.run(act, mine)
            elif act.op is Op.EVAL:
                self._share_news()
                for runner in self.runners:
                    runner.run(act, mine)
                self.p2p.wait_sends()  # the evaluation's messages only go forward: nothing acknowledges them
                if self.relays:
                    self._relay_eval()
        return self._finish(program, first_batch, mine, t0)
