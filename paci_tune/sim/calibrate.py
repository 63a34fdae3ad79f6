"""Measure a cost profile (:mod:`paci_tune.sim.profile`) of a config's model on this machine.

A profile exists to predict a *pipeline*, so compute is timed under the conditions a pipeline
stage runs in rather than one unit at a time in a tight loop on an idle machine. Timed that way,
the simulator came out 16-22% fast against the distributed runtime at P=2 on a 2-core CPU, for
two reasons of about equal weight: (1) *composition* -- in a stage the units run chained, with
several micro-batches in flight, so a unit finds its input, its saved activations and its weights
out of cache, where a unit timed alone on the same input finds them hot; (2) *concurrency* --
every core runs a stage process at once, sharing caches and memory bandwidth, where calibration
ran alone. What is measured, and how:

- **Compute, in a stage pattern.** The whole model runs as one stage runs its units: chained in
  order (one forward through all of them, one backward call over the chain), 1F1B with
  ``inflight`` micro-batches in flight (2 for a pipeline of 2+ stages, as the first stage's
  steady state has; 1 for a single stage), every micro-batch with its own data, the last unit's
  forward including the cross-entropy loss scaled by 1/window as the real last stage computes
  it, and an optimizer step after every ``window`` backwards. Per-unit times -- the partitioner
  needs them, not just a total -- come from timestamps between the units' forwards, and in the
  backward from hooks on the tensors at the unit boundaries: the gradient of unit ``i``'s output
  is complete exactly when unit ``i+1``'s backward is done. Attributing the chain's own time this
  way keeps the per-unit costs summing to what a stage of those units takes, with no fudge
  factor, and works for any partition the partitioner may pick.
- **Optimizer step**, in the same pattern: the config's optimizer built as a stage builds it
  (weight-decay groups, stepping through parameter *aliases* so in-flight micro-batches keep
  working), one per unit, stepped in unit order with timestamps between, on the real gradients
  of the window -- whose optimizer state and gradients are then as cold as in the pipeline (an
  AdamW step over a stage took 3.1 ms in the pipeline against 0.76 ms per block timed alone).
  Gradient-norm clipping is included when the config clips (every step, as an upper bound).
- **Concurrency (CPU).** The measurement runs in ``processes = min(stages, cpu_count // threads)``
  processes at once (the stage processes the distributed runtime would run here at once), each
  with ``threads`` threads and the environment the distributed launcher gives its workers. They
  start the timed phase together at a barrier and keep running the pattern, untimed, until the
  last of them is done, so no timed pass runs on a quieter machine than a stage does. The
  samples of all processes are pooled. The processes are plain ``python -c`` children talking
  over pipes: each step has a timeout, and every child is killed on any exit path (and dies
  with this process, via the parent-death signal, if it is killed). On CUDA the stages run on
  different devices, so there is no contention to reproduce: one in-process measurement.
- **Repeats**: per micro-batch size, ``warmup`` untimed global batches (allocator growth, lazy
  initialisation, optimizer state), then ``repeats`` timed ones (``repeats * window`` samples of
  each forward and backward); a cost is the median of its samples, not the mean, so that a
  one-off stall of the machine while calibrating does not stay in a profile used long after.
- **Identical units pool their samples** into one cost. Units with the same class, structure and
  input shape (the blocks of a GPT) cost the same; separate costs would only differ by noise,
  which the partitioner would then "balance" as if it were real.
- **Bytes** per unit and micro-batch size: the output activation's bytes, and the bytes autograd
  saves for the backward, from :func:`torch.autograd.graph.saved_tensors_hooks`, summing distinct
  storages and counting parameter storages as zero (saving a weight keeps no copy alive).
  Parameter bytes per unit.
- **Threads**: on a CPU a stage shares the machine with the other stages, so it is timed with
  the threads one stage process gets (``cpu_count // stages``, at least 1).
- **Point to point** (:mod:`paci_tune.sim.p2p_cost`): two gloo processes on loopback ping-pong
  tensors of a few sizes; the
  fastest one-way time of each size is fitted to ``latency + bytes / bandwidth``. This is the
  transport the distributed runtime uses on a CPU; for a real interconnect, measure there or
  edit ``p2p`` by hand.

Not modelled, so simulated step times still run 5-10% under measured ones on a 2-core CPU:

- the pipeline's own jitter. A stage idles whenever a neighbour's pass runs long, and 1F1B with
  ``P - s`` in flight has no slack to absorb that: about 7% of the step, which a deterministic
  simulator cannot predict;
- the transport's CPU: gloo's threads take ~3% of a core per stage, stolen from compute when
  every core computes (the ``p2p`` cost is a delay on the link, measured on idle cores);
- the runtime's start-up: the first micro-batches of a run (fresh memory for the micro-batches
  in flight, the optimizer's first state) take several times longer, a one-off ~0.1 s;
- position: a per-unit profile cannot tell stages apart, and the last stage, with one
  micro-batch in flight, runs its units a few percent faster than the pattern's two.

:func:`measure_unit` (one unit alone) remains for quick checks and as the fallback when the
whole model with its micro-batches in flight does not fit on a GPU.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import OptimizerConfig, RunConfig
from ..errors import ConfigError
from ..model import LoadedModel
from .p2p_cost import P2P_SIZES, fit_p2p, measure_p2p
from .profile import FORMAT, P2PCost, Profile, UnitCost, UnitProfile

Log = Callable[[str], None]

MEASURE_IDLE_TIMEOUT_S = 300.0
"""A timing process silent this long is stuck: each one reports after every global batch."""
MEASURE_EXIT_TIMEOUT_S = 30.0
METHOD = "stage-pattern/1"
"""How compute is measured (module docstring); part of the quick-profile cache key."""
DATA_POOL = 4
"""Distinct micro-batches of data per size, cycled, so micro-batches in flight differ."""


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_threads(n_stages: int) -> int:
    """Threads one pipeline stage gets when every stage shares this machine's CPUs."""
    return max(1, cpu_count() // max(n_stages, 1))


def default_processes(n_stages: int, threads: int, device: torch.device) -> int:
    """Stage processes that compute at once on this machine: what a CPU calibration co-runs.

    A pipeline of P stages with ``threads`` each keeps ``min(P, cpu_count // threads)`` cores busy
    (more stages than that time-share the cores, which no co-runner count reproduces). On CUDA the
    stages are on separate devices: 1.
    """
    if device.type == "cuda":
        return 1
    return max(1, min(max(n_stages, 1), cpu_count() // max(threads, 1)))


def default_inflight(n_stages: int) -> int:
    """Micro-batches in flight in the stage pattern: 2 for a pipeline (the first stage's 1F1B), 1 alone."""
    return 2 if n_stages >= 2 else 1


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


def _unit_signature(unit: nn.Module) -> str:
    """Units with equal signatures have equal optimizer steps (same class, structure, parameter shapes)."""
    return f"{type(unit).__module__}.{type(unit).__qualname__}|{unit!r}"


@dataclass(frozen=True)
class _Probe:
    """What one unit's forward on an input shows without timing anything."""

    activation_bytes: int
    saved_bytes: int
    output: torch.Tensor  # detached: the next unit's input


def _probe(unit: nn.Module, x: torch.Tensor, *, last: bool, device: torch.device, dtype: str) -> _Probe:
    """Output activation bytes and saved bytes of ``unit`` on ``x`` (the last unit with its loss)."""
    with torch.no_grad(), _autocast(device, dtype):
        out = unit(x)
    targets = torch.randint(0, out.shape[-1], out.shape[:-1], device=device) if last else None

    def forward() -> torch.Tensor:
        inp = x.detach().requires_grad_(True) if x.is_floating_point() else x
        with _autocast(device, dtype):
            y = unit(inp)
            if targets is not None:
                return F.cross_entropy(y.float().flatten(0, -2), targets.flatten())
        return y

    return _Probe(out.numel() * out.element_size(), _saved_bytes(unit, forward), out.detach())


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
    """Time one unit alone, forward and backward on input ``x`` (ids for the first unit).

    Median of ``repeats`` after ``warmup`` untimed passes. This is the *isolated* cost, which
    under-predicts a pipeline stage (module docstring); :func:`calibrate` uses the stage pattern
    and keeps this for quick checks and as a fallback.
    """
    probe = _probe(unit, x, last=last, device=device, dtype=dtype)
    out_shape = probe.output.shape
    targets = torch.randint(0, out_shape[-1], out_shape[:-1], device=device) if last else None
    grad = None if last else torch.randn_like(probe.output)

    def forward() -> torch.Tensor:
        inp = x.detach().requires_grad_(True) if x.is_floating_point() else x
        with _autocast(device, dtype):
            out = unit(inp)
            if targets is not None:
                return F.cross_entropy(out.float().flatten(0, -2), targets.flatten())
        return out

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
    return UnitCost(statistics.median(fwd), statistics.median(bwd), probe.activation_bytes, probe.saved_bytes)


def measure_optimizer(unit: nn.Module, *, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one AdamW step over ``unit``'s parameters alone (0 for a unit without any).

    Runs on clones so the unit's weights are untouched. Isolated, hence optimistic: see the
    module docstring for the step :func:`calibrate` measures.
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
    """Profile every unit of ``model`` *in isolation* at each micro-batch size (identical units once).

    The isolated measurement (see :func:`measure_unit`); :func:`calibrate` measures the stage
    pattern instead and uses this only where that does not fit on the device.
    """
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
        sig = _unit_signature(unit)
        if sig not in opt_seen:
            opt_seen[sig] = measure_optimizer(unit, device=device, repeats=repeats, warmup=warmup)
        out.append(UnitProfile(model.names[i], param_bytes, opt_seen[sig], costs[i]))
    for unit in units:
        unit.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------------------ stage pattern


@dataclass
class _Pending:
    """A micro-batch between its forward and its backward in the stage pattern."""

    size: int
    loss: torch.Tensor
    record: bool
    marks: list[float | None]  # when the gradient of unit i's output was complete (set by hooks)


@dataclass
class PatternSamples:
    """Seconds per unit from a :class:`StagePattern`: ``forward[b][i]`` is unit i's samples at size b."""

    forward: dict[int, list[list[float]]] = field(default_factory=dict)
    backward: dict[int, list[list[float]]] = field(default_factory=dict)
    optimizer: list[list[float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "forward": {str(b): v for b, v in self.forward.items()},
            "backward": {str(b): v for b, v in self.backward.items()},
            "optimizer": self.optimizer,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PatternSamples:
        return cls(
            {int(b): v for b, v in doc["forward"].items()},
            {int(b): v for b, v in doc["backward"].items()},
            doc["optimizer"],
        )


class StagePattern:
    """The whole model run the way a pipeline stage runs its units (see the module docstring).

    ``microbatch(b)`` is one 1F1B step: a forward of a new micro-batch, then, once ``inflight``
    are in flight, the backward of the oldest, and after every ``window`` backwards an optimizer
    step. Passes started with ``record=True`` add their per-unit times to :attr:`samples`.
    Weights change as training would change them (through parameter aliases, as
    :class:`paci_tune.pipeline.stage.Stage` steps), so run it on a model you can throw away.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        *,
        vocab_size: int,
        n_classes: int,
        seq_len: int,
        device: torch.device,
        dtype: str,
        window: int,
        inflight: int,
        optimizer: OptimizerConfig,
        seed: int = 0,
    ) -> None:
        from ..pipeline.stage import build_optimizer

        self.units = [u.to(device) for u in units]
        self.vocab_size, self.n_classes, self.seq_len = vocab_size, n_classes, seq_len
        self.device, self.dtype = device, dtype
        self.window, self.inflight = max(window, 1), max(inflight, 1)
        self.grad_clip = optimizer.grad_clip
        self.params = [[p for p in u.parameters() if p.requires_grad] for u in self.units]
        self.aliases = [[p.data for p in ps] for ps in self.params]
        self.optimizers = [build_optimizer(a, optimizer) if a else None for a in self.aliases]
        self.samples = PatternSamples(optimizer=[[] for _ in self.units])
        self._pending: deque[_Pending] = deque()
        self._backwards = 0
        self._data: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._turn = 0
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    def _batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b not in self._data:
            shape = (b, self.seq_len)
            self._data[b] = [
                (
                    torch.randint(0, self.vocab_size, shape, generator=self._gen).to(self.device),
                    torch.randint(0, self.n_classes, shape, generator=self._gen).to(self.device),
                )
                for _ in range(DATA_POOL)
            ]
        self._turn += 1
        return self._data[b][self._turn % DATA_POOL]

    def _mark(self, marks: list[float | None], i: int) -> Callable[[torch.Tensor], None]:
        device = self.device

        def hook(grad: torch.Tensor) -> None:
            _sync(device)
            marks[i] = time.perf_counter()

        return hook

    def forward(self, b: int, record: bool) -> None:
        """Forward a new micro-batch of size ``b`` through every unit; it is then in flight."""
        x, y = self._batch(b)
        n = len(self.units)
        times = [0.0] * n
        marks: list[float | None] = [None] * (n - 1)
        h = x
        _sync(self.device)
        t = time.perf_counter()
        with _autocast(self.device, self.dtype):
            for i, unit in enumerate(self.units):
                h = unit(h)
                if i == n - 1:
                    h = F.cross_entropy(h.float().flatten(0, -2), y.flatten()) / self.window
                elif h.requires_grad:
                    h.register_hook(self._mark(marks, i))
                _sync(self.device)
                now = time.perf_counter()
                times[i], t = now - t, now
        if record:
            per_unit = self.samples.forward.setdefault(b, [[] for _ in range(n)])
            for i, s in enumerate(times):
                per_unit[i].append(s)
        self._pending.append(_Pending(b, h, record, marks))

    def backward(self) -> None:
        """Backward of the oldest micro-batch in flight; an optimizer step when a window is complete."""
        mb = self._pending.popleft()
        n = len(self.units)
        _sync(self.device)
        t0 = time.perf_counter()
        mb.loss.backward()
        _sync(self.device)
        t_end = time.perf_counter()
        # edges[k]: when unit k's backward ended (= unit k-1's began); edges[n] is the start.
        edges: list[float] = [t_end] + [0.0] * n
        edges[n] = t0
        for k in range(n - 1, 0, -1):
            mark = mb.marks[k - 1]
            edges[k] = mark if mark is not None else edges[k + 1]  # no hook: the unit before gets it all
        if mb.record:
            per_unit = self.samples.backward.setdefault(mb.size, [[] for _ in range(n)])
            for i in range(n):
                per_unit[i].append(max(edges[i] - edges[i + 1], 0.0))
        self._backwards += 1
        if self._backwards % self.window == 0:
            self.step(mb.record)

    def step(self, record: bool) -> None:
        """One optimizer step per unit, in order, through the aliases, as a stage steps (module docstring)."""
        _sync(self.device)
        t = time.perf_counter()
        for i, (params, aliases, opt) in enumerate(zip(self.params, self.aliases, self.optimizers, strict=True)):
            if opt is not None:
                for p, alias in zip(params, aliases, strict=True):
                    alias.grad = p.grad
                if self.grad_clip:
                    grads = [a.grad for a in aliases if a.grad is not None]
                    norm = float(sum(torch.linalg.vector_norm(g.float()) ** 2 for g in grads)) ** 0.5
                    coef = self.grad_clip / (norm + 1e-6)
                    for g in grads:
                        g.mul_(min(coef, 1.0))
                opt.step()
                for p, alias in zip(params, aliases, strict=True):
                    p.grad = None
                    alias.grad = None
            _sync(self.device)
            now = time.perf_counter()
            if record:
                self.samples.optimizer[i].append(now - t)
            t = now

    def microbatch(self, b: int, record: bool) -> None:
        """One 1F1B step: forward a new micro-batch; backward the oldest once ``inflight`` are in flight."""
        self.forward(b, record)
        if len(self._pending) >= self.inflight:
            self.backward()

    def drain(self) -> None:
        while self._pending:
            self.backward()

    def measure(self, b: int, *, repeats: int, warmup: int, on_batch: Callable[[], None] | None = None) -> None:
        """``warmup`` untimed then ``repeats`` timed global batches at size ``b``, drained at the end."""
        for k in range(warmup + repeats):
            for _ in range(self.window):
                self.microbatch(b, record=k >= warmup)
            if on_batch:
                on_batch()
        self.drain()


def _timing_worker(spec_path: str) -> None:
    """One process of a co-run (:func:`co_run_pattern`), started as ``python -c``.

    Protocol, one line each: it says ``ready`` on stdout once built, waits for ``go`` on stdin,
    says ``batch`` after every global batch and ``done`` once its samples are written, then keeps
    running the pattern untimed (so the others stay contended) until ``stop`` or end of input.
    Stray prints go to stderr so they cannot garble the protocol.
    """
    from ..model import load_model
    from ..pipeline.lifetime import die_with_parent

    spec = json.loads(Path(spec_path).read_text())
    die_with_parent(parent=spec["parent_pid"])
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def say(word: str) -> None:
        proto.write(word + "\n")
        proto.flush()

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["model"], spec["vocab_size"], spec["seed"])
    pattern = StagePattern(
        [model.units[i] for i in range(model.n_units)],
        vocab_size=spec["vocab_size"],
        n_classes=spec["n_classes"],
        seq_len=model.block_size,
        device=torch.device(spec["device"]),
        dtype=spec["dtype"],
        window=spec["window"],
        inflight=spec["inflight"],
        optimizer=OptimizerConfig(**{**spec["optimizer"], "betas": tuple(spec["optimizer"]["betas"])}),
        seed=spec["rank"],
    )
    say("ready")
    if sys.stdin.readline().strip() != "go":
        return
    stop = threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=listen, daemon=True).start()
    sizes: list[int] = spec["sizes"]
    for b in sizes:
        say(f"size {b}")
        pattern.measure(b, repeats=spec["repeats"], warmup=spec["warmup"], on_batch=lambda: say("batch"))
    Path(spec["out"]).write_text(json.dumps(pattern.samples.to_json()))
    say("done")
    while not stop.is_set():
        pattern.microbatch(sizes[-1], record=False)


def _pump(rank: int, stream: IO[str], lines: queue.Queue[tuple[int, str | None]]) -> None:
    """Forward a child's stdout lines to ``lines``; ``None`` marks its end."""
    with contextlib.suppress(OSError, ValueError):
        for line in stream:
            lines.put((rank, line.strip()))
    lines.put((rank, None))


def _await(
    lines: queue.Queue[tuple[int, str | None]], word: str, n: int, timeout_s: float, log: Log | None = None
) -> None:
    """Wait until ``n`` children said ``word``; relay rank 0's ``size`` lines; raise if one ends or stalls."""
    said: set[int] = set()
    while len(said) < n:
        try:
            rank, line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"a timing process was silent for {timeout_s:.0f} s (waiting for {word!r})") from None
        if line is None:
            raise RuntimeError(f"timing process {rank} exited early (waiting for {word!r})")
        if line == word:
            said.add(rank)
        elif line.startswith("size ") and rank == 0 and log:
            log(f"stage pattern, micro-batch {line[5:]}")


def co_run_pattern(
    spec: dict[str, Any], processes: int, *, idle_timeout_s: float = MEASURE_IDLE_TIMEOUT_S, log: Log | None = None
) -> list[PatternSamples]:
    """Run the stage pattern in ``processes`` child processes at once; every child's samples.

    ``spec`` says what to build and measure (see :func:`_timing_worker`). Children get the
    environment the distributed launcher gives its workers (threads, malloc tunables) and this
    process's import path. Any failure, stall (no line for ``idle_timeout_s``) or interruption
    kills every child before raising.
    """
    with tempfile.TemporaryDirectory(prefix="paci-calibrate-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")  # as pipeline/launch.py sets for workers
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        procs: list[subprocess.Popen[str]] = []
        logs: list[IO[str]] = []
        readers: list[threading.Thread] = []
        outs = [os.path.join(tmp, f"samples{r}.json") for r in range(processes)]
        error: BaseException | None = None
        try:
            for rank in range(processes):
                spec_path = os.path.join(tmp, f"spec{rank}.json")
                Path(spec_path).write_text(
                    json.dumps({**spec, "rank": rank, "out": outs[rank], "parent_pid": os.getpid()}, default=str)
                )
                code = f"from paci_tune.sim.calibrate import _timing_worker; _timing_worker({spec_path!r})"
                err = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115 -- closed below
                logs.append(err)
                proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    text=True,
                )
                procs.append(proc)
                assert proc.stdout is not None
                reader = threading.Thread(target=_pump, args=(rank, proc.stdout, lines), daemon=True)
                reader.start()
                readers.append(reader)
            _await(lines, "ready", processes, idle_timeout_s)
            for proc in procs:  # the barrier: every child is built, all start timing now
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            _await(lines, "done", processes, idle_timeout_s, log)
            # Every sample is written: let the children go, and kill any still in a long pass.
            for proc in procs:
                assert proc.stdin is not None
                with contextlib.suppress(OSError):
                    proc.stdin.write("stop\n")
                    proc.stdin.close()
            deadline = time.monotonic() + MEASURE_EXIT_TIMEOUT_S
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except (RuntimeError, OSError) as exc:
            error = exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for pipe in (proc.stdin, proc.stdout):
                    with contextlib.suppress(OSError):
                        if pipe is not None:
                            pipe.close()
            for reader in readers:
                reader.join(timeout=5)
            tails = []
            for rank, err in enumerate(logs):
                err.seek(0)
                tail = err.read()[-2000:].strip()
                if tail:
                    tails.append(f"[timing process {rank}]\n{tail}")
                err.close()
        if error is not None:
            raise RuntimeError(f"stage-pattern measurement failed: {error}\n" + "\n".join(tails)) from error
        return [PatternSamples.from_json(json.loads(Path(p).read_text())) for p in outs]


def _pooled_costs(
    samples: Sequence[PatternSamples], groups: dict[int, list[list[int]]], nbytes: dict[int, list[tuple[int, int]]]
) -> list[dict[int, UnitCost]]:
    """Per unit and size: the median over every process's samples of every unit in its group.

    ``groups[b]`` partitions the unit indices into identical units; ``nbytes[b][i]`` is unit i's
    (activation bytes, saved bytes) at size b.
    """
    n = len(next(iter(nbytes.values())))
    costs: list[dict[int, UnitCost]] = [{} for _ in range(n)]
    for b, members in groups.items():
        for group in members:
            fwd = statistics.median(s for smp in samples for i in group for s in smp.forward[b][i])
            bwd = statistics.median(s for smp in samples for i in group for s in smp.backward[b][i])
            for i in group:
                costs[i][b] = UnitCost(fwd, bwd, *nbytes[b][i])
    return costs


def _pooled_optimizer(samples: Sequence[PatternSamples], units: Sequence[nn.Module]) -> list[float]:
    """Per unit: the median optimizer step over every process and every unit of the same structure."""
    by_sig: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        by_sig.setdefault(_unit_signature(unit), []).append(i)
    out = [0.0] * len(units)
    for members in by_sig.values():
        pooled = [s for smp in samples for i in members for s in smp.optimizer[i]]
        for i in members:
            out[i] = statistics.median(pooled) if pooled else 0.0
    return out


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


def _measure_pattern(
    cfg: RunConfig,
    model: LoadedModel,
    *,
    vocab: int,
    n_classes: int,
    sizes: Sequence[int],
    device: torch.device,
    dtype: str,
    threads: int,
    processes: int,
    inflight: int,
    repeats: int,
    warmup: int,
    log: Log | None,
) -> list[PatternSamples]:
    """Stage-pattern samples: from ``processes`` children on a CPU, in this process on CUDA."""
    window = cfg.pipeline.window or 4
    if device.type == "cpu":
        if log:
            log(f"stage pattern in {processes} process(es) at once, {threads} thread(s) each, {inflight} in flight")
        spec = {
            "model": cfg.model,
            "vocab_size": vocab,
            "n_classes": n_classes,
            "seed": cfg.training.seed,
            "sizes": list(sizes),
            "device": "cpu",
            "dtype": dtype,
            "threads": threads,
            "window": window,
            "inflight": inflight,
            "repeats": repeats,
            "warmup": warmup,
            "optimizer": asdict(cfg.optimizer),
        }
        return co_run_pattern(spec, processes, log=log)
    pattern = StagePattern(
        [model.units[i] for i in range(model.n_units)],
        vocab_size=vocab,
        n_classes=n_classes,
        seq_len=model.block_size,
        device=device,
        dtype=dtype,
        window=window,
        inflight=inflight,
        optimizer=cfg.optimizer,
        seed=cfg.training.seed,
    )
    for b in sizes:
        if log:
            log(f"stage pattern, micro-batch {b}")
        pattern.measure(b, repeats=repeats, warmup=warmup)
    return [pattern.samples]


def _stage_costs(
    cfg: RunConfig,
    model: LoadedModel,
    units: Sequence[nn.Module],
    *,
    groups: dict[int, list[list[int]]],
    nbytes: dict[int, list[tuple[int, int]]],
    **kw: Any,
) -> tuple[list[dict[int, UnitCost]] | None, list[float]]:
    """Per-unit costs and optimizer steps from the stage pattern; ``(None, [])`` if it ran out of GPU memory.

    The out-of-memory error is dropped here, not handled by the caller, so its traceback (and with
    it the pattern's tensors) is gone before anything else is measured.
    """
    try:
        samples = _measure_pattern(cfg, model, **kw)
    except torch.cuda.OutOfMemoryError:
        return None, []
    return _pooled_costs(samples, groups, nbytes), _pooled_optimizer(samples, units)


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
    processes: int | None = None,
    log: Log | None = None,
) -> Profile:
    """Measure ``cfg``'s model on this machine, as a pipeline stage runs it (module docstring).

    Defaults: micro-batch sizes ``b/2, b, 2b`` around the config's ``b`` (so nearby sizes
    interpolate rather than extrapolate), the config's device and precision, ``cpu_count //
    stages`` threads, and on a CPU as many processes at once as the pipeline's stages would keep
    busy (:func:`default_processes`; ``processes`` overrides it, and is ignored on CUDA, where
    stages do not share a device). ``repeats`` and ``warmup`` count global batches of the stage
    pattern (``window`` micro-batches and one optimizer step each). Pass ``p2p`` to reuse a known
    transfer cost and skip the two-process measurement.
    """
    from ..data import load_source
    from ..model import load_model

    def bad(value: object, minimum: int) -> bool:
        return isinstance(value, bool) or not isinstance(value, int) or value < minimum

    if bad(repeats, 1):
        raise ConfigError("repeats", repeats, "a positive integer")
    if bad(warmup, 0):
        raise ConfigError("warmup", warmup, "an integer >= 0")
    for key, value in (("threads", threads), ("processes", processes)):
        if value is not None and bad(value, 1):
            raise ConfigError(key, value, "a positive integer")
    b = cfg.pipeline.microbatch_size or 1
    sizes = list(microbatch_sizes) if microbatch_sizes else sorted({max(b // 2, 1), b, 2 * b})
    dev, dtype = resolve_target(cfg, device, precision)
    stages = cfg.pipeline.stages
    n_threads = threads or default_threads(stages)
    n_procs = processes or default_processes(stages, n_threads, dev)
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    model = load_model(cfg.model, source.vocab_size, cfg.training.seed)
    vocab = model.gpt.vocab_size if model.gpt is not None else source.vocab_size
    units = [model.units[i].to(dev) for i in range(model.n_units)]
    # Bytes, and which units are identical (their samples are pooled), from one untimed pass per size.
    gen = torch.Generator(device="cpu").manual_seed(0)
    nbytes: dict[int, list[tuple[int, int]]] = {}
    groups: dict[int, list[list[int]]] = {}
    n_classes = vocab
    for size in sizes:
        x = torch.randint(0, vocab, (size, model.block_size), generator=gen).to(dev)
        by_sig: dict[str, list[int]] = {}
        nbytes[size] = []
        for i, unit in enumerate(units):
            by_sig.setdefault(_signature(unit, x), []).append(i)
            probe = _probe(unit, x, last=i == len(units) - 1, device=dev, dtype=dtype)
            nbytes[size].append((probe.activation_bytes, probe.saved_bytes))
            x = probe.output
        n_classes = int(x.shape[-1])  # the logits' width: the range of the pattern's targets
        groups[size] = list(by_sig.values())
        del x, probe
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        costs, optimizer_s = _stage_costs(
            cfg, model, units, vocab=vocab, n_classes=n_classes, sizes=sizes, device=dev, dtype=dtype,
            threads=n_threads, processes=n_procs, inflight=default_inflight(stages), repeats=repeats,
            warmup=warmup, groups=groups, nbytes=nbytes, log=log,
        )  # fmt: skip
        if costs is None:
            # The whole model with micro-batches in flight does not fit on the device: time units alone.
            if log:
                log("the whole model does not fit on the device: timing units one at a time instead")
            torch.cuda.empty_cache()
            isolated = measure_units(model, vocab, sizes, device=dev, dtype=dtype, repeats=repeats, warmup=warmup)
            costs, optimizer_s = [u.costs for u in isolated], [u.optimizer_s for u in isolated]
    finally:
        torch.set_num_threads(before)
    unit_profiles = [
        UnitProfile(
            model.names[i], sum(p.numel() * p.element_size() for p in unit.parameters()), optimizer_s[i], costs[i]
        )
        for i, unit in enumerate(units)
    ]
    if p2p is None:
        if log:
            log("point-to-point transfers (2 gloo processes on loopback)")
        biggest = max(u.costs[max(sizes)].activation_bytes for u in unit_profiles[:-1]) if len(units) > 1 else 0
        p2p_sizes = sorted({*P2P_SIZES, min(max(biggest, 1), 64 * 2**20)})
        p2p = measure_p2p(p2p_sizes, repeats=p2p_repeats)
    return Profile(
        units=unit_profiles,
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
    """Hash of everything a quick profile depends on: model, data, device, dtype, threads, micro-batch.

    Also the measurement method and the pipeline shape it reproduces (stages set the co-runners
    and micro-batches in flight, the window the optimizer's cadence): a profile measured another
    way is not reused.
    """
    doc = {
        "format": FORMAT,
        "model": cfg.model,
        "data": cfg.data,
        "device": device_name(device),
        "dtype": dtype,
        "threads": threads,
        "microbatch_size": microbatch_size,
        "torch": str(torch.__version__),
        "method": METHOD,
        "stages": cfg.pipeline.stages,
        "window": cfg.pipeline.window,
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
    "PatternSamples",
    "StagePattern",
    "cache_dir",
    "cache_key",
    "cached_profile",
    "calibrate",
    "co_run_pattern",
    "cpu_count",
    "default_inflight",
    "default_processes",
    "default_threads",
    "fit_p2p",
    "measure_optimizer",
    "measure_p2p",
    "measure_unit",
    "measure_units",
    "parse_sizes",
]
