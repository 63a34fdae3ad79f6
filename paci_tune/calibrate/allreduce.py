"""All-reduce cost among data-parallel replicas: one ring step's latency and bandwidth for a profile.

``ranks`` gloo processes on loopback all-reduce fp32 tensors of a few sizes, the way a stage's
dp group all-reduces its gradients at each optimizer step. The fastest time of each size (noise on
a shared machine only ever adds time, see :mod:`.p2p`) is fitted to the ring model of
:class:`~paci_tune.sim.profile.AllReduceCost`: with ``D`` ranks one all-reduce of ``n`` bytes is
``2 (D-1)`` steps of ``latency + (n / D) / bandwidth``, so the fit is :func:`~.p2p.fit_p2p` of the
per-step time ``t / (2 (D-1))`` against the per-step bytes ``n / D``. This is the transport the
distributed runtime's dp groups use on a CPU; for NVLink or InfiniBand, measure there or write the
profile's ``allreduce`` by hand. Quick on purpose (three sizes, a few repeats, two processes by
default): it runs inside every calibration. May import: :mod:`paci_tune.sim`, :mod:`.p2p`, torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..sim.profile import AllReduceCost
from .p2p import fit_p2p, measure_in_group, run_ranks, sizes_of

ALLREDUCE_SIZES = (16 * 1024, 512 * 1024, 4 * 2**20)
ALLREDUCE_TIMEOUT_S = 120.0


def time_allreduce(sizes: Sequence[int], repeats: int) -> dict[int, float]:
    """{bytes: fastest all-reduce seconds} over the initialised group.

    A barrier before each timed all-reduce lines the ranks up, so the time is the collective's own,
    not a late rank's start.
    """
    import torch.distributed as dist

    result: dict[int, float] = {}
    for n in sizes:
        buf = torch.ones(max(n // 4, 1), dtype=torch.float32)
        times = []
        for r in range(1 + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if r >= 1:
                times.append(time.perf_counter() - t0)
            buf.fill_(1.0)  # keep the values finite whatever the repeat count
        result[buf.numel() * 4] = min(times)
    return result


def _allreduce_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank; rank 0 writes {bytes: fastest all-reduce seconds} to ``out_path``."""
    measure_in_group(rank, world, port, ALLREDUCE_TIMEOUT_S, out_path, lambda: time_allreduce(sizes, repeats))


def fit_allreduce(points: dict[int, float], ranks: int) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of one ring step from {bytes: all-reduce seconds} over ``ranks``."""
    if ranks < 2:
        raise ValueError("an all-reduce is measured over at least 2 ranks")
    steps = 2 * (ranks - 1)
    return fit_p2p({n / ranks: t / steps for n, t in points.items()})  # type: ignore[misc]


def measure_allreduce(
    ranks: int = 2, sizes: Sequence[int] = ALLREDUCE_SIZES, repeats: int = 8, timeout_s: float = ALLREDUCE_TIMEOUT_S
) -> AllReduceCost:
    """All-reduce among ``ranks`` gloo processes on loopback; see the module docstring.

    Plain ``python -c`` children, as :func:`~.p2p.measure_p2p` starts, for the same reason (spawn
    re-imports the caller's ``__main__``).
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"ranks must be an integer >= 2, got {ranks!r}")

    def code(rank: int, port: int, out: str) -> str:
        args = f"{rank}, {ranks}, {port}, {list(sizes)!r}, {repeats}, {out!r}"
        return f"from paci_tune.calibrate.allreduce import _allreduce_worker; _allreduce_worker({args})"

    points = sizes_of(run_ranks("all-reduce", ranks, code, timeout_s))
    latency, bandwidth = fit_allreduce(points, ranks)
    return AllReduceCost(latency, bandwidth, f"gloo-loopback x{ranks}")
