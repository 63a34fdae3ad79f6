"""Point-to-point transfer cost between two processes: latency and bandwidth for a profile.

Two gloo processes on loopback ping-pong tensors of a few sizes; the fastest one-way time of each
size is fitted to ``latency + bytes / bandwidth``. This is the transport the distributed runtime
uses on a CPU; for a real interconnect, measure there or edit the profile's ``p2p`` by hand. May
import: :mod:`paci_tune.sim`, :mod:`paci_tune.base`, torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..base.processes import child_environment, free_port, loopback_env
from ..sim.profile import P2PCost

P2P_SIZES = (4 * 1024, 256 * 1024, 4 * 2**20)
P2P_TIMEOUT_S = 120.0


def measure_in_group(
    rank: int, world: int, port: int, timeout_s: float, out_path: str, measure: Callable[[], Any]
) -> None:
    """A measurement process's life: join the gloo group on loopback (one thread per process: a link,
    not compute), run ``measure``, rank 0 writes its figures as JSON to ``out_path``, leave the group."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = measure()
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def ping_pong(rank: int, sizes: Sequence[int], repeats: int) -> dict[int, float]:
    """{bytes: fastest one-way seconds} between ranks 0 and 1 of the initialised group.

    The fastest round trip of each size is kept, not the median: on a shared machine scheduler
    noise only ever adds time (a peer that is not running cannot answer), and the median of a few
    round trips swung between 0.08 and 2 ms from one run to the next on a loaded 2-core machine.
    """
    import torch.distributed as dist

    peer = 1 - rank
    result: dict[int, float] = {}
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        times = []
        for r in range(2 + repeats):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if r >= 2:
                times.append((time.perf_counter() - t0) / 2)
        result[buf.numel() * 4] = min(times)
    return result


def _p2p_worker(rank: int, port: int, sizes: list[int], repeats: int, out_path: str) -> None:
    """One side of the ping-pong; rank 0 writes {bytes: one-way seconds} to ``out_path``."""
    measure_in_group(rank, 2, port, P2P_TIMEOUT_S, out_path, lambda: ping_pong(rank, sizes, repeats))


def fit_p2p(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``time = latency + bytes / bandwidth``; robust to a noisy, non-increasing fit.

    A negative intercept becomes 0 latency; a non-positive slope (noise swamping the size effect)
    becomes the bandwidth implied by the largest transfer, so transfers never come out free.
    """
    xs, ys = list(points), [points[k] for k in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        big = max(xs)
        return min(ys), big / max(points[big], 1e-12)
    latency = max(my - slope * mx, 0.0)
    return latency, 1.0 / slope


def measure_p2p(sizes: Sequence[int] = P2P_SIZES, repeats: int = 30, timeout_s: float = P2P_TIMEOUT_S) -> P2PCost:
    """Ping-pong between two gloo processes on loopback; see :func:`fit_p2p`.

    The two sides are plain ``python -c`` subprocesses rather than ``torch.multiprocessing.spawn``:
    spawn re-imports the caller's ``__main__``, which breaks (or recurses) when the caller is a
    script without a main guard, stdin, or a notebook.
    """

    def code(rank: int, port: int, out: str) -> str:
        args = f"{rank}, {port}, {list(sizes)!r}, {repeats}, {out!r}"
        return f"from paci_tune.calibrate.p2p import _p2p_worker; _p2p_worker({args})"

    points = sizes_of(run_ranks("point-to-point", 2, code, timeout_s))
    latency, bandwidth = fit_p2p(points)
    return P2PCost(latency, bandwidth, "gloo-loopback")


def sizes_of(doc: dict[str, float]) -> dict[int, float]:
    """{bytes: seconds} back from JSON, whose keys are strings."""
    return {int(k): float(v) for k, v in doc.items()}


def run_ranks(what: str, ranks: int, code: Callable[[int, int, str], str], timeout_s: float) -> Any:
    """Start ``ranks`` plain ``python -c`` children (``code(rank, port, out)``: each one's program,
    rendezvous on ``port``, rank 0 writing its figures as JSON to ``out``), wait for them within
    ``timeout_s``, kill what is left on any exit, and return rank 0's figures; a failure shows the
    children's last output. Used by the point-to-point, the all-reduce and the links measurements."""
    with tempfile.TemporaryDirectory(prefix=f"paci-{what.replace(' ', '-')}-") as tmp:
        out = os.path.join(tmp, "result.json")
        port = free_port()
        env = {**loopback_env(child_environment(os.environ)), "OMP_NUM_THREADS": "1"}
        procs, logs = [], []
        for rank in range(ranks):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115 -- closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code(rank, port, out)], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} measurement did not finish within {timeout_s:.0f} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            tails = []
            for log in logs:
                log.seek(0)
                tails.append(log.read()[-2000:])
                log.close()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"{what} measurement failed:\n" + "\n".join(tails))
        return json.loads(Path(out).read_text())
