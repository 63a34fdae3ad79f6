"""A pipeline layout: how one run spreads its model over devices and its batch over micro-batches.

A layout is (schedule, P stages, D data-parallel replicas, a micro-batches per window, b sequences
per micro-batch, the in-flight cap, the stage cut, v model chunks per stage). With ``v > 1``
(interleaved 1F1B) the cut has ``v * P`` entries, the units of each chunk in model order; stage
``s`` holds chunks ``s, s + P, ...``. It is the one place that knows the two rules
every layer relies on, so no other module multiplies them out:

- a global batch (sequences per optimizer step) is ``D * a * b``: each replica takes ``G / D``
  sequences per step, ``a`` micro-batches of ``b``;
- a run takes ``P * D`` devices: stage ``s`` of replica ``r`` on one device each.

P is called ``stages`` everywhere, as in the config's ``pipeline.stages``. The stage, the
partitioner, the simulator, the profile clocks, a search's trial points and best.yaml all take a
layout rather than the loose integers. A layout is a value: building one checks nothing (a search
point outside a fixed batch has ``window=0``); :meth:`Layout.check` refuses a bad one with the
config key that names it. May import: :mod:`paci_tune.errors` and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError

DEFAULT_WINDOW = 4
"""The window a run gets when neither ``pipeline.window`` nor ``pipeline.microbatch_size`` is given."""


_DIVISOR_SCAN = 1 << 20
"""Trial divisions an error message may spend listing divisors: a million, well under a second."""


def _divisors(n: int, shown: int = 16) -> str:
    """The divisors of ``n`` for an error message: all of them when few, else the smallest and largest.

    Found in pairs ``(d, n // d)`` up to ``sqrt(n)`` -- and at most :data:`_DIVISOR_SCAN` of them, so a
    batch of 10**12 costs a million divisions, not a trillion; past that only the small ones and their
    partners are listed, said so.
    """
    small: list[int] = []
    d = 1
    while d * d <= n and d <= _DIVISOR_SCAN:
        if n % d == 0:
            small.append(d)
        d += 1
    complete = d * d > n
    large = [n // x for x in reversed(small) if n // x != x]
    found = small + large
    listed = ", ".join(map(str, found))
    if len(found) > shown:
        listed = f"{', '.join(map(str, found[: shown // 2]))}, ..., {', '.join(map(str, found[-(shown // 4) :]))}"
    if complete:
        return listed if len(found) <= shown else f"{listed} ({len(found)} divisors)"
    return f"{listed} (not searched between {_DIVISOR_SCAN} and {n // _DIVISOR_SCAN})"


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive integer")


@dataclass(frozen=True)
class Layout:
    """One run's pipeline layout: schedule, P, D, a, b, in-flight cap and stage cut (module docstring)."""

    schedule: str
    stages: int  # P
    data_parallel: int = 1  # D
    window: int = 1  # a: micro-batches per replica per optimizer step (0: not a whole number, a search point)
    microbatch_size: int = 1  # b
    inflight: int | None = None  # PACI's cap on micro-batches in flight per stage; None: the schedule's own
    partition: tuple[int, ...] | None = None  # units per stage (per chunk when chunks > 1); None: "auto"
    chunks: int = 1  # v: model chunks per stage (interleaved 1F1B); 1 for every other schedule

    @property
    def virtual_stages(self) -> int:
        """Pieces the model is cut into: v * P (P for every schedule but interleaved)."""
        return self.stages * self.chunks

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all D replicas: D * a * b."""
        return self.data_parallel * self.window * self.microbatch_size

    @property
    def devices(self) -> int:
        """Devices the run takes: one per stage of each replica, P * D."""
        return self.stages * self.data_parallel

    @classmethod
    def for_batch(
        cls,
        global_batch: int,
        *,
        schedule: str,
        stages: int,
        data_parallel: int = 1,
        window: int | None = None,
        microbatch_size: int | None = None,
        inflight: int | None = None,
        partition: tuple[int, ...] | None = None,
        chunks: int = 1,
    ) -> Layout:
        """The layout of a fixed global batch: the window from the micro-batch size or the other way
        round (the window :data:`DEFAULT_WINDOW` when neither is given); a value that does not divide
        the batch is refused with the divisors that would."""
        g, d = global_batch, data_parallel
        if g % d:
            raise ConfigError("pipeline.data_parallel", d, f"a divisor of training.global_batch={g}: {_divisors(g)}")
        per_replica = g // d
        where = f"training.global_batch / pipeline.data_parallel = {g}/{d} = {per_replica}"
        if microbatch_size is not None and window is None:
            if per_replica % microbatch_size:
                raise ConfigError("pipeline.microbatch_size", microbatch_size, f"a divisor of {where}")
            window = per_replica // microbatch_size
        window = DEFAULT_WINDOW if window is None else window
        if per_replica % window:
            raise ConfigError("pipeline.window", window, f"a divisor of {where}: {_divisors(per_replica)}")
        b = per_replica // window if microbatch_size is None else microbatch_size
        return cls(schedule, stages, d, window, b, inflight, partition, chunks)

    @staticmethod
    def window_for(global_batch: int, data_parallel: int, microbatch_size: int) -> int:
        """a for a fixed global batch: G / (D * b), or 0 when that is not a whole number."""
        per_step = data_parallel * microbatch_size
        return global_batch // per_step if global_batch % per_step == 0 else 0

    @staticmethod
    def data_parallel_for(devices: int | None, stages: int) -> int:
        """D for P-stage pipelines on a budget of N devices: N / P, 0 when that is not a whole number, and
        1 without a budget."""
        if devices is None:
            return 1
        return devices // stages if devices % stages == 0 else 0

    def check(self, global_batch: int | None = None) -> None:
        """Refuse a layout no run can have, naming the config key; with ``global_batch``, also one whose
        D * a * b is not that batch."""
        for key, value in (
            ("pipeline.stages", self.stages),
            ("pipeline.window", self.window),
            ("pipeline.microbatch_size", self.microbatch_size),
            ("pipeline.data_parallel", self.data_parallel),
            ("pipeline.chunks", self.chunks),
        ):
            _positive_int(key, value)
        if self.inflight is not None:
            _positive_int("pipeline.inflight", self.inflight)
        for i, n in enumerate(self.partition or ()):
            _positive_int(f"pipeline.partition[{i}]", n)
        if global_batch is not None and self.global_batch != global_batch:
            g, d = global_batch, self.data_parallel
            raise ConfigError(
                "pipeline.microbatch_size",
                self.microbatch_size,
                f"training.global_batch / (pipeline.data_parallel * pipeline.window) = {g}/({d}*{self.window})",
            )

    def with_partition(self, sizes: list[int] | tuple[int, ...] | None) -> Layout:
        return replace(self, partition=None if sizes is None else tuple(sizes))

    def overrides(self) -> dict[str, Any]:
        """Dotted run-config overrides (``pipeline.window`` ...) that give a run this layout; the cut
        and the in-flight cap only where they are set."""
        out: dict[str, Any] = {
            "pipeline.schedule": self.schedule,
            "pipeline.stages": self.stages,
            "pipeline.data_parallel": self.data_parallel,
            "pipeline.window": self.window,
            "pipeline.microbatch_size": self.microbatch_size,
            "training.global_batch": self.global_batch,
        }
        if self.inflight is not None:
            out["pipeline.inflight"] = self.inflight
        if self.partition is not None:
            out["pipeline.partition"] = list(self.partition)
        if self.chunks != 1:
            out["pipeline.chunks"] = self.chunks
        return out

    def label(self) -> str:
        """``paci P=4 D=2 a=8 b=4``: D (and v) only where not 1; ``a=-`` for a point with no whole window."""
        dp = f" D={self.data_parallel}" if self.data_parallel != 1 else ""
        v = f" v={self.chunks}" if self.chunks != 1 else ""
        a = self.window if self.window else "-"
        return f"{self.schedule} P={self.stages}{v}{dp} a={a} b={self.microbatch_size}"
