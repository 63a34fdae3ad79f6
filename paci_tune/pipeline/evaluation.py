"""Evaluation inside the pipeline: the model after update k scored without draining anything.

A stage reaches ``EVAL(k)`` in its program (:mod:`paci_tune.schedule.program`) and scores the
validation set with its weights after update ``k``: its current ones, or, where it stepped again
first, the copy that later step made of them (the stage's weight versions, :mod:`.versions`, the
same store -- and the same copy -- that in-flight backwards of ``forward`` mode read). Stage 0
starts each evaluation with a control message, which every stage reads, extends with the weights
it scored and passes on before the activations:

- whether to evaluate at this point at all (on the wall clock the points are candidates, and stage 0
  decides by its clock), and
- whether the run ends here (a target reached, a wall-clock budget spent): then every stage ends its
  program after the batches already started (:meth:`~paci_tune.schedule.program.Program.set_end`).

News travels the other way, as bits of a flag on the gradients, from the last stage (which computes
the loss) to stage 0 (which decides): that the target was reached (:data:`REACHED`, kept once heard),
and whether the validations are now near the target (:data:`NEAR`, the last stage's latest word: the
run then validates at every evaluation point, not only the far ones, :mod:`paci_tune.train.nearness`).
Both runtimes run this code through their transport, so they take the same decisions at the same points
and train the same numbers.
Evaluation changes no training state, whatever the cadence.

Data parallelism: the D replicas of a stage hold the same weights, so replica 0 alone scores
(``scores=False`` elsewhere) and its result is D=1's for the same weights, on the same validation
set. Every replica still runs the control message through its own pipe, so all end where replica
0's stage 0 decided (the runtimes hand the other replicas' stage 0 that decision). May import: torch, :mod:`.stage`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ..data.stream import ValidationSet
from ..schedule import Program
from .stage import Stage

if TYPE_CHECKING:
    from ..schedule.program import EvalAt


class Transport(Protocol):
    """Moves a tensor from one stage to a neighbour; ``kind`` is "act", "grad", "ctl" or "eval".

    ``flag`` rides along with the tensor (the news bits on gradients: :data:`REACHED`, :data:`NEAR`).
    """

    def send(self, src: int, dst: int, kind: str, mb: int, tensor: torch.Tensor, flag: int = 0) -> None: ...

    def recv(self, src: int, dst: int, kind: str, mb: int) -> tuple[torch.Tensor, int]: ...

    def expect(self, src: int, items: list[tuple[str, int]]) -> None: ...

    def settle(self, dst: int, payloads: int) -> None: ...


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the model after the step closing global batch ``batch``."""

    batch: int
    val_loss: float
    updates: list[int]  # optimizer updates applied to the weights each stage scored
    snapshots: list[bool]  # whether each stage scored a snapshot (it had stepped again first)


REACHED = 1
"""News bit: the target was reached (kept once heard: the run ends)."""
NEAR = 2
"""News bit: the last validations are near the target (the last stage's latest word, not kept)."""


def merge_news(mine: int, heard: int) -> int:
    """A stage's news after hearing ``heard`` from downstream: REACHED kept once heard, NEAR the latest word."""
    return ((mine | heard) & REACHED) | (heard & NEAR)


def _evaluate_always(batch: int, news: int) -> tuple[bool, bool]:
    return True, bool(news & REACHED)


@dataclass
class EvalPlan:
    """What a segment evaluates and who decides; the same on every rank.

    ``eval_at(k)``: the evaluation points (candidates on the wall clock, or where the target may be near).
    ``control(k, news)``, at stage 0: ``(evaluate now, end the run here)``, ``news`` the bits stage 0 has
    heard (:data:`REACHED`, :data:`NEAR`). ``on_eval(result)``, at the last stage: report, and give the
    news bits (True: the target is reached). ``news``: every stage's bits when the segment starts (a
    resumed run's NEAR, which no gradient has carried yet). ``on_end(batch)``: the run will end after
    ``batch`` (every stage hears it).
    ``spent(seconds)``: time this process just spent evaluating (the wall clock leaves it out).
    """

    eval_at: EvalAt
    control: Callable[[int, int], tuple[bool, bool]] = _evaluate_always
    on_eval: Callable[[EvalResult], int] = field(default=lambda r: 0)
    on_end: Callable[[int], None] = field(default=lambda batch: None)
    spent: Callable[[float], None] = field(default=lambda seconds: None)
    news: int = 0


class StageEvaluator:
    """One stage's part of every in-pipeline evaluation (module docstring)."""

    def __init__(self, stage: Stage, transport: Transport, val: ValidationSet) -> None:
        self.stage, self.transport, self.val = stage, transport, val
        self.news = 0  # REACHED | NEAR bits (heard on a gradient, or seen here on the last stage)
        self.scores = True  # False on data-parallel replicas other than 0: they pass the control message only
        self.pending: int | None = None  # sends of validation chunks left pending (None: the transport's cap)
        self.program: Program | None = None
        self.plan: EvalPlan | None = None
        self._awaiting: dict[int, int] = {}  # evaluation point stepped here -> the weight version it scores

    def begin(self, program: Program, plan: EvalPlan) -> None:
        self.program, self.plan = program, plan
        self.news = plan.news
        for k in list(self._awaiting):
            self._drop(k)

    # ----------------------------------------------------------------------------- versions
    def _drop(self, k: int) -> None:
        version = self._awaiting.pop(k)
        if self.scores:
            self.stage.versions.release(version, evaluation=True)

    def after_step(self, batch: int) -> None:
        """After the step closing ``batch``: an evaluation of it holds these weights until it runs."""
        if self.program is not None and self.program.evaluates(batch):
            self._awaiting[batch] = self.stage.updates
            if self.scores:
                self.stage.versions.hold(self.stage.updates, evaluation=True)

    # ---------------------------------------------------------------------------- the action
    def run(self, k: int) -> None:
        """``EVAL(k)`` at this stage: control message, forwards of the validation chunks, the loss."""
        assert self.program is not None and self.plan is not None
        st, s, tr = self.stage, self.stage.index, self.transport
        if st.is_first:
            evaluate, end_here = self.plan.control(k, self.news)
            end = self.program.end_if_decided_at(k) if end_here else -1
            ctl = [int(evaluate), end]
        else:
            got, _ = tr.recv(s - 1, s, "ctl", k)
            ctl = [int(v) for v in got.tolist()]
        version = self._awaiting[k]
        weights = st.versions.weights(version) if self.scores else None
        ctl += [version, int(version != st.updates)]
        if not st.is_last:
            tr.send(s, s + 1, "ctl", k, torch.tensor(ctl, dtype=torch.int64))
        if ctl[1] >= 0:
            self.program.set_end(ctl[1], k)
            self.plan.on_end(ctl[1])
            for j in [j for j in self._awaiting if j > k]:  # evaluations the end dropped
                self._drop(j)
        try:
            if ctl[0] and self.scores:
                self._score(k, ctl, weights)
        finally:
            self._drop(k)

    def _score(self, k: int, ctl: list[int], weights: dict[str, torch.Tensor] | None) -> None:
        """This stage's forwards of the validation set at evaluation ``k`` (the loss, on the last stage)."""
        st, s, tr = self.stage, self.stage.index, self.transport
        n = len(self.val)
        if not st.is_first:
            tr.expect(s - 1, [("eval", k * n + i) for i in range(n)])
        losses = []
        for i in range(n):
            x, y = self.val.get(i)
            h = x if st.is_first else tr.recv(s - 1, s, "eval", k * n + i)[0]
            out = st.evaluate(h, y if st.is_last else None, weights)
            if st.is_last:
                losses.append(float(out))
            else:
                tr.send(s, s + 1, "eval", k * n + i, out)
                if self.pending is not None:
                    tr.settle(s + 1, self.pending)
        if st.is_last:
            result = EvalResult(k, self.val.mean_loss(losses), ctl[2::2], [bool(v) for v in ctl[3::2]])
            self.news = int(self.plan.on_eval(result)) | (self.news & REACHED)
