"""Clocks: what "time" means for budgets, LR schedules, evaluation points and time-to-accuracy.

``wall`` is measured seconds of training since the run started, carried over a resume so a
resumed run's budget is the original one.
"""

from __future__ import annotations

import time


class WallClock:
    """Seconds of this run so far, including the time before a resume (``offset``)."""

    name = "wall"

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self._start = time.perf_counter()

    def now(self) -> float:
        return self.offset + time.perf_counter() - self._start
