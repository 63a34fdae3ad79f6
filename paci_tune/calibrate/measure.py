"""Calibration of a whole config: the stage pattern at every micro-batch size, bytes, p2p -> a Profile.

See :mod:`paci_tune.calibrate` for what is measured and why. May import: :mod:`.units`,
:mod:`.pattern`, :mod:`.corun`, :mod:`.p2p`, :mod:`.allreduce`, :mod:`paci_tune.pipeline` (device and precision),
:mod:`paci_tune.model`, :mod:`paci_tune.data`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import platform
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..base.processes import cpu_count, threads_per_process
from ..config.optimizer import OptimizerConfig
from ..config.schema import RunConfig
from ..data import load_source
from ..errors import ConfigError
from ..model import LoadedModel, input_grads, load_model
from ..pipeline.factory import resolve_device, resolve_precision
from ..pipeline.optim import release_masters
from ..pipeline.tied import tied_groups
from ..sim.profile import AllReduceCost, P2PCost, Profile, UnitCost, UnitProfile
from .allreduce import measure_allreduce
from .corun import co_run_pattern
from .links import measure_links
from .memory import measure_split_bytes, measure_transients, step_transients
from .p2p import P2P_SIZES, measure_p2p
from .pattern import PatternSamples, StagePattern, pooled_costs, pooled_optimizer
from .units import (
    fp32_param_bytes,
    measure_copies,
    measure_optimizer,
    measure_units,
    signature,
    to_compute,
    unit_signature,
)
from .units import probe as probe_unit

Log = Callable[[str], None]

METHOD = "stage-pattern/5"
"""How compute is measured (see the package docstring); part of the profile cache's key. /2: bf16 is
measured with bf16 parameters and fp32 masters (no autocast), and ``param_bytes`` is 4 per parameter.
/3: each unit's ``copy_s`` (a clone of its weights, what ``backward_weights: forward`` pays at a step).
/4: each unit's backward split into its input and weight halves (``backward_input_s`` /
``backward_weight_s``, :mod:`.split`), timed beside the whole backward. /5: the memory transients
(``transient_bytes``, ``eval_bytes``, ``split_bytes`` per size, ``step_bytes`` per unit,
:mod:`.memory`)."""


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block, the caller's restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_threads(stages: int) -> int:
    """Threads one pipeline stage gets when every stage shares this machine's CPUs."""
    return threads_per_process(stages)


def default_processes(stages: int, threads: int, device: torch.device) -> int:
    """Stage processes that compute at once on this machine: what a CPU calibration co-runs.

    A pipeline of P stages with ``threads`` each keeps ``min(P, cpu_count // threads)`` cores busy
    (more stages than that time-share the cores, which no co-runner count reproduces). On CUDA the
    stages are on separate devices: 1.
    """
    if device.type == "cuda":
        return 1
    return max(1, min(max(stages, 1), cpu_count() // max(threads, 1)))


def default_inflight(stages: int) -> int:
    """Micro-batches in flight in the stage pattern: 2 for a pipeline (the first stage's 1F1B), 1 alone."""
    return 2 if stages >= 2 else 1


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
    spec = {
        "model": cfg.model,
        "vocab_size": vocab,
        "n_classes": n_classes,
        "seed": cfg.training.seed,
        "sizes": list(sizes),
        "device": str(device),
        "dtype": dtype,
        "threads": threads,
        "window": window,
        "inflight": inflight,
        "repeats": repeats,
        "warmup": warmup,
        "optimizer": asdict(cfg.optimizer),
    }
    if device.type == "cpu":
        if log:
            log(f"stage pattern in {processes} process(es) at once, {threads} thread(s) each, {inflight} in flight")
        return co_run_pattern(spec, processes, log=log)
    pattern = StagePattern.from_spec(model, spec, device=device, seed=cfg.training.seed)
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
    return pooled_costs(samples, groups, nbytes), pooled_optimizer(samples, units)


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
    allreduce: AllReduceCost | bool = True,
    processes: int | None = None,
    log: Log | None = None,
    optimizers: Sequence[OptimizerConfig] = (),
) -> Profile:
    """Measure ``cfg``'s model on this machine, as a pipeline stage runs it (module docstring).

    Defaults: micro-batch sizes ``b/2, b, 2b`` around the config's ``b`` (so nearby sizes
    interpolate rather than extrapolate), the config's device and precision, ``cpu_count //
    stages`` threads, and on a CPU as many processes at once as the pipeline's stages would keep
    busy (:func:`default_processes`; ``processes`` overrides it, and is ignored on CUDA, where
    stages do not share a device). ``repeats`` and ``warmup`` count global batches of the stage
    pattern (``window`` micro-batches and one optimizer step each). Pass ``p2p`` to reuse a known
    transfer cost and skip the two-process measurement; ``allreduce`` likewise (a known cost, True
    to measure it among two gloo processes, False to leave it out: the profile then derives it from
    ``p2p``). The optimizer step timed in the pattern is ``cfg.optimizer``'s; ``optimizers`` are timed
    too (a search that tunes the optimizer), each by :func:`other_optimizer_steps`.
    """

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
    tied = tied_groups(model)  # the units sharing trainable parameters, before any is moved or cast
    vocab = model.gpt.vocab_size if model.gpt is not None else source.vocab_size
    units = [to_compute(model.units[i], dev, dtype) for i in range(model.n_units)]
    needs_grad = input_grads(model.trainable)  # per unit: whether its input needs a gradient, as at a stage
    # Bytes, and which units are identical (their samples are pooled), from one untimed pass per size.
    gen = torch.Generator(device="cpu").manual_seed(0)
    nbytes: dict[int, list[tuple[int, int]]] = {}
    transients: dict[int, list[tuple[int, int, int]]] = {}  # per size, per unit: transient, eval, split bytes
    groups: dict[int, list[list[int]]] = {}
    n_classes = vocab
    for size in sizes:
        x = torch.randint(0, vocab, (size, model.block_size), generator=gen).to(dev)
        by_sig: dict[str, list[int]] = {}
        nbytes[size], transients[size] = [], []
        seen: dict[str, tuple[int, int, int]] = {}
        for i, unit in enumerate(units):
            sig = signature(unit, x, needs_grad[i])
            by_sig.setdefault(sig, []).append(i)
            last = i == len(units) - 1
            probe = probe_unit(unit, x, last=last, device=dev, dtype=dtype, input_grad=needs_grad[i])
            nbytes[size].append((probe.activation_bytes, probe.saved_bytes))
            if sig not in seen:
                kw = {"last": last, "device": dev, "dtype": dtype, "input_grad": needs_grad[i]}
                split = max(probe.saved_bytes + measure_split_bytes(unit, x, **kw), 0)  # what B leaves held
                seen[sig] = (*measure_transients(unit, x, **kw), split)
            transients[size].append(seen[sig])
            x = probe.output
        n_classes = int(x.shape[-1])  # the logits' width: the range of the pattern's targets
        groups[size] = list(by_sig.values())
        del x, probe
    with torch_threads(n_threads):
        costs, optimizer_s = _stage_costs(
            cfg,
            model,
            units,
            vocab=vocab,
            n_classes=n_classes,
            sizes=sizes,
            device=dev,
            dtype=dtype,
            threads=n_threads,
            processes=n_procs,
            inflight=default_inflight(stages),
            repeats=repeats,
            warmup=warmup,
            groups=groups,
            nbytes=nbytes,
            log=log,
        )
        if costs is None:
            # The whole model with micro-batches in flight does not fit on the device: time units alone.
            if log:
                log("the whole model does not fit on the device: timing units one at a time instead")
            release_masters([p for u in units for p in u.parameters()])
            torch.cuda.empty_cache()
            isolated = measure_units(
                model, vocab, sizes, device=dev, dtype=dtype, repeats=repeats, warmup=warmup, optimizer=cfg.optimizer
            )
            costs, optimizer_s = [u.costs for u in isolated], [u.optimizer_s for u in isolated]
            copy_s = [u.copy_s for u in isolated]
        else:
            copy_s = measure_copies(units, device=dev, repeats=repeats, warmup=warmup)
        costs = [
            {b: c.with_bytes(*transients[b][i]) for b, c in unit_costs.items()} for i, unit_costs in enumerate(costs)
        ]
        step_bytes = step_transients(units, dev, cfg.optimizer)
        others, note = other_optimizer_steps(
            cfg.optimizer, optimizers, units, optimizer_s, device=dev, repeats=repeats, warmup=warmup
        )
    unit_profiles = [
        UnitProfile(
            model.names[i],
            fp32_param_bytes(unit),
            optimizer_s[i],
            costs[i],
            copy_s=copy_s[i],
            trainable_bytes=fp32_param_bytes(unit, trainable=True),
            optimizer_steps=others[i],
            step_bytes=step_bytes[i],
        )
        for i, unit in enumerate(units)
    ]
    if p2p is None:
        biggest = max(u.costs[max(sizes)].activation_bytes for u in unit_profiles[:-1]) if len(units) > 1 else 0
        p2p_sizes = sorted({*P2P_SIZES, min(max(biggest, 1), 64 * 2**20)})
    if p2p is None and allreduce is True:  # both from one pair of processes (their start-up is most of the time)
        if log:
            log("point-to-point transfers and gradient all-reduce (2 gloo processes on loopback)")
        p2p, allreduce = measure_links(p2p_sizes, p2p_repeats=p2p_repeats)
    elif p2p is None:
        if log:
            log("point-to-point transfers (2 gloo processes on loopback)")
        p2p = measure_p2p(p2p_sizes, repeats=p2p_repeats)
    elif allreduce is True:
        if log:
            log("gradient all-reduce (2 gloo processes on loopback)")
        allreduce = measure_allreduce(2)
    return Profile(
        units=unit_profiles,
        p2p=p2p,
        allreduce_cost=allreduce or None,
        tied=tied,
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
        optimizer=cfg.optimizer.timing_key,
        optimizer_note=note,
    )


def other_optimizer_steps(
    timed: OptimizerConfig,
    optimizers: Sequence[OptimizerConfig],
    units: Sequence[nn.Module],
    optimizer_s: Sequence[float],
    *,
    device: torch.device,
    repeats: int,
    warmup: int,
) -> tuple[list[dict[str, float]], str | None]:
    """Per unit, the steps of ``optimizers`` other than ``timed`` (the pattern's): each timed alone on the
    unit and scaled by what the pattern's step took over the same step alone there, so every optimizer is
    charged in the pattern's conditions (caches, co-runners). Returns them and the note saying so."""
    wanted = {o.timing_key: o for o in optimizers if o.timing_key != timed.timing_key}
    out: list[dict[str, float]] = [{} for _ in units]
    if not wanted:
        return out, None
    last = len(units) - 1
    for opt in (timed, *wanted.values()):  # one untimed round first: thread pools, kernels, allocator
        measure_optimizer(units[min(1, last)], device=device, repeats=1, warmup=1, optimizer=opt, hidden=last > 1)
    alone: dict[tuple[str, bool], dict[str, float]] = {}  # identical units (and place) timed once
    for i, unit in enumerate(units):
        sig = (unit_signature(unit), 0 < i < last)
        if sig not in alone:
            kw = {"device": device, "repeats": repeats, "warmup": warmup, "hidden": sig[1]}
            alone[sig] = {
                key: measure_optimizer(unit, optimizer=opt, **kw)
                for key, opt in {timed.timing_key: timed, **wanted}.items()
            }
        base = alone[sig][timed.timing_key]
        ratio = optimizer_s[i] / base if base > 0 else 1.0
        out[i] = {key: alone[sig][key] * ratio for key in wanted}
    note = (
        f"optimizer_steps of {', '.join(wanted)}: timed alone on each unit, x the {timed.timing_key} step's "
        "stage-pattern time over its own time alone there"
    )
    return out, note


def with_optimizers(
    profile: Profile, cfg: RunConfig, optimizers: Sequence[OptimizerConfig], *, repeats: int = 5, warmup: int = 2
) -> Profile:
    """``profile`` (of ``cfg``'s model, perhaps measured on another machine) with the steps of ``optimizers``
    added: each timed alone here on each unit against the profile's own optimizer timed alone, and the
    profile's step scaled by that ratio (:func:`other_optimizer_steps`); the note says where and how.
    What makes a reference profile charge another optimizer without measuring it anew on its machine."""
    from dataclasses import replace

    dev, dtype = resolve_target(cfg, None, profile.dtype)
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    model = load_model(cfg.model, source.vocab_size, cfg.training.seed)
    units = [to_compute(model.units[i], dev, dtype) for i in range(model.n_units)]
    if len(units) != profile.n_units:
        raise ConfigError("--extend", profile.device, f"a profile of this model's {len(units)} units")
    own = dataclasses.replace(cfg.optimizer, name=profile.optimizer.split(" ")[0])
    # Timed on the profile's threads per stage: Muon's small matrix products on more threads than the
    # profile's stages had (or than this machine has free) are slowed by oversubscription, AdamW's
    # element-wise step hardly, so the ratio would not carry over (a 2-thread extension on a busy
    # 2-core machine charged Muon 20x its one-thread step).
    with torch_threads(max(1, int(profile.threads or 1))):
        steps, note = other_optimizer_steps(
            own, optimizers, units, [u.optimizer_s for u in profile.units], device=dev, repeats=repeats, warmup=warmup
        )
    if note is None:
        return profile
    where = (
        f"rescaled on {platform.node()} ({platform.processor() or platform.machine()}) on "
        f"{_dt.date.today().isoformat()} from this profile's {profile.optimizer} step: {note}"
    )
    units_out = [replace(u, optimizer_steps={**u.optimizer_steps, **steps[i]}) for i, u in enumerate(profile.units)]
    return replace(profile, units=units_out, optimizer_note=where)
