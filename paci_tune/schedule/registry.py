"""Every pipeline schedule, one value each: the one place that knows what a schedule name means.

A :class:`Schedule` says what each layer needs to know about one schedule, so no layer compares
names: whether it flushes and steps all stages together (``synchronous``: plain gradient
accumulation, so every synchronous schedule trains the same numbers and shares one learning curve),
how it places its model chunks on the ranks (``looped``: chunk ``c`` of rank ``s`` is virtual
stage ``c * P + s``; ``v``: rank ``s`` holds virtual stages ``s`` and ``2P - 1 - s``), whether its
backward is split into the input half ``B`` and the weight half ``W``, where its per-stage action
lists come from (paci-tune's own :class:`~.program.Program`, or a builder that reproduces torch's
class, named by ``torch_class``), what it refuses, how many micro-batches a stage holds, and its
textbook bubble at equal stage costs and free transfers.

The readers: config validation, the spaces, the memory model, the simulator, both runtimes, the
curve key, the verdict's choice of baseline and the report. A structure test fails on any
comparison with a schedule's name outside this module. May import: :mod:`.actions`,
:mod:`.synchronous`, :mod:`.vshape`, :mod:`paci_tune.errors` and the standard library (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import actions, synchronous, vshape
from .actions import Action

BatchBuilder = Callable[[int, int, int, int, int], list[Action]]
"""``(stage, stages, window, chunks, first_mb) -> actions``: one drained global batch at ``stage``."""


def _rounds_refusal(name: str, stages: int, window: int) -> str | None:
    """torch's looped multi-chunk classes run micro-batches in rounds of ``max(1, m // P)``."""
    n = max(1, window // stages)
    if window % n:
        return (
            f"torch's {name} schedule runs micro-batches in rounds: {window} micro-batches on {stages} stages "
            f"make {n} rounds, which must divide {window} (e.g. a window that is a multiple of {stages}, or at "
            f"most {stages})"
        )
    return None


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule and everything the layers read about it (module docstring)."""

    name: str  # the config's pipeline.schedule
    label: str  # how a person names it in a sentence or a table
    synchronous: bool  # flushes every global batch and steps all stages together: plain gradient accumulation
    placement: str = "looped"  # "looped" (chunk c of rank s: virtual stage c*P + s) or "v" (s and 2P-1-s)
    chunks: int | None = 1  # model chunks per rank; None: the config's pipeline.chunks (2 or more)
    split_backward: bool = False  # B is the input gradient, W the weight gradient
    builder: BatchBuilder | None = None  # None: paci-tune's own Program; else one batch as torch's class orders it
    torch_class: str | None = None  # get_schedule_class's name for the distributed runtime
    torch_always: bool = True  # False: torch's class only with pipeline.torch_schedule (an A/B of our own)
    whole_batch_inflight: bool = False  # holds the whole global batch in flight (GPipe)
    min_window: Callable[[int], int] = field(default=lambda stages: 1)  # fewest micro-batches it runs on P stages
    rounds: bool = False  # micro-batches run in torch's rounds, which must divide the window
    colour: str = "#777777"  # its colour in every figure

    # ------------------------------------------------------------------------ what it is

    @property
    def asynchronous(self) -> bool:
        """Steps each stage on its own, with micro-batches in flight across the step (PACI)."""
        return not self.synchronous

    @property
    def curve_class(self) -> str:
        """What its numerics depend on: every synchronous schedule trains plain gradient accumulation
        (one curve for all of them, whatever the layout); PACI's curve is its own."""
        return SYNCHRONOUS_CURVE if self.synchronous else self.name

    @property
    def own_program(self) -> bool:
        """Whether paci-tune's own runtimes execute its lists (else the emulated runtime trains its
        numbers, 1F1B-flush's, while a profile clock times its own lists)."""
        return self.builder is None

    def runs_torch(self, runtime: str, torch_schedule: bool) -> bool:
        """Whether a run on ``runtime`` executes it through torch's own class."""
        if runtime != "distributed" or self.torch_class is None:
            return False
        return self.torch_always or torch_schedule

    @property
    def multi_chunk(self) -> bool:
        """Whether a rank holds more than one model chunk."""
        return self.chunks != 1

    def chunks_of(self, configured: int | None) -> int:
        """Chunks per rank for a config's ``pipeline.chunks`` (None: the schedule's default)."""
        if self.chunks is not None:
            return self.chunks
        return configured if configured is not None else DEFAULT_CHUNKS

    # ------------------------------------------------------------------------ placement

    def virtual_stage(self, stage: int, chunk: int, stages: int) -> int:
        """The position in model order of ``chunk`` of rank ``stage``."""
        return actions.virtual_stage(stage, chunk, stages, self.placement)

    def holder(self, virtual: int, stages: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding virtual stage ``virtual``: :meth:`virtual_stage`'s inverse."""
        return actions.holder(virtual, stages, self.placement)

    def forward_loops(self, stages: int, chunks: int) -> bool:
        """Whether the forward path comes back to a rank it left (looped placement, several chunks, P >= 2):
        a rank then waits on its own later piece, so an evaluation's sends must not be waited on before
        that piece runs (:meth:`paci_tune.pipeline.p2p.P2P.settle`). A V comes back only through its tip,
        a hand-over in memory."""
        return self.placement == "looped" and chunks > 1 and stages > 1

    def wraps(self, virtual: int, stages: int) -> bool:
        """Whether the link from piece ``virtual`` to the next goes from the last rank back to the first, the
        one link of a looped placement's circle that must never wait (:meth:`forward_loops`): every circle
        of waits passes through it. A V never wraps."""
        return self.placement == "looped" and self.holder(virtual + 1, stages)[0] < self.holder(virtual, stages)[0]

    # ------------------------------------------------------------------------ constraints

    def refusal(self, stages: int, window: int, chunks: int) -> tuple[str, str] | None:
        """Why it cannot run ``window`` micro-batches on ``stages`` ranks of ``chunks`` chunks each:
        ``(setting, reason)`` with the ``pipeline`` setting at fault, or None when it can."""
        if self.chunks is None and chunks < 2:
            return "chunks", f"{self.name} needs 2 or more chunks per stage (with 1 it is 1f1b)"
        if self.chunks is not None and chunks != self.chunks:
            return "chunks", f"{self.name} runs {self.chunks} chunk{'s' * (self.chunks > 1)} per stage"
        fewest = self.min_window(stages)
        if window < fewest:
            return "window", f"at least {fewest} for {self.name} on {stages} stages (torch's {self.torch_class})"
        if self.rounds and (why := _rounds_refusal(self.label, stages, window)):
            return "window", why
        return None

    def torch_refusal(self, stages: int, window: int) -> str | None:
        """What torch's class refuses at its first step (the window), beyond :meth:`refusal`."""
        if self.torch_class == "1F1B" and window < stages:
            return f"at least pipeline.stages ({stages}): torch's Schedule1F1B needs as many micro-batches as stages"
        return None

    def check(self, stages: int, window: int, chunks: int) -> None:
        """Refuse a layout it cannot run, naming ``pipeline.chunks`` or ``pipeline.window``."""
        refused = self.refusal(stages, window, chunks)
        if refused is not None:
            setting, why = refused
            raise ConfigError(f"pipeline.{setting}", chunks if setting == "chunks" else window, why)

    # ------------------------------------------------------------------------ memory and time

    def inflight_cap(self, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
        """Most micro-batches a stage holds between forward and backward.

        1F1B-style schedules keep ``P - s`` at stage ``s`` (what the last stage needs never to wait);
        ``inflight`` caps that further (PACI). GPipe holds the whole global batch; ZB-H1 keeps each
        micro-batch until its ``W``: ``min(P, m)`` at every stage. Not the bound of a multi-chunk
        schedule's rank, which the memory model counts chunk by chunk from its lists
        (:func:`~.replay.inflight_per_chunk`).
        """
        if self.whole_batch_inflight:
            return window
        if self.split_backward and not self.multi_chunk:
            return max(min(stages, window), 1)
        cap = stages - stage
        if inflight is not None:
            cap = min(cap, inflight)
        if self.synchronous and not self.multi_chunk:
            cap = min(cap, window)
        return max(cap, 1)

    def copies_bound(self, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
        """Most weight copies a stage holds for in-flight backwards (``backward_weights: forward``):
        ``ceil((k-1)/a)`` with ``k`` in flight under PACI; 0 for a schedule that never steps with a
        micro-batch in flight."""
        if self.synchronous:
            return 0
        return math.ceil((self.inflight_cap(stage, stages, window, inflight) - 1) / window)

    def bubble(self, stages: int, window: int, chunks: int = 1) -> float:
        """Idle fraction of one flushed global batch at equal stage costs and free transfers (``F = 1``,
        whole backward 2, ``B = W = 1`` where split). PACI flushes only at segment ends: 0 here."""
        p, m = stages, window
        if self.asynchronous:
            return 0.0
        if self.placement == "v":
            return vshape.bubble(self.name, p, m)
        if self.split_backward:
            return (p - 1) / (3 * m + p - 1)
        return (p - 1) / (chunks * m + p - 1)


DEFAULT_CHUNKS = 2
"""``pipeline.chunks`` of an interleaved run that does not say (v = 2, Megatron's usual)."""
SYNCHRONOUS_CURVE = "synchronous"
"""The curve class of every synchronous schedule, and of PACI on one stage (nothing in flight)."""

PACI = Schedule("paci", "PACI", synchronous=False, colour="#4477AA")
ONE_F_ONE_B = Schedule("1f1b", "flush", synchronous=True, torch_class="1F1B", torch_always=False, colour="#CC6611")
ZB_H1 = Schedule(
    "zb-h1",
    "zero-bubble",
    synchronous=True,
    split_backward=True,
    builder=synchronous.zb_h1,
    torch_class="InterleavedZeroBubble",
    rounds=True,
    colour="#228833",
)
INTERLEAVED = Schedule(
    "interleaved",
    "interleaved 1F1B",
    synchronous=True,
    chunks=None,
    builder=synchronous.interleaved,
    torch_class="Interleaved1F1B",
    rounds=True,
    colour="#AA3377",
)
ZB_V = Schedule(
    "zb-v",
    "ZB-V",
    synchronous=True,
    placement="v",
    chunks=2,
    split_backward=True,
    builder=vshape.zb_v,
    torch_class="ZBVZeroBubble",
    colour="#66CCEE",
)
DUALPIPE_V = Schedule(
    "dualpipev",
    "DualPipeV",
    synchronous=True,
    placement="v",
    chunks=2,
    split_backward=True,
    builder=vshape.dualpipe_v,
    torch_class="DualPipeV",
    min_window=lambda p: 2 * p,
    colour="#CCBB44",
)
GPIPE = Schedule("gpipe", "GPipe", synchronous=True, whole_batch_inflight=True, colour="#BBBBBB")

REGISTRY: dict[str, Schedule] = {s.name: s for s in (PACI, ONE_F_ONE_B, ZB_H1, INTERLEAVED, ZB_V, DUALPIPE_V, GPIPE)}
"""Every schedule by name. Its order is the baselines' order of preference on a tie (strongest
first after PACI: 1F1B-flush, the simplest, wins a tie)."""

NAMES: tuple[str, ...] = tuple(REGISTRY)
SYNCHRONOUS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.synchronous)
OWN_PROGRAM: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.own_program)
"""Schedules paci-tune's own runtimes execute (the others run through torch's classes, or are timed)."""
FLUSH = ONE_F_ONE_B.name
"""The reference synchronous schedule: the one data parallelism (P = 1) is searched under."""


def schedule_of(name: str) -> Schedule:
    """The registry's value for ``name``; ``ValueError`` naming the schedules for an unknown one."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule {name!r}; expected one of {NAMES}") from None


def preference(name: str) -> int:
    """Rank of ``name`` among the schedules (lower is preferred on a tie)."""
    return NAMES.index(name) if name in REGISTRY else len(NAMES)


def sides(names: Iterable[str]) -> tuple[str | None, list[str]]:
    """The asynchronous schedule among ``names`` (PACI; None when absent) and the synchronous ones, in
    ``names``' order: the two sides a comparison takes."""
    names = list(names)
    paci = next((n for n in names if not schedule_of(n).synchronous), None)
    return paci, [n for n in names if schedule_of(n).synchronous]


def strongest(scores: dict[str, float]) -> str:
    """The schedule with the lowest score, ties to the registry's preference (flush first)."""
    return min(scores, key=lambda n: (scores[n], preference(n)))


def inflight_cap(schedule: str, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
    """:meth:`Schedule.inflight_cap` of ``schedule``."""
    return schedule_of(schedule).inflight_cap(stage, stages, window, inflight)


def copies_bound(schedule: str, stage: int, stages: int, window: int, inflight: int | None = None) -> int:
    """:meth:`Schedule.copies_bound` of ``schedule``."""
    return schedule_of(schedule).copies_bound(stage, stages, window, inflight)
