"""The points of a space a device budget leaves: (P, a, b) with D = N / P replicas of a P-stage pipeline.

Under a fixed device budget N every trial uses all N devices, so P must divide N, and with a fixed
global batch each replica takes ``G / D`` sequences: a = G / (D * b) must be whole (:mod:`.space`'s
docstring). Kept apart from the space's parsing because it is arithmetic on integers alone, and
every dropped pair carries the reason a user reads in the search's log. May import:
:mod:`paci_tune.config` (the :class:`~paci_tune.config.layout.Layout`).
"""

from __future__ import annotations

from ..config.layout import Layout


def budget_points(
    stages: list[int],
    sizes: list[int],
    windows: list[int],
    fixed: int | None,
    devices: int | None,
    given_windows: list[int] | None,
) -> tuple[set[tuple[int, int, int]], list[str]]:
    """Feasible (P, a, b) under the device budget, and a reason for every (P[, b]) dropped."""
    points: set[tuple[int, int, int]] = set()
    dropped: list[str] = []
    for p in stages:
        d = Layout.data_parallel_for(devices, p)
        if not d:
            dropped.append(f"P={p}: {devices} devices are not a whole number of {p}-stage pipelines")
            continue
        if fixed is None:
            points |= {(p, a, b) for a in windows for b in sizes}
            continue
        if fixed % d:
            dropped.append(f"P={p} D={d}: global batch {fixed} does not split over {d} replicas")
            continue
        per = fixed // d
        if given_windows is not None:  # the space lists windows: b follows from a
            for a in given_windows:
                if per % a:
                    dropped.append(f"P={p} D={d} a={a}: b = {fixed}/({d}*{a}) is not a whole number")
                else:
                    points.add((p, a, per // a))
            continue
        for b in sizes:
            if per % b:
                dropped.append(f"P={p} D={d} b={b}: a = {fixed}/({d}*{b}) is not a whole number")
            else:
                points.add((p, per // b, b))
    return points, dropped
