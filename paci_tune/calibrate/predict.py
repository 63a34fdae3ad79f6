"""A config's schedules predicted on a cost profile: the work of ``paci-tune simulate``.

The profile is the one given, or this machine's, measured once and cached
(:func:`.cache.measured_profile`). Each schedule gets its own cut (the memory-aware partitioner,
within ``memory_bytes`` per device when given); a schedule whose stages fit no cut is reported as
not fitting rather than failing the others, unless it is the only one asked for. Interleaved 1F1B
cuts the model into ``v * P`` pieces balanced on the profile's times (the memory-aware partitioner
cuts ``P`` stages) and does not fit when that cut's predicted peak exceeds ``memory_bytes``; ZB-H1
is cut like the others, with its own in-flight count. The command line
only checks its options and renders a :class:`Prediction`. The simulator and the measuring are
looked up when called, not bound at import. May import: :mod:`paci_tune.sim`,
:mod:`paci_tune.pipeline`, :mod:`paci_tune.model`, :mod:`paci_tune.data`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.config`, :mod:`paci_tune.errors`, and the calibrate layer's :mod:`.cache`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.schema import RunConfig
from ..data import load_source
from ..errors import ConfigError
from ..model import load_model
from ..pipeline.checks import check_model_and_data
from ..pipeline.factory import unit_costs
from ..pipeline.planning import check_profile, interleaved_cut, plan_partition
from ..pipeline.tied import tied_groups
from ..schedule import INTERLEAVED, SCHEDULES, check_depth
from ..sim import simulator
from ..sim.plot import plot_timelines
from ..sim.profile import Profile
from ..sim.simulator import SimResult


@dataclass
class Prediction:
    """Each schedule's simulated run of one config on one profile, and the schedules that did not fit."""

    config: RunConfig
    profile: Profile
    profile_path: str
    cached: bool  # measured here (or found in the cache) rather than given
    results: dict[str, SimResult]
    not_fitting: dict[str, str]  # schedule -> why no cut fits the device (or why it is refused: tied parameters)
    memory_bytes: float | None

    def draw_timelines(self, path: str) -> str:
        """The first global batches of each schedule, one above the other, drawn to ``path``."""
        bw = self.config.pipeline.backward_weights
        order = ("1f1b", "gpipe", "paci", *(n for n in self.results if n not in SCHEDULES))
        short = [
            simulator.simulate(self.results[n].layout, self.profile, 2, extend=False, backward_weights=bw)
            for n in order
            if n in self.results
        ]
        return str(plot_timelines(short, path))

    def to_doc(self, config_name: str, timeline: str | None) -> dict[str, Any]:
        """What ``simulate --json`` prints."""
        p, prof, lay = self.config.pipeline, self.profile, self.config.layout
        bw = prof.allreduce.bandwidth_Bps
        doc: dict[str, Any] = {
            "config": config_name,
            "n_stages": lay.stages,
            "data_parallel": lay.data_parallel,
            "devices": lay.devices,
            "window": lay.window,
            "microbatch_size": lay.microbatch_size,
            "global_batch": lay.global_batch,
            "backward_weights": p.backward_weights,
            "seq_len": prof.seq_len,
            "memory_limit_bytes": self.memory_bytes,
            "profile": {
                "path": self.profile_path,
                "cached": self.cached,
                "device": prof.device,
                "dtype": prof.dtype,
                "threads": prof.threads,
                "p2p_latency_s": prof.p2p.latency_s,
                "allreduce_latency_s": prof.allreduce.latency_s,
                "allreduce_bandwidth_Bps": bw if math.isfinite(bw) else None,
            },
            "schedules": {name: r.to_dict() for name, r in self.results.items()},
            "not_fitting": self.not_fitting,
            "timeline": timeline,
        }
        if "paci" in self.results and "1f1b" in self.results:
            doc["paci_vs_1f1b_throughput"] = self.results["paci"].tokens_per_s / self.results["1f1b"].tokens_per_s
        return doc


def predict_schedules(
    cfg: RunConfig,
    *,
    schedules: Sequence[str] = SCHEDULES,
    profile_path: str | None = None,
    batches: int = 8,
    memory_bytes: float | None = None,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
    chunks: int = 2,
) -> Prediction:
    """Simulate ``cfg``'s pipeline under each of ``schedules`` (module docstring); ``chunks``: v of interleaved."""
    check_model_and_data(cfg, built_here=profile_path is None)  # without a profile it is measured here
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    meta = load_model(cfg.model, source.vocab_size, cfg.training.seed, indices=[])
    if profile_path is not None:
        profile, where, cached = Profile.load(profile_path, "--profile"), profile_path, False
    else:
        from . import cache  # looked up when called, like every measuring step (a test's tripwire patches it)

        profile, cache_path = cache.measured_profile(cfg, threads=threads, log=log)
        where, cached = str(cache_path), True
    profile = check_profile(profile, meta.n_units, meta.block_size, "--profile", where, tied_groups(meta))
    p = cfg.pipeline
    check_depth(p.stages, profile.n_units)
    costs = unit_costs(meta)
    results: dict[str, SimResult] = {}
    errors: dict[str, str] = {}
    for name in schedules:
        if name == INTERLEAVED:
            try:
                results[name] = _interleaved(cfg, profile, batches, chunks, memory_bytes)
            except ConfigError as e:
                if len(schedules) == 1:
                    raise
                errors[name] = f"{e.key}: {e.allowed}"
            continue
        try:
            sizes = plan_partition(cfg, costs, profile, schedule=name, memory_bytes=memory_bytes)
        except ConfigError as e:
            if len(schedules) == 1 or e.key != "pipeline.stages":
                raise
            errors[name] = e.allowed
            continue
        layout = dataclasses.replace(p.layout, schedule=name, partition=tuple(sizes), chunks=1)
        try:
            results[name] = simulator.simulate(layout, profile, batches, optimizer=cfg.optimizer.name,
                                               backward_weights=p.backward_weights)  # fmt: skip
        except ConfigError as e:  # PACI on a cut splitting tied parameters: refused, as its runtime does
            if len(schedules) == 1 or e.key != "pipeline.schedule":
                raise
            errors[name] = f"{e.key}: {e.allowed}"
    if not results:
        raise ConfigError("pipeline.stages", p.stages, "; ".join(f"{n}: {msg}" for n, msg in errors.items()))
    return Prediction(cfg, profile, where, cached, results, errors, memory_bytes)


def _interleaved(cfg: RunConfig, profile: Profile, batches: int, chunks: int, memory_bytes: float | None) -> SimResult:
    """Interleaved 1F1B with ``chunks`` per stage on a cut of ``v * P`` pieces balanced on the profile's
    F + B (module docstring); refused when the layout cannot run it or its peak exceeds ``memory_bytes``."""
    p = cfg.pipeline
    layout = dataclasses.replace(p.layout, schedule=INTERLEAVED, chunks=chunks, partition=None)
    pieces = layout.virtual_stages
    if not isinstance(chunks, int) or chunks < 1 or pieces > profile.n_units:
        raise ConfigError("--chunks", chunks, f"1..{profile.n_units // p.stages}: {p.stages} stages x chunks "
                          f"pieces of the model's {profile.n_units} units")  # fmt: skip
    layout = layout.with_partition(interleaved_cut(layout, [1.0] * profile.n_units, profile))
    res = simulator.simulate(layout, profile, batches, optimizer=cfg.optimizer.name)
    if memory_bytes is not None and res.peak_memory_bytes > memory_bytes:
        need = res.peak_memory_bytes / 2**20
        raise ConfigError("pipeline.stages", p.stages, f"interleaved (v={chunks}) needs {need:.0f} MiB per device")
    return res
