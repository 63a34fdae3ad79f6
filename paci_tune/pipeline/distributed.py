"""The distributed runtime: one process per stage, activations and gradients sent point to point.

Each rank walks its own stage's program. Inside a segment there is no collective at all -- in
``paci`` mode stages never wait for each other except for the data they need, evaluations
included (:mod:`.evaluation`) -- and a single ``all_gather`` at the segment's end (the pipeline is
drained there anyway) shares timing so every rank can report the same pipeline makespan. The
program is read a few actions ahead so that receives are posted before they are needed, never
past an evaluation (whose control message may change what follows). May import: torch, the pipeline layer's modules,
:mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Action, Op, Program, inflight_cap
from .evaluation import EvalPlan
from .p2p import P2P
from .runtime import (
    ActionRunner,
    BatchLosses,
    OnBatch,
    SegmentReport,
    StageTiming,
    run_warmup_action,
    stage_stats,
    warmup_actions,
)
from .stage import Stage

LOOKAHEAD = 16
"""Actions of the program read ahead, so their receives are posted early (never past an evaluation)."""


class DistributedRuntime:
    """This rank's stage of a pipeline that spans ``world_size`` processes (stage s on rank s)."""

    def __init__(
        self,
        stage: Stage,
        units: list[range],
        stream: MicroBatchStream,
        val: ValidationSet,
        schedule: str,
        inflight: int | None = None,
    ) -> None:
        self.stage, self.units, self.val = stage, units, val
        self.schedule, self.inflight = schedule, inflight
        self.rank, self.n_stages = dist.get_rank(), dist.get_world_size()
        self.window = stage.window
        self.device = stage.device
        self.p2p = P2P(list(range(self.n_stages)), stage.device)
        self.runner = ActionRunner(stage, self.p2p, stream, val)
        if schedule != "paci" and stage.grad_clip:
            self.runner.global_grad_norm = self._global_grad_norm

    def _global_grad_norm(self, batch: int) -> float:
        """The whole model's gradient norm: every stage adds its own (flush schedules step together)."""
        sq = torch.tensor([self.stage.grad_sq_norm()], dtype=torch.float64, device=self.device)
        dist.all_reduce(sq)
        return float(sq.item()) ** 0.5

    @property
    def is_reporter(self) -> bool:
        """The last stage sees the losses, so it reports progress and writes the metrics."""
        return self.rank == self.n_stages - 1

    @property
    def local_stages(self) -> list[int]:
        return [self.rank]

    def warmup(self) -> None:
        n = inflight_cap(self.schedule, 0, self.n_stages, self.window, self.inflight)
        for act in warmup_actions(self.rank, self.n_stages, n):
            run_warmup_action(self.runner, act)
        self.p2p.wait_all()

    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Batches ``first_batch`` on (``n_batches``, or until the plan ends the run), drained at the end."""
        end = None if n_batches is None else first_batch + n_batches - 1
        program = Program(self.schedule, self.rank, self.n_stages, self.window, first_batch, end,
                          inflight=self.inflight, eval_at=plan.eval_at)  # fmt: skip
        self.runner.begin(program, plan)
        if self.stage.is_last:
            self.runner.losses = BatchLosses(self.window, on_batch)
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
            self.runner.run(ahead.popleft(), mine)
        self.p2p.wait_all()
        mine.span = time.perf_counter() - t0 - self.runner.eval_seconds
        gathered: list[StageTiming | None] = [None] * self.n_stages
        dist.all_gather_object(gathered, mine)
        timings = [t for t in gathered if t is not None]
        makespan = max(t.span for t in timings)
        for t in timings:
            t.idle = makespan - t.busy
        assert program.end is not None
        return SegmentReport(program.end - first_batch + 1, mine.span, makespan, timings, self.runner.eval_seconds)

    def _announce(self, act: Action) -> None:
        """Post the receive ``act`` will need (activations and evaluations from the left, gradients from the right)."""
        s = self.rank
        if act.op is Op.FORWARD and s > 0:
            self.p2p.expect(s - 1, [("act", act.mb)])
        elif act.op is Op.EVAL and s > 0:
            self.p2p.expect(s - 1, [("ctl", act.mb)])
        elif act.op is Op.BACKWARD and s < self.n_stages - 1:
            self.p2p.expect(s + 1, [("grad", act.mb)])

    @torch.no_grad()
    def evaluate(self) -> float:
        """Pipeline the validation set forward (drained); the last rank's mean loss is shared with all ranks."""
        st, s = self.stage, self.rank
        losses = []
        for i in range(len(self.val)):
            x, y = self.val.get(i)
            h = x if st.is_first else self.p2p.recv(s - 1, s, "eval", -1 - i)[0]
            out = st.evaluate(h, y if st.is_last else None)
            if st.is_last:
                losses.append(float(out))
            else:
                self.p2p.send(s, s + 1, "eval", -1 - i, out)
        self.p2p.wait_all()
        return float(self.share(self.val.mean_loss(losses) if st.is_last else None))

    def share(self, value: object) -> object:
        """The reporting (last) rank's ``value``, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=self.n_stages - 1)
        return box[0]

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any (e.g. the time budget ran out somewhere)."""
        t = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def state_dicts(self) -> dict[int, dict]:
        return {self.rank: self.stage.state_dict()}

    def load_state_dicts(self, states: dict[int, dict]) -> None:
        self.stage.load_state_dict(states[self.rank])

    def stats(self, timing: list[StageTiming], makespan: float) -> list[dict]:
        """Every stage's summary entry, gathered from all ranks (the same list on each)."""
        mine = stage_stats(self.stage, timing[self.rank], makespan, self.units[self.rank], self.device, self.schedule)
        out: list[dict | None] = [None] * self.n_stages
        dist.all_gather_object(out, mine)
        return [o for o in out if o is not None]

    def close(self) -> None:
        self.p2p.wait_all()
