"""Learning-rate schedule over the budget.

"No Train No Gain" (Kaddour et al., 2023): a schedule must decay over the *budget*, in the
budget's own unit, or a short budget is judged with a learning rate that never came down. So
the schedule is a function of progress through the budget (steps done / steps, or clock /
seconds), not of an absolute step count. May import: :mod:`paci_tune.config`.
"""

from __future__ import annotations

import math

from ..config.schema import LRScheduleConfig, OptimizerConfig


def peak_lr(opt: OptimizerConfig, sched: LRScheduleConfig, global_batch: int) -> float:
    """``optimizer.lr`` is the peak at ``reference_batch``; scale it to this global batch.

    The PACI paper uses 3e-4 at batch 256 scaled by sqrt(batch ratio).
    """
    if sched.reference_batch is None or sched.scaling == "none":
        return opt.lr
    ratio = global_batch / sched.reference_batch
    return opt.lr * (math.sqrt(ratio) if sched.scaling == "sqrt" else ratio)


def lr_factor(progress: float, warmup_fraction: float, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``progress`` in (0, 1]: linear warm-up, then cosine to min_ratio."""
    p = min(max(progress, 0.0), 1.0)
    if warmup_fraction > 0 and p < warmup_fraction:
        return p / warmup_fraction
    t = 0.0 if warmup_fraction >= 1 else (p - warmup_fraction) / (1.0 - warmup_fraction)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def step_progress(update_index: int, total_updates: int) -> float:
    """Progress at the end of the (0-based) ``update_index``-th step: the first step's LR is > 0."""
    return (update_index + 1) / total_updates
