"""What both runtimes share: their contract, executing one stage's actions, timing them, collecting losses.

A runtime is the thing that moves activations and gradients between stages. The emulated one
keeps every stage in this process and hands tensors over through a mailbox; the distributed
one sends them point to point between processes. What the training loop may ask of either is
:class:`Runtime`. Everything else -- what an action does to a stage (an evaluation's part is
:mod:`.evaluation`'s), how long it took, how a global batch's loss is assembled, what a stage's
program, warm-up and summary entry are (:class:`RuntimeBase`) -- lives here, once. May import:
torch, :mod:`.stage`, :mod:`.evaluation`, :mod:`paci_tune.schedule`, :mod:`paci_tune.data`.
"""

from __future__ import annotations

import functools
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from ..data.stream import MicroBatchStream, ValidationSet
from ..schedule import FLUSH, Action, Op, Program, copies_bound, drift_bound, inflight_cap, schedule_of, stage_actions
from .evaluation import EvalPlan, StageEvaluator, Transport, merge_news
from .meter import StageMeter
from .stage import Stage

OnBatch = Callable[[int, float], None]
F = TypeVar("F", bound=Callable[..., Any])

WARMUP_MB = -(10**9)
"""Micro-batch key of the warm-up pass (training micro-batches are >= 0, a drained evaluation's -1, -2, ...)."""


@dataclass
class StageTiming:
    """Seconds a stage computed (busy) and waited for a neighbour (idle) within training segments."""

    busy: float = 0.0
    idle: float = 0.0
    span: float = 0.0

    def add(self, other: StageTiming) -> None:
        self.busy += other.busy
        self.idle += other.idle
        self.span += other.span


@dataclass
class SegmentReport:
    """Timing of one drained segment of the schedule, identical on every rank.

    Evaluation inside the segment is not training: ``wall``, ``makespan`` and the stages' timing
    leave it out, and ``eval_seconds`` is what it took here.
    """

    batches: int  # global batches run (fewer than asked when the run ended on the way)
    wall: float  # seconds this process spent training in the segment
    makespan: float  # seconds the pipeline took (replayed for the emulated runtime)
    stages: list[StageTiming] = field(default_factory=list)
    eval_seconds: float = 0.0


class Runtime(Protocol):
    """What the training loop (:class:`paci_tune.train.loop.Trainer`) may ask of a runtime.

    SPMD: the loop runs on every process of the run, and calls these on every process in the same
    order; a method that needs the other processes (a collective) returns only once they all called
    it. The emulated runtime is one process holding every stage; the distributed one, one per rank.
    """

    @property
    def is_reporter(self) -> bool:
        """True on the one process that sees the losses, reports progress and writes the records."""
        ...

    @property
    def local_stages(self) -> list[int]:
        """Indices of the stages whose state this process holds (what it saves and loads)."""
        ...

    def warmup(self) -> None:
        """One numerically inert pass at the run's in-flight depth, so timing starts warm; drained after."""
        ...

    def run_segment(self, first_batch: int, n_batches: int | None, on_batch: OnBatch, plan: EvalPlan) -> SegmentReport:
        """Train global batches ``first_batch`` on, drained at the end, and report the segment's timing.

        ``n_batches``: how many (``None``: until ``plan`` ends the run). ``on_batch(k, loss)`` is called
        on the reporting process as each batch's loss is complete; ``plan`` says where evaluations go.
        """
        ...

    def evaluate(self) -> float:
        """The drained pipeline's mean validation loss, the same on every process."""
        ...

    def agree(self, flag: bool) -> bool:
        """True on every process if ``flag`` is true on any."""
        ...

    def share(self, value: object) -> object:
        """The reporting process's ``value``, on every process."""
        ...

    def barrier(self) -> None:
        """Return once every process got here."""
        ...

    def state_dicts(self) -> dict[int, dict]:
        """Checkpoint state by stage index: this process's part of one copy of every stage (maybe none)."""
        ...

    def load_state_dicts(self, states: dict[int, dict]) -> None:
        """Restore every stage this process holds from ``states`` (keyed as :meth:`state_dicts`)."""
        ...

    def stats(self, timing: list[StageTiming], makespan: float) -> list[dict]:
        """Every stage's summary entry, in stage order, the same list on every process, given the run's timing."""
        ...

    def close(self) -> None:
        """The run is over: wait for what is still in flight (nothing may run after)."""
        ...


class BatchLosses:
    """Sums the last stage's micro-batch losses into global-batch losses, reported when complete."""

    def __init__(self, window: int, on_batch: OnBatch) -> None:
        self.window, self.on_batch = window, on_batch
        self._parts: dict[int, list[torch.Tensor]] = {}

    def add(self, mb: int, loss: torch.Tensor) -> None:
        k = mb // self.window
        parts = self._parts.setdefault(k, [])
        parts.append(loss)
        if len(parts) == self.window:
            del self._parts[k]
            self.on_batch(k, float(torch.stack(parts).mean()))


class ActionRunner:
    """Executes one stage's actions through a transport, timing compute apart from waiting."""

    def __init__(self, stage: Stage, transport: Transport, stream: MicroBatchStream, val: ValidationSet) -> None:
        self.stage, self.transport, self.stream = stage, transport, stream
        self.evaluator = StageEvaluator(stage, transport, val)
        self.losses: BatchLosses | None = None
        self.global_grad_norm: Callable[[int], float] | None = None  # set when steps clip the model's norm
        self.grad_sync: Callable[[int], None] | None = None  # set under data parallelism: average the replicas
        self.eval_seconds = 0.0
        self._batch_cache: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._sync = stage.device.type == "cuda"

    def begin(self, program: Program, plan: EvalPlan) -> None:
        """Start a segment: the stage's program and how its evaluations are decided and reported."""
        self.evaluator.begin(program, plan)
        self.eval_seconds = 0.0

    def _data(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batch_cache is None or self._batch_cache[0] != mb:
            self._batch_cache = (mb, self.stream.get(mb))
        return self._batch_cache[1]

    def run(self, act: Action, timing: StageTiming) -> float:
        """Run ``act``; add its compute and wait time to ``timing``; return the compute seconds.

        An evaluation adds nothing to ``timing`` and returns 0: its time goes to :attr:`eval_seconds`.
        """
        st, s, tr = self.stage, self.stage.index, self.transport
        t0 = time.perf_counter()
        if act.op is Op.EVAL:
            self.evaluator.run(act.mb)
            if self._sync:
                torch.cuda.synchronize(st.device)
            spent = time.perf_counter() - t0
            self.eval_seconds += spent
            assert self.evaluator.plan is not None
            self.evaluator.plan.spent(spent)
            return 0.0
        if act.op is Op.FORWARD:
            if st.is_first:
                t1 = t0  # reading the data is this stage's work, not waiting
                x = self._data(act.mb)[0]
            else:
                x = tr.recv(s - 1, s, "act", act.mb)[0]
                t1 = time.perf_counter()
            out = st.forward(act.mb, x, self._data(act.mb)[1] if st.is_last else None)
            if st.is_last:
                assert self.losses is not None
                self.losses.add(act.mb, out)
            else:
                tr.send(s, s + 1, "act", act.mb, out)
        elif act.op is Op.BACKWARD:
            g = None
            if not st.is_last:
                g, news = tr.recv(s + 1, s, "grad", act.mb)
                self.evaluator.news = merge_news(self.evaluator.news, news)
            t1 = time.perf_counter()
            gin = st.backward(act.mb, g)
            if not st.is_first:
                assert gin is not None
                tr.send(s, s - 1, "grad", act.mb, gin, self.evaluator.news)
        else:
            if self.grad_sync is not None:
                self.grad_sync(act.mb)  # before any norm: clipping sees the averaged gradients
            norm = self.global_grad_norm(act.mb) if self.global_grad_norm is not None else None
            t1 = time.perf_counter()  # waiting for the replicas' gradients or other stages' norms is not compute
            st.step(norm)
            self.evaluator.after_step(act.mb)
        if self._sync:
            torch.cuda.synchronize(st.device)
        t2 = time.perf_counter()
        timing.idle += t1 - t0
        timing.busy += t2 - t1
        return t2 - t1


def warmup_actions(stage: int, stages: int, inflight: int) -> list[Action]:
    """A 1F1B pass over ``inflight`` micro-batches with no optimizer step: the warm-up's actions.

    Each stage then holds as many micro-batches in flight as it will in the run, so allocator
    growth for all of them, lazy initialisation and cold caches are paid before timing starts
    (the first micro-batches run up to 8x slower on CPU; left in the timed run they would be
    booked as pipeline bubble at the neighbouring stage).
    """
    acts = stage_actions(FLUSH, stage, stages, inflight, 0, 1)
    return [a for a in acts if a.op is not Op.STEP]


def run_warmup_action(runner: ActionRunner, act: Action) -> None:
    """One warm-up action: real data, numerically inert (gradients dropped, nothing recorded)."""
    st, s, key = runner.stage, runner.stage.index, WARMUP_MB - act.mb
    if act.op is Op.FORWARD:
        x, y = runner.stream.get(act.mb)
        h = x if st.is_first else runner.transport.recv(s - 1, s, "act", key)[0]
        out = st.forward(key, h, y if st.is_last else None)
        if not st.is_last:
            runner.transport.send(s, s + 1, "act", key, out)
    else:
        g = None if st.is_last else runner.transport.recv(s + 1, s, "grad", key)[0]
        gin = st.backward(key, g, warmup=True)
        if not st.is_first:
            assert gin is not None
            runner.transport.send(s, s - 1, "grad", key, gin)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def metered(method: F) -> F:
    """Run a runtime's method (warm-up, segment, evaluation) inside its :attr:`RuntimeBase.meter`."""

    @functools.wraps(method)
    def wrapper(self: RuntimeBase, *args: Any, **kwargs: Any) -> Any:
        with self.meter.active():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def stage_stats(
    stage: Stage,
    timing: StageTiming,
    makespan: float,
    units: range,
    device: torch.device,
    schedule: str,
    inflight: int | None = None,
    peak_allocated: int | None = None,
) -> dict:
    """The per-stage entry of the run summary (flush schedules cross no update: their bound is 0).

    ``trains: false`` marks a stage with nothing to train: no step, so nothing to drift (bound 0).
    ``peak_allocated_bytes``: the peak of allocated tensor bytes where this stage ran (its process's
    :class:`~.meter.StageMeter`: CUDA's counter, or the CPU meter when asked for; None when not
    measured); ``peak_memory_bytes`` stays the process's peak resident set on the CPU.
    """
    paci = schedule_of(schedule).asynchronous and stage.trains
    return {
        "stage": stage.index,
        "units": [units.start, units.stop],
        "busy_s": timing.busy,
        "idle_s": max(makespan - timing.busy, 0.0),
        "wait_s": timing.idle,
        "bubble_fraction": 0.0 if makespan <= 0 else max(1.0 - timing.busy / makespan, 0.0),
        "trains": stage.trains,
        "updates": stage.updates,
        "max_drift": stage.drift.maximum,
        "mean_drift": stage.drift.mean,
        "drift_bound": drift_bound(stage.index, stage.stages, stage.window) if paci else 0,
        "drift_histogram": {str(k): v for k, v in sorted(stage.drift.histogram.items())},
        "read_ahead_histogram": {str(k): v for k, v in sorted(stage.drift.read_histogram.items())},
        "max_read_ahead": stage.drift.max_read_ahead,
        **stage.copies_stats(),
        "weight_copies_bound": copies_bound(schedule, stage.index, stage.stages, stage.window, inflight)
        if stage.backward_weights == "forward" and stage.trains
        else 0,
        "parameter_bytes": stage.parameter_bytes(),
        "peak_memory_bytes": peak_memory_bytes(device),
        "peak_allocated_bytes": peak_allocated,
    }


class RuntimeBase:
    """What both runtimes hold and derive alike, from the first stage and the run's schedule.

    The run's shape (``stages``, ``window``, ``device``, ``units`` per stage, ``schedule``,
    ``inflight``), and what follows from it alone: a stage's program of a segment, its warm-up
    actions, its summary entry, and whether a step clips on the whole model's gradient norm.
    """

    def __init__(
        self, first: Stage, units: list[range], val: ValidationSet, schedule: str, inflight: int | None
    ) -> None:
        self.units, self.val, self.schedule, self.inflight = units, val, schedule, inflight
        self.stages, self.window, self.device = first.stages, first.window, first.device
        self.clips_whole_model = schedule_of(schedule).synchronous and bool(first.grad_clip)  # stages step together
        self.meter = StageMeter(first.device, [])  # the subclass counts its own stages' state in (:meth:`_meter`)

    def _meter(self, stages: list[Stage]) -> None:
        """Measure allocated bytes in this process over ``stages`` (:class:`~.meter.StageMeter`), from now."""
        self.meter = StageMeter(self.device, stages)

    def _program(self, s: int, first_batch: int, n_batches: int | None, plan: EvalPlan) -> Program:
        """Stage ``s``'s program of the segment from ``first_batch`` (``n_batches``, or until ``plan`` ends it)."""
        end = None if n_batches is None else first_batch + n_batches - 1
        return Program(
            self.schedule, s, self.stages, self.window, first_batch, end, inflight=self.inflight, eval_at=plan.eval_at
        )

    def _warmup_actions(self, s: int) -> list[Action]:
        """Stage ``s``'s warm-up, at the first stage's in-flight depth (:func:`warmup_actions`)."""
        n = inflight_cap(self.schedule, 0, self.stages, self.window, self.inflight)
        return warmup_actions(s, self.stages, n)

    def _stage_entry(self, stage: Stage, timing: StageTiming, makespan: float) -> dict:
        """``stage``'s entry of the run summary (:func:`stage_stats`)."""
        return stage_stats(
            stage,
            timing,
            makespan,
            self.units[stage.index],
            self.device,
            self.schedule,
            self.inflight,
            self.meter.peak_bytes,
        )
