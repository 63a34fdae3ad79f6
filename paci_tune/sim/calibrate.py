"""Measure a cost profile (:mod:`paci_tune.sim.profile`) of a config's model on this machine.

What is measured, and why it is measured that way:

- **Per unit, per micro-batch size**: forward and backward time (median of ``repeats`` after
  ``warmup`` untimed passes, which pay for allocator growth and lazy initialisation), the output
  activation's bytes, and the bytes autograd saves for the backward. The first unit gets token
  ids; the last unit's forward includes the cross-entropy loss, as the real last stage computes
  it. Saved bytes come from :func:`torch.autograd.graph.saved_tensors_hooks`, summing distinct
  storages and counting parameter storages as zero: saving a weight keeps no copy alive.
- **Identical units are measured once.** Units with the same class, structure and input shape
  (the blocks of a GPT) cost the same; measuring each separately would only add noise, which the
  partitioner would then "balance" as if it were real.
- **Per unit**: parameter bytes, and one AdamW step over the unit's parameters.
- **Threads**: on a CPU a pipeline stage shares the machine with the other stages, so each unit
  is timed with the threads one stage would get (``cpu_count // stages``, at least 1).
- **Point to point**: two gloo processes on loopback ping-pong tensors of a few sizes; the fastest
  one-way time of each size is fitted to ``latency + bytes / bandwidth``. This is the transport the distributed
  runtime uses on a CPU; for a real interconnect, measure there or edit ``p2p`` by hand.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import RunConfig
from ..errors import ConfigError
from ..model import LoadedModel
from .profile import FORMAT, P2PCost, Profile, UnitCost, UnitProfile

Log = Callable[[str], None]

P2P_SIZES = (4 * 1024, 256 * 1024, 4 * 2**20)
P2P_TIMEOUT_S = 120.0


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_threads(n_stages: int) -> int:
    """Threads one pipeline stage gets when every stage shares this machine's CPUs."""
    return max(1, cpu_count() // max(n_stages, 1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``; tensors without one count their own size."""
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def _saved_bytes(unit: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd saves during ``run()``: distinct storages, parameters' own storages excluded."""
    params = {_storage_key(p)[0] for p in unit.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in params:
            seen[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _signature(unit: nn.Module, x: torch.Tensor) -> str:
    return f"{type(unit).__module__}.{type(unit).__qualname__}|{unit!r}|{tuple(x.shape)}|{x.dtype}"


def measure_unit(
    unit: nn.Module,
    x: torch.Tensor,
    *,
    last: bool,
    device: torch.device,
    dtype: str,
    repeats: int,
    warmup: int = 2,
) -> UnitCost:
    """Time one unit's forward and backward on input ``x`` (ids for the first unit); see module docstring."""
    targets: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    def forward() -> torch.Tensor:
        inp = x.detach().requires_grad_(True) if x.is_floating_point() else x
        with _autocast(device, dtype):
            out = unit(inp)
            if last:
                assert targets is not None
                return F.cross_entropy(out.float().flatten(0, -2), targets.flatten())
        return out

    with torch.no_grad(), _autocast(device, dtype):
        probe = unit(x)
    activation_bytes = probe.numel() * probe.element_size()
    if last:
        targets = torch.randint(0, probe.shape[-1], probe.shape[:-1], device=device)
    else:
        grad = torch.randn_like(probe)
    del probe
    saved = _saved_bytes(unit, forward)

    fwd, bwd = [], []
    for r in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        t2 = time.perf_counter()
        if r >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del out
    return UnitCost(statistics.median(fwd), statistics.median(bwd), activation_bytes, saved)


def measure_optimizer(unit: nn.Module, *, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one AdamW step over ``unit``'s parameters (0 for a unit without any).

    Runs on clones so the unit's weights are untouched.
    """
    params = [p.detach().clone().requires_grad_(True) for p in unit.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for r in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_units(
    model: LoadedModel,
    vocab_size: int,
    microbatch_sizes: Sequence[int],
    *,
    device: torch.device,
    dtype: str,
    repeats: int,
    warmup: int = 2,
    log: Log | None = None,
) -> list[UnitProfile]:
    """Profile every unit of ``model`` at each micro-batch size (identical units measured once)."""
    units = [model.units[i].to(device) for i in range(model.n_units)]
    seq = model.block_size
    costs: list[dict[int, UnitCost]] = [{} for _ in units]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for b in microbatch_sizes:
        x = torch.randint(0, vocab_size, (b, seq), generator=gen).to(device)
        measured: dict[str, UnitCost] = {}
        for i, unit in enumerate(units):
            sig = _signature(unit, x)
            if sig not in measured:
                if log:
                    log(f"unit {i} ({model.names[i]}), micro-batch {b}")
                measured[sig] = measure_unit(
                    unit, x, last=i == len(units) - 1, device=device, dtype=dtype, repeats=repeats, warmup=warmup
                )
            costs[i][b] = measured[sig]
            if i < len(units) - 1:
                with torch.no_grad(), _autocast(device, dtype):
                    x = unit(x)
    out: list[UnitProfile] = []
    opt_seen: dict[str, float] = {}
    for i, unit in enumerate(units):
        param_bytes = sum(p.numel() * p.element_size() for p in unit.parameters())
        sig = f"{type(unit).__qualname__}|{unit!r}"
        if sig not in opt_seen:
            opt_seen[sig] = measure_optimizer(unit, device=device, repeats=repeats, warmup=warmup)
        out.append(UnitProfile(model.names[i], param_bytes, opt_seen[sig], costs[i]))
    for unit in units:
        unit.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------------------ point to point


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2p_worker(rank: int, port: int, sizes: list[int], repeats: int, out_path: str) -> None:
    """One side of the ping-pong; rank 0 writes {bytes: one-way seconds} to ``out_path``.

    The fastest round trip of each size is kept, not the median: on a shared machine scheduler
    noise only ever adds time (a peer that is not running cannot answer), and the median of a few
    round trips swung between 0.08 and 2 ms from one run to the next on a loaded 2-core machine.
    """
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=P2P_TIMEOUT_S),
    )
    peer = 1 - rank
    result: dict[int, float] = {}
    try:
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
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


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
    with tempfile.TemporaryDirectory(prefix="paci-p2p-") as tmp:
        out = os.path.join(tmp, "p2p.json")
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = []
        logs = []
        for rank in range(2):
            args = f"{rank}, {port}, {list(sizes)!r}, {repeats}, {out!r}"
            code = f"from paci_tune.sim.calibrate import _p2p_worker; _p2p_worker({args})"
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115 -- closed below
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"point-to-point measurement did not finish within {timeout_s:.0f} s") from None
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
            raise RuntimeError("point-to-point measurement failed:\n" + "\n".join(tails))
        points = {int(k): float(v) for k, v in json.loads(Path(out).read_text()).items()}
    latency, bandwidth = fit_p2p(points)
    return P2PCost(latency, bandwidth, "gloo-loopback")


# ------------------------------------------------------------------------------ whole config


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def parse_sizes(text: str | Sequence[int] | None, key: str = "microbatch_sizes") -> list[int] | None:
    """``"4,8,16"`` -> [4, 8, 16]; anything else that is not positive integers is a ConfigError."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        sizes = sorted({int(str(s).strip()) for s in items})
    except ValueError:
        raise ConfigError(key, text, "comma-separated positive integers, e.g. 4,8,16") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(key, text, "comma-separated positive integers, e.g. 4,8,16")
    return sizes


def resolve_target(cfg: RunConfig, device: str | None, precision: str | None) -> tuple[torch.device, str]:
    """The device and compute dtype a calibration of ``cfg`` measures on (options override the config)."""
    from ..pipeline.factory import resolve_device, resolve_precision

    dev = resolve_device(device or cfg.pipeline.device)
    return dev, resolve_precision(precision or cfg.pipeline.precision, dev)


def calibrate(
    cfg: RunConfig,
    *,
    microbatch_sizes: Sequence[int] | None = None,
    device: str | None = None,
    precision: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    threads: int | None = None,
    p2p: P2PCost | None = None,
    p2p_repeats: int = 30,
    log: Log | None = None,
) -> Profile:
    """Measure ``cfg``'s model on this machine.

    Defaults: micro-batch sizes ``b/2, b, 2b`` around the config's ``b`` (so nearby sizes
    interpolate rather than extrapolate), the config's device and precision, and
    ``cpu_count // stages`` threads. Pass ``p2p`` to reuse a known transfer cost and skip the
    two-process measurement.
    """
    from ..data import load_source
    from ..model import load_model

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "a positive integer")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError("threads", threads, "a positive integer")
    b = cfg.pipeline.microbatch_size or 1
    sizes = list(microbatch_sizes) if microbatch_sizes else sorted({max(b // 2, 1), b, 2 * b})
    dev, dtype = resolve_target(cfg, device, precision)
    n_threads = threads or default_threads(cfg.pipeline.stages)
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    model = load_model(cfg.model, source.vocab_size, cfg.training.seed)
    vocab = model.gpt.vocab_size if model.gpt is not None else source.vocab_size
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        units = measure_units(model, vocab, sizes, device=dev, dtype=dtype, repeats=repeats, warmup=warmup, log=log)
    finally:
        torch.set_num_threads(before)
    if p2p is None:
        if log:
            log("point-to-point transfers (2 gloo processes on loopback)")
        biggest = max(u.costs[max(sizes)].activation_bytes for u in units[:-1]) if len(units) > 1 else 0
        p2p_sizes = sorted({*P2P_SIZES, min(max(biggest, 1), 64 * 2**20)})
        p2p = measure_p2p(p2p_sizes, repeats=p2p_repeats)
    return Profile(
        units=units,
        p2p=p2p,
        seq_len=model.block_size,
        device=device_name(dev),
        dtype=dtype,
        threads=n_threads,
        torch_version=str(torch.__version__),
        date=_dt.datetime.now().isoformat(timespec="seconds"),
        machine={
            "node": platform.node(),
            "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(),
        },
    )


def cache_key(cfg: RunConfig, device: torch.device, dtype: str, threads: int, microbatch_size: int) -> str:
    """Hash of everything a quick profile depends on: model, data, device, dtype, threads, micro-batch."""
    doc = {
        "format": FORMAT,
        "model": cfg.model,
        "data": cfg.data,
        "device": device_name(device),
        "dtype": dtype,
        "threads": threads,
        "microbatch_size": microbatch_size,
        "torch": str(torch.__version__),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/paci-tune/profiles`` (``~/.cache/...`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paci-tune" / "profiles"


def cached_profile(cfg: RunConfig, *, threads: int | None = None, log: Log | None = None) -> tuple[Profile, Path]:
    """A quick profile of ``cfg`` at its micro-batch size, measured once and then read from the cache.

    Quick means few repeats on the config's device: enough to rank schedules and cuts, not a
    benchmark. The file is written atomically, so concurrent first calls cannot corrupt it.
    """
    dev, dtype = resolve_target(cfg, None, None)
    n_threads = threads or default_threads(cfg.pipeline.stages)
    b = cfg.pipeline.microbatch_size or 1
    path = cache_dir() / f"{cache_key(cfg, dev, dtype, n_threads, b)}.yaml"
    if path.is_file():
        try:
            return Profile.load(path), path
        except ConfigError:
            pass  # a stale or foreign file: measure again and overwrite it
    if log:
        log(f"no profile given; measuring the model once on this machine, cached as {path}")
    profile = calibrate(cfg, microbatch_sizes=[b], repeats=3, warmup=1, threads=n_threads, p2p_repeats=30, log=log)
    profile.save(path)
    return profile, path


__all__ = [
    "cache_dir",
    "cache_key",
    "cached_profile",
    "calibrate",
    "cpu_count",
    "default_threads",
    "fit_p2p",
    "measure_optimizer",
    "measure_p2p",
    "measure_unit",
    "measure_units",
    "parse_sizes",
]
