"""Cutting a flat list of units into contiguous pipeline stages.

A pipeline runs at the pace of its slowest stage, so the default cut minimises the largest
stage cost (dynamic programming over contiguous splits). Without a cost profile the costs are
per-unit estimates (FLOPs for the built-in GPT, parameter counts otherwise); with one, the
memory-aware :func:`paci_tune.sim.partition` runs the same dynamic program on measured times and
memory (see ``pipeline.planning``). May import: :mod:`paci_tune.errors` and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import ConfigError

StageCost = Callable[[int, int, int], float]
"""``cost(stage, first_unit, stop_unit)``: a stage's figure of merit for units ``first..stop-1``."""
Fits = Callable[[int, int, int], bool]
"""``fits(stage, first_unit, stop_unit)``: whether that stage fits on its device."""

_EPS = 1e-12


def min_max_partition(n_units: int, stages: int, cost: StageCost, fits: Fits | None = None) -> list[int] | None:
    """Stage sizes minimising the largest ``cost`` over contiguous cuts where every stage ``fits``.

    Returns ``None`` when no cut fits. Ties favour earlier cuts (smaller early stages), which
    leaves the memory-heavy first stages lighter.
    """
    if not 1 <= stages <= n_units:
        raise ValueError(f"cannot cut {n_units} units into {stages} stages")
    inf = float("inf")
    best = [[inf] * (n_units + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n_units + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for p in range(1, stages + 1):
        s = p - 1  # 0-based index of the stage being placed
        for i in range(p, n_units - (stages - p) + 1):
            for j in range(p - 1, i):
                if best[p - 1][j] == inf or (fits is not None and not fits(s, j, i)):
                    continue
                v = max(best[p - 1][j], cost(s, j, i))
                if v < best[p][i] - _EPS:
                    best[p][i], cut[p][i] = v, j
    if best[stages][n_units] == inf:
        return None
    sizes, i = [], n_units
    for p in range(stages, 0, -1):
        j = cut[p][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balanced_partition(costs: Sequence[float], stages: int) -> list[int]:
    """Stage sizes (units per stage) minimising the largest stage cost; ties favour earlier cuts."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    sizes = min_max_partition(len(costs), stages, lambda s, j, i: prefix[i] - prefix[j])
    assert sizes is not None  # no memory limit: some cut always exists
    return sizes


def check_depth(stages: int, n_units: int) -> None:
    """A pipeline cannot have more stages than the model has units."""
    if stages > n_units:
        raise ConfigError("pipeline.stages", stages, f"1..{n_units} (the model has {n_units} pipeline units)")


def check_partition(sizes: Sequence[int], stages: int, n_units: int) -> list[int]:
    """Validate a hand-pinned cut against the model: one positive unit count per stage, summing to all units."""
    check_depth(stages, n_units)
    sizes = list(sizes)
    if len(sizes) != stages or sum(sizes) != n_units or min(sizes, default=0) < 1:
        raise ConfigError(
            "pipeline.partition",
            sizes,
            f"'auto' or {stages} positive unit counts (one per stage) summing to the model's {n_units} units",
        )
    return sizes


def resolve_partition(spec: str | Sequence[int], costs: Sequence[float], stages: int) -> list[int]:
    """Stage sizes from the config: ``"auto"`` balances ``costs``; a list pins the cut by hand."""
    if spec == "auto":
        check_depth(stages, len(costs))
        return balanced_partition(costs, stages)
    return check_partition(spec, stages, len(costs))


def stage_units(sizes: Sequence[int]) -> list[range]:
    """Unit index ranges of each stage."""
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out
