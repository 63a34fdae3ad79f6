"""The distributed runtime: one process per stage replica, activations and gradients sent point to point.

Each rank walks its own stage's program. Inside a segment there is no collective at all -- in
``paci`` mode stages never wait for each other except for the data they need, evaluations
included (:mod:`.evaluation`) -- and a single ``all_gather`` at the segment's end (the pipeline is
drained there anyway) shares timing so every rank can report the same pipeline makespan. The
program is read a few actions ahead so that receives are posted before they are needed, never
past an evaluation (whose control message may change what follows).

Data parallelism (``pipeline.data_parallel: D``): P x D ranks laid out by :mod:`.mesh`. Point-to-point
traffic stays inside a replica's pipe; the collectives during training are those of one stage's
data-parallel group -- its gradient all-reduce at each of its steps (:mod:`.replicas`), the last
stage's loss sums, and stage 0's broadcast of replica 0's evaluation decision -- so stages still
never wait for each other. Replica 0 scores evaluations and writes checkpoints (the replicas are
identical). Parameters tied across stages: after the replicas' average, this rank's copies are summed
with the other holders of its replica in a small all-reduce of their own group (:mod:`.tied`), so a
holder's step waits for the others' (a flush schedule's do anyway).

Several model chunks per rank (interleaved 1F1B, ZB-V, DualPipeV, run by torch's classes in
:mod:`.torch_schedules`): the rank holds ``v`` :class:`~.stage.Stage` pieces of ``v * P``, where the
schedule's placement puts them (the registry's ``virtual_stage``: ``s, s + P, ...`` looped, ``s`` and
``2P - 1 - s`` in a V), each with its own optimizer, evaluator and checkpoint entry (a piece is a stage
to everything that steps, scores or saves it). The transport addresses virtual stages, each on the
rank the registry's ``holder`` names; at a step the pieces are averaged together and clipped on the
whole model's norm, then step one after another. Evaluations visit the pieces in order (a rank's
pieces rise in model order, so every message a piece needs comes from an earlier piece), so the
rank's links keep one order. The losses are collected where the reporter sits, replica 0's rank
``P - 1``; in a V the last piece is on rank 0, and :mod:`.torch_schedules` relays its losses there.
What the ranks share besides tensors (timings, summary entries, a decision) travels as JSON
(:mod:`.records`), never pickled. May import: torch, the pipeline layer's modules,
:mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Action, Op, Program, schedule_of
from .backend import wire_device
from .evaluation import EvalPlan
from .mesh import build_mesh, rank_of, reporter_rank
from .p2p import EVAL_PENDING, P2P
from .records import all_gather_json, broadcast_json
from .replicas import GradientAllReduce, LossAllReduce
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
from .tied import TiedAllReduce, TiedParameter, mark_counted_elsewhere

LOOKAHEAD = 16
"""Actions of the program read ahead, so their receives are posted early (never past an evaluation)."""


class DistributedRuntime(RuntimeBase):
    """This rank's stage replica of a pipeline of ``stage.stages`` stages x ``replicas`` replicas (:mod:`.mesh`).

    A :class:`~.runtime.Runtime`.
    """

    def __init__(
        self,
        stage: Stage | Sequence[Stage],
        units: list[range],
        stream: MicroBatchStream,
        val: ValidationSet,
        schedule: str,
        inflight: int | None = None,
        replicas: int = 1,
        tied: list[TiedParameter] | None = None,
    ) -> None:
        """``stage``: this rank's stage, or its pieces in chunk order (where the schedule's placement puts
        them: virtual stages ``s, s + P, ...``, or ``s`` and ``2P - 1 - s``)."""
        pieces = [stage] if isinstance(stage, Stage) else list(stage)
        first = pieces[0]
        super().__init__(first, units, val, schedule, inflight)
        self.spec = schedule_of(schedule)
        self.pieces = pieces
        self.stages = first.stages // len(pieces)  # ranks in the pipe (pieces count v times as many stages)
        self.stage, self.rank, self.s = first, dist.get_rank(), first.index
        self.wire = wire_device(dist.get_backend(), first.device)
        self.mesh = build_mesh(self.stages, replicas, "cuda" if self.wire.type == "cuda" else "cpu")
        assert self.mesh.stage == self.s, f"rank {self.rank} holds stage {self.mesh.stage}, not {self.s}"
        placed = [self.spec.virtual_stage(self.s, c, self.stages) for c in range(len(pieces))]
        assert [p.index for p in pieces] == placed, f"rank {self.rank} holds pieces {placed}"
        self.replica, self.n_replicas = self.mesh.replica, replicas
        ranks = self.mesh.pipe_ranks
        loops = self.spec.forward_loops(self.stages, len(pieces))
        self.p2p = P2P(
            [ranks[self.spec.holder(j, self.stages)[0]] for j in range(first.stages)],
            first.device,
            max_pending=None if loops else 64,
        )
        self.loss_place = self.spec.holder(first.stages - 1, self.stages)[0]  # the pipe's rank with the last piece
        self.batch_losses: BatchLosses | None = None  # where this segment's losses are collected (rank P - 1)
        self.runners = [ActionRunner(p, self.p2p, stream, val) for p in pieces]
        self.runner = self.runners[0]
        for runner in self.runners:
            runner.evaluator.scores = self.replica == 0  # the replicas' weights are the same
        self._norm: tuple[int, float] | None = None  # (batch, the whole model's norm) at the step
        if self.clips_whole_model:
            for runner in self.runners:
                runner.global_grad_norm = self._global_grad_norm
        self.grads: dict[int, GradientAllReduce] = {}  # by piece index
        self.losses: LossAllReduce | None = None
        if replicas > 1:  # a piece with nothing to train all-reduces nothing
            self.grads = {
                p.index: GradientAllReduce(self.mesh.dp_group, replicas, self.wire, p.optim) for p in pieces if p.trains
            }
        tied = tied or []
        if len(pieces) > 1 and any(t.trainable for t in tied):
            raise ValueError("a trainable parameter tied across pieces needs one stage per rank (refused up front)")
        for p in pieces:
            mark_counted_elsewhere(p, tied)
        self.tied = TiedAllReduce(first, tied, self.stages, replicas, self.replica, self.wire)
        if replicas > 1 or self.tied.parts:
            self.runner.grad_sync = self._grad_sync  # the first piece's step syncs them all
        self._meter(pieces)  # this rank's pieces: the summary's peak_allocated_bytes is per stage process

    def _grad_sync(self, batch: int) -> None:
        """At this stage's step: average the window's gradients over the stage's replicas (every piece's),
        sum its tied parameters' over their holders; collect losses."""
        for grads in self.grads.values():
            grads.average()
        self.tied.sum()
        if self.losses is not None:
            self.losses.collect()

    def _global_grad_norm(self, batch: int) -> float:
        """The whole model's gradient norm: every stage of this replica adds its own (flush schedules step
        together); taken once per step, before the rank's first piece steps, for all its pieces."""
        if self._norm is None or self._norm[0] != batch:
            sq = torch.tensor([sum(p.grad_sq_norm() for p in self.pieces)], dtype=torch.float64, device=self.device)
            dist.all_reduce(sq, group=self.mesh.pp_group)
            self._norm = (batch, float(sq.item()) ** 0.5)
        return self._norm[1]

    @property
    def is_reporter(self) -> bool:
        """Replica 0's last stage sees the losses, so it reports progress and writes the metrics."""
        return self.rank == reporter_rank(self.stages)

    @property
    def local_stages(self) -> list[int]:
        return [p.index for p in self.pieces]

    @metered
    def warmup(self) -> None:
        for act in self._warmup_actions(self.s):
            run_warmup_action(self.runner, act)
        self.p2p.wait_all()

    def _agreed(self, plan: EvalPlan) -> EvalPlan:
        """Stage 0 of every replica takes replica 0's evaluation decision (broadcast in stage 0's group)."""
        if self.n_replicas == 1 or self.s != 0:
            return plan

        def control(k: int, news: int) -> tuple[bool, bool]:
            decision = plan.control(k, news) if self.replica == 0 else (False, False)
            t = torch.tensor([int(v) for v in decision], dtype=torch.int64, device=self.wire)
            dist.broadcast(t, src=rank_of(0, 0, self.stages), group=self.mesh.dp_group)
            return bool(t[0]), bool(t[1])

        return dataclasses.replace(plan, control=control)

    @metered
    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Batches ``first_batch`` on (``n_batches``, or until the plan ends the run), drained at the end."""
        program = self._program(self.s, first_batch, n_batches, plan)
        self._begin(program, plan, on_batch)
        actions = iter(program)
        ahead: deque[Action] = deque()
        mine = StageTiming()
        t0 = time.perf_counter()
        while True:
            while len(ahead) < LOOKAHEAD and not (ahead and ahead[-1].op is Op.EVAL):
                act = next(actions, None)
                if act is None:
                    break
                ahead.append(act)
                self._announce(act)
            if not ahead:
                break
            act = ahead.popleft()
            if self.s in self.grads and act.op is Op.BACKWARD and (act.mb + 1) % self.window == 0:
                self.grads[self.s].arm()  # the window's last backward: its buckets go out as they are done
            self.runner.run(act, mine)
        return self._finish(program, first_batch, mine, t0)

    def _begin(self, program: Program, plan: EvalPlan, on_batch: OnBatch) -> None:
        """Start a segment: the runners on ``program``, and where the last stage's losses go."""
        agreed = self._agreed(plan)
        for runner in self.runners:
            runner.begin(program, agreed)
        self.batch_losses = None
        if self.s == self.stages - 1 and self.n_replicas == 1:  # the reporter's place in the pipe
            self.batch_losses = BatchLosses(self.window, on_batch)
        elif self.s == self.stages - 1:
            self.losses = LossAllReduce(
                self.mesh.dp_group, self.n_replicas, self.wire, on_batch if self.is_reporter else None
            )
            self.batch_losses = BatchLosses(self.window, self.losses.add)
        last = self.runners[-1]
        if last.stage.is_last:
            last.losses = self.batch_losses  # None where a V puts the last piece elsewhere (relayed)

    def _finish(self, program: Program, first_batch: int, mine: StageTiming, t0: float) -> SegmentReport:
        """End a segment started at ``t0``: drained, its timing shared, the same report on every rank."""
        self.p2p.wait_all()
        if self.losses is not None:
            self.losses.collect()
        eval_seconds = sum(r.eval_seconds for r in self.runners)
        mine.span = time.perf_counter() - t0 - eval_seconds
        everyone = [StageTiming(**t) for t in all_gather_json(dataclasses.asdict(mine))]
        makespan = max(t.span for t in everyone)  # the slowest replica sets the pace of the global batch
        timings = [everyone[rank_of(0, s, self.stages)] for s in range(self.stages)]  # replica 0's stages
        for t in timings:
            t.idle = makespan - t.busy
        assert program.end is not None
        return SegmentReport(program.end - first_batch + 1, mine.span, makespan, timings, eval_seconds)

    def _announce(self, act: Action) -> None:
        """Post the receive ``act`` will need (activations and evaluations from the left, gradients from the right)."""
        s = self.s
        if act.op is Op.FORWARD and s > 0:
            self.p2p.expect(s - 1, [("act", act.mb)])
        elif act.op is Op.EVAL and s > 0:
            self.p2p.expect(s - 1, [("ctl", act.mb)])
        elif act.op is Op.BACKWARD and s < self.stages - 1:
            self.p2p.expect(s + 1, [("grad", act.mb)])

    def eval_pending(self, piece: int) -> int | None:
        """Validation outputs piece ``piece`` leaves in flight to the next (:data:`.p2p.EVAL_PENDING`); None:
        all, on the link of a looped placement's circle that must not wait (the registry's ``wraps``)."""
        last = self.stages * len(self.pieces) - 1
        return None if piece < last and self.spec.wraps(piece, self.stages) else EVAL_PENDING

    @metered
    @torch.no_grad()
    def evaluate(self) -> float:
        """Pipeline the validation set forward in replica 0 (drained), piece after piece; its mean loss is
        shared with all ranks."""
        losses = []
        for st in self.pieces if self.replica == 0 else []:
            j = st.index
            for i in range(len(self.val)):
                x, y = self.val.get(i)
                h = x if st.is_first else self.p2p.recv(j - 1, j, "eval", -1 - i)[0]
                out = st.evaluate(h, y if st.is_last else None)
                if st.is_last:
                    losses.append(float(out))
                else:
                    self.p2p.send(j, j + 1, "eval", -1 - i, out)
                    if (pending := self.eval_pending(j)) is not None:
                        self.p2p.settle(j + 1, pending)
        self.p2p.wait_all()
        src = rank_of(0, self.loss_place, self.stages)  # replica 0's last piece
        mine = self.val.mean_loss(losses) if self.rank == src else None
        return float(broadcast_json(mine, src=src))

    def share(self, value: object) -> object:
        """The reporting rank's ``value``, on every rank."""
        return broadcast_json(value, src=reporter_rank(self.stages))

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any (e.g. the time budget ran out somewhere)."""
        t = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def state_dicts(self) -> dict[int, dict]:
        """This rank's pieces' states from replica 0 only: the replicas are identical, one file per (virtual)
        stage is the checkpoint."""
        return {p.index: p.state_dict() for p in self.pieces} if self.replica == 0 else {}

    def load_state_dicts(self, states: dict[int, dict]) -> None:
        for p in self.pieces:
            p.load_state_dict(states[p.index])

    def stats(self, timing: list[StageTiming], makespan: float) -> list[dict]:
        """Every (virtual) stage's summary entry, in order (replica 0's: the replicas' drift is the same), the
        same list on each rank. A piece's timing is its rank's: the rank's busy and idle are what it did."""
        mine = [self._stage_entry(p, timing[self.s], makespan) for p in self.pieces]
        if len(self.pieces) > 1:  # which rank ran the piece
            for entry in mine:
                entry["pipe_stage"] = self.s
        for entry in mine:  # the all-reduce's exposed part, since the run (or resume) started
            if entry["stage"] in self.grads:
                entry["allreduce_wait_s"] = round(self.grads[entry["stage"]].waited_s, 6)
        out = all_gather_json(mine)
        return sorted((e for o in out[: self.stages] for e in o), key=lambda e: e["stage"])

    def close(self) -> None:
        self.p2p.wait_all()
