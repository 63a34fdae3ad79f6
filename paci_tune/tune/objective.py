"""The objective: time to accuracy on the budget's clock, one number that orders every trial.

A trial that reaches the target scores the clock reading of its first validation at or below it.
A trial that does not scores more than the whole budget ``B``, ordered by how far its best
validation loss ``L`` stayed from the target ``T``:

    score = t_target                    if the target was reached (t_target <= B)
    score = B * (1 + (L - T) / T)       otherwise (L > T, so score > B)

so every trial that got there ranks before every trial that did not, and among the latter a
closer miss ranks first. The same formula, applied to what a trial has shown so far, is the
intermediate value reported to Optuna at each grid point, so a pruned trial's last value is on
the same scale as a finished one's. May import: the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def score(reached_at: float | None, best_val: float | None, target: float, budget: float) -> float:
    """Time to target, or the not-reached penalty (module docstring)."""
    if reached_at is not None:
        return reached_at
    if best_val is None or not math.isfinite(best_val):
        return math.inf
    return budget * (1.0 + max(best_val - target, 0.0) / target)


def grid_step(clock: float, budget: float, grid: int) -> int:
    """Index (1..grid) of the clock grid point a validation at ``clock`` belongs to."""
    every = budget / grid
    return max(1, min(grid, math.floor(clock / every + 1e-6)))


@dataclass
class Progress:
    """What a trial has shown so far, folded from its validation records."""

    target: float
    budget: float
    best_val: float | None = None
    reached_at: float | None = None
    clock: float = 0.0

    def add_eval(self, clock: float, val_loss: float) -> None:
        self.clock = max(self.clock, clock)
        if self.best_val is None or val_loss < self.best_val:
            self.best_val = val_loss
        if self.reached_at is None and val_loss <= self.target:
            self.reached_at = clock

    @property
    def value(self) -> float:
        return score(self.reached_at, self.best_val, self.target, self.budget)
