"""Both link costs of a calibration -- point to point and the gradient all-reduce -- from one launch.

Each measurement on its own starts two fresh Python processes that import torch and join a gloo
group: ~3 s of start-up on a 2-core CPU for well under a second of transfers. A calibration needs
both, so it starts the two processes once and runs the ping-pong (:func:`.p2p.ping_pong`) and then
the all-reduce (:func:`.allreduce.time_allreduce`) in the same group, with the same fits as the
separate measurements. May import: :mod:`paci_tune.sim`, :mod:`.p2p`, :mod:`.allreduce`, torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..sim.profile import AllReduceCost, P2PCost
from .allreduce import ALLREDUCE_SIZES, ALLREDUCE_TIMEOUT_S, fit_allreduce, time_allreduce
from .p2p import P2P_TIMEOUT_S, fit_p2p, measure_in_group, ping_pong, run_ranks, sizes_of


def _links_worker(
    rank: int, port: int, p2p: list[int], p2p_repeats: int, allreduce: list[int], allreduce_repeats: int, out_path: str
) -> None:
    """One of the two ranks; rank 0 writes {"p2p": {bytes: s}, "allreduce": {bytes: s}} to ``out_path``."""

    def both() -> dict[str, dict[int, float]]:
        return {"p2p": ping_pong(rank, p2p, p2p_repeats), "allreduce": time_allreduce(allreduce, allreduce_repeats)}

    measure_in_group(rank, 2, port, P2P_TIMEOUT_S + ALLREDUCE_TIMEOUT_S, out_path, both)


def measure_links(
    p2p_sizes: Sequence[int],
    *,
    p2p_repeats: int = 30,
    allreduce_sizes: Sequence[int] = ALLREDUCE_SIZES,
    allreduce_repeats: int = 8,
) -> tuple[P2PCost, AllReduceCost]:
    """(point-to-point cost, all-reduce cost over 2 ranks) of gloo on loopback, from one pair of
    processes: what :func:`.p2p.measure_p2p` and :func:`.allreduce.measure_allreduce` give apart."""

    def code(rank: int, port: int, out: str) -> str:
        args = f"{rank}, {port}, {list(p2p_sizes)!r}, {p2p_repeats}, {list(allreduce_sizes)!r}, {allreduce_repeats}"
        return f"from paci_tune.calibrate.links import _links_worker; _links_worker({args}, {out!r})"

    doc = run_ranks("link", 2, code, P2P_TIMEOUT_S + ALLREDUCE_TIMEOUT_S)
    p2p = P2PCost(*fit_p2p(sizes_of(doc["p2p"])), "gloo-loopback")
    allreduce = AllReduceCost(*fit_allreduce(sizes_of(doc["allreduce"]), 2), "gloo-loopback x2")
    return p2p, allreduce
