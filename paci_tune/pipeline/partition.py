"""Cutting a flat list of units into contiguous pipeline stages.

A pipeline runs at the pace of its slowest stage, so the default cut minimises the largest
stage cost (dynamic programming over contiguous splits). Costs here are per-unit estimates
(FLOPs for the built-in GPT, parameter counts otherwise); a measured profile can replace them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError


def balanced_partition(costs: Sequence[float], n_stages: int) -> list[int]:
    """Stage sizes (units per stage) minimising the largest stage cost; ties favour earlier cuts."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} units into {n_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: minimal max-stage cost of the first i units in p stages; cut[p][i]: last cut point.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for p in range(1, n_stages + 1):
        for i in range(p, n - (n_stages - p) + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i] - 1e-12:
                    best[p][i], cut[p][i] = v, j
    sizes, i = [], n
    for p in range(n_stages, 0, -1):
        j = cut[p][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def resolve_partition(spec: str | Sequence[int], costs: Sequence[float], n_stages: int) -> list[int]:
    """Stage sizes from the config: ``"auto"`` balances ``costs``; a list pins the cut by hand."""
    n = len(costs)
    if n_stages > n:
        raise ConfigError("pipeline.stages", n_stages, f"1..{n} (the model has {n} pipeline units)")
    if spec == "auto":
        return balanced_partition(costs, n_stages)
    sizes = list(spec)
    if len(sizes) != n_stages or sum(sizes) != n or min(sizes) < 1:
        raise ConfigError(
            "pipeline.partition",
            sizes,
            f"'auto' or {n_stages} positive unit counts (one per stage) summing to the model's {n} units",
        )
    return sizes


def stage_units(sizes: Sequence[int]) -> list[range]:
    """Unit index ranges of each stage."""
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out
