"""Where a run validates densely: near its target, every ``eval_every`` steps; far from it, every ``eval_far_every``.

Time to target is read at the first validation at or below the target, so only the validations just
before it set its resolution; the others only show the curve and feed the pruner. One validation of
the default 256 sequences costs what two or three training steps cost, so validating every step-grid
point doubled a search trial's CPU time. With ``training.eval_far_every`` a run validates every
``eval_far_every`` steps (the far points) and, once :func:`near_target` says the target is near, at
every ``eval_every`` point until the next far point, where it is asked again.

The rule reads the far validations only, so which points a run validates is a function of its loss
curve alone, not of its layout: a shared curve (:mod:`paci_tune.tune.sharing`) is replayed on the
same points its trainer would validate. The last stage decides at each far point and the word
travels to stage 0 on the gradients (:data:`paci_tune.pipeline.evaluation.NEAR`); it arrives before
the next evaluation point, which follows a whole global batch whose backwards started after it.

A sudden drop that the rule does not foresee is caught at the next far point, at the far spacing;
on the curves of the example's search (17 runs, 2026-12-04) it foresaw every crossing
(docs/benchmarks.md). May import: the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

SHARE_OF_DISTANCE = 0.5
"""Near once the best far validation has covered this share of the way from the first one to the target."""

LOOKAHEAD = 2.0
"""...or once the recent rate of improvement reaches the target within this many far intervals."""

RATE_SPAN = 2
"""The rate of improvement is read over the last this many far intervals (less noise than one)."""


def near_target(far: Sequence[float], target: float) -> bool:
    """Whether the points after the latest far validation (``far[-1]``; ``far``: every far validation of
    the run so far, oldest first) are validated at every ``eval_every`` step (module docstring)."""
    if not far:
        return False
    best, last = min(far), far[-1]
    if best <= target:
        return True
    if best - target <= SHARE_OF_DISTANCE * (far[0] - target):
        return True
    span = min(RATE_SPAN, len(far) - 1)
    if span == 0:
        return False
    rate = (far[-1 - span] - last) / span
    return last - LOOKAHEAD * max(rate, 0.0) <= target


def near(far_every: int | None, target: float | None, far: Sequence[float]) -> bool:
    """:func:`near_target` for a run that validates far apart (``training.eval_far_every``) toward a target."""
    return far_every is not None and target is not None and near_target(far, target)


def after_validation(far: list[float], step: int, val: float, far_every: int | None, target: float | None) -> bool:
    """Note a validation after global batch ``step`` (a far one joins ``far``, in place) and say whether the
    points after it are validated densely: the trainer's word at its last stage, and a shared curve's replay."""
    if far_every is not None and step % far_every == 0:
        far.append(val)
    return near(far_every, target, far)


def validated(step: int, every: int, far_every: int | None, near: bool) -> bool:
    """Whether a run validates after global batch ``step`` (counted from 1): on the ``eval_every`` grid, and
    with ``eval_far_every``, at its far points or where the target is near."""
    if step % every:
        return False
    return far_every is None or step % far_every == 0 or near
