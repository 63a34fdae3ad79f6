"""The distributed runtime: one process per stage, activations and gradients sent point to point.

Each rank walks its own stage's action list. Inside a segment there is no collective at all --
in ``paci`` mode stages never wait for each other except for the data they need -- and a single
``all_gather`` at the segment's end (the pipeline is drained there anyway) shares timing so every
rank can report the same pipeline makespan. May import: torch, the pipeline layer's modules,
:mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import Op, inflight_cap, stage_actions
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
        self.runner = ActionRunner(stage, self.p2p, stream)
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

    def run_segment(self, first_batch: int, n_batches: int, on_batch: OnBatch) -> SegmentReport:
        actions = stage_actions(
            self.schedule, self.rank, self.n_stages, self.window, first_batch, n_batches, self.inflight
        )
        if self.stage.is_last:
            self.runner.losses = BatchLosses(self.window, on_batch)
        if not self.stage.is_first:
            self.p2p.expect(self.rank - 1, "act", [a.mb for a in actions if a.op is Op.FORWARD])
        if not self.stage.is_last:
            self.p2p.expect(self.rank + 1, "grad", [a.mb for a in actions if a.op is Op.BACKWARD])
        mine = StageTiming()
        t0 = time.perf_counter()
        for act in actions:
            self.runner.run(act, mine)
        self.p2p.wait_all()
        mine.span = time.perf_counter() - t0
        gathered: list[StageTiming | None] = [None] * self.n_stages
        dist.all_gather_object(gathered, mine)
        timings = [t for t in gathered if t is not None]
        makespan = max(t.span for t in timings)
        for t in timings:
            t.idle = makespan - t.busy
        return SegmentReport(n_batches, mine.span, makespan, timings)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Pipeline the validation set forward; the last rank's mean loss is shared with all ranks."""
        st, s = self.stage, self.rank
        total = 0.0
        for i in range(len(self.val)):
            x, y = self.val.get(i)
            h = x if st.is_first else self.p2p.recv(s - 1, s, "act", -1 - i)
            out = st.evaluate(h, y if st.is_last else None)
            if st.is_last:
                total += float(out)
            else:
                self.p2p.send(s, s + 1, "act", -1 - i, out)
        self.p2p.wait_all()
        box = [total / len(self.val)]
        dist.broadcast_object_list(box, src=self.n_stages - 1)
        return float(box[0])

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
