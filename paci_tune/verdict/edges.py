"""The LR edge rule: a compared point whose LR sits at the edge of its grid is not a tuned point.

A schedule's best LR at the largest (or smallest) scale of the grid says that a larger (or smaller) one
was never tried and might be better still: the comparison then holds an under-tuned side, in PACI's
favour if it is the baseline, against it if it is PACI. best.yaml names each such point under ``lr_edges``
(the schedule, its point, the LR scale, which edge, the grid and what to try) and the verdict's notes
repeat it, so a user widens the grid before acting on the verdict. A space that fixes the LR (one scale,
or no ``lr_scale``) has every point at both edges: nothing about the LR is tuned, and the file says that
once. A continuous range counts a point within 5% of a bound as at it. May import: the tune layer's
:mod:`paci_tune.tune.point`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..tune.point import TrialParams

NEAR = 1.05
"""A point of a continuous LR range within this factor of a bound is at that bound."""


def _bounds(grid: Sequence[float] | Mapping[str, float]) -> tuple[float, float]:
    """(lowest, highest) LR scale of the grid: a list of choices, or a ``{low, high}`` range."""
    if isinstance(grid, Mapping):
        return float(grid["low"]), float(grid["high"])
    values = [float(x) for x in grid]
    return (min(values), max(values)) if values else (1.0, 1.0)


def lr_edges(points: Mapping[str, TrialParams], grid: Sequence[float] | Mapping[str, float]) -> list[dict[str, Any]]:
    """Each point of ``points`` (by schedule) at an edge of the LR ``grid`` (a list of scales, or a ``{low, high}``
    range), with a note; empty when none is."""
    bounds = _bounds(grid)
    if bounds[0] == bounds[1]:
        fixed = bounds[0]
        return [
            {
                "schedule": "all",
                "point": None,
                "lr_scale": fixed,
                "edge": "both",
                "grid": [fixed],
                "note": "the LR was not searched (the space fixes it): neither side's LR is tuned; "
                "give the space lr_scale: [0.5, 1.0, 2.0] or wider",
            }
        ]
    low, high = bounds
    near = NEAR if isinstance(grid, Mapping) else 1.0 + 1e-9
    out = []
    for schedule, p in points.items():
        edge = "high" if p.lr_scale * near >= high else "low" if p.lr_scale <= low * near else None
        if edge is None:
            continue
        step = "larger" if edge == "high" else "smaller"
        note = (
            f"{schedule}'s best point {p.label()} sits at the {edge} edge of the LR grid (x{p.lr_scale:g} of "
            f"[x{low:g}, x{high:g}]): a {step} LR was never tried, so this point may be under-tuned; widen "
            f"lr_scale past x{p.lr_scale:g} before acting on the verdict"
        )
        out.append(
            {
                "schedule": schedule,
                "point": p.label(),
                "lr_scale": p.lr_scale,
                "edge": edge,
                "grid": [low, high],
                "note": note,
            }
        )
    return out
