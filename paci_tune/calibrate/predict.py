"""A config's schedules predicted on a cost profile: the work of ``paci-tune simulate``.

The profile is the one given, or this machine's, measured once and cached
(:func:`.cache.measured_profile`). Each schedule is cut as its run would be, and its memory is the
search's figure, so that ``simulate`` and a search answer one memory question alike: under a device
budget (``--memory-gib``, else the config's ``hardware.memory``) the fastest cut that fits it, else the
leanest, reported over the budget; without one the fastest
(:func:`~paci_tune.pipeline.planning.budget_cut`; interleaved 1F1B's ``v * P`` pieces balanced on the
profile's times). Each stage's memory is the validated model's, walked over its own
actions, plus the device reserve the budget holds (:func:`~paci_tune.pipeline.planning.budget_reserve`:
none on a CPU profile). A schedule the layout refuses is reported as such rather than failing the others,
unless it is the only one asked for. The command line only checks its options and renders a
:class:`Prediction`. The simulator and the measuring are looked up when called, not bound at import.
May import: :mod:`paci_tune.sim`, :mod:`paci_tune.pipeline`, :mod:`paci_tune.model`, :mod:`paci_tune.data`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`, and the calibrate layer's
:mod:`.cache`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import derive_run
from ..config.memory import format_bytes
from ..config.schema import STALENESS_KEYS, TORCH_RUN, RunConfig
from ..data import load_source
from ..errors import ConfigError
from ..model import load_model
from ..pipeline.checks import check_model_and_data
from ..pipeline.planning import (
    budget_cut,
    budget_reserve,
    check_profile,
    predicted_stage_memory,
    unit_refusal,
)
from ..pipeline.tied import tied_groups
from ..schedule import FLUSH, NAMES, check_depth, preference, schedule_of
from ..schedule.registry import PACI
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
    not_fitting: dict[str, str]  # schedule -> why it cannot run here: over the budget (then also in results) or refused
    memory_bytes: int | None  # the device budget: --memory-gib, else the config's hardware.memory

    def draw_timelines(self, path: str) -> str:
        """The first global batches of each schedule, one above the other, drawn to ``path``."""
        bw = self.config.pipeline.backward_weights
        order = sorted(self.results, key=lambda n: (schedule_of(n).asynchronous, preference(n)))
        short = [
            simulator.simulate(self.results[n].layout, self.profile, 2, extend=False, backward_weights=bw)
            for n in order
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
        paci, flush = self.results.get(PACI.name), self.results.get(FLUSH)
        if paci is not None and flush is not None:
            doc["paci_vs_1f1b_throughput"] = paci.tokens_per_s / flush.tokens_per_s
        return doc


def predict_schedules(
    cfg: RunConfig,
    *,
    schedules: Sequence[str] = NAMES,
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
    cap = int(memory_bytes) if memory_bytes is not None else cfg.hardware.memory_bytes
    if cap is not None and (too_small := unit_refusal(profile, cap)):
        key, value = (
            ("--memory-gib", memory_bytes / 2**30)
            if memory_bytes is not None
            else ("hardware.memory", cfg.hardware.memory)
        )
        raise ConfigError(key, value, too_small)
    results: dict[str, SimResult] = {}
    errors: dict[str, str] = {}
    for name in schedules:
        try:
            v = schedule_of(name).chunks_of(chunks)
            if not 1 <= v * p.stages <= profile.n_units:
                key, value = ("--chunks", chunks) if schedule_of(name).chunks is None else ("pipeline.stages", p.stages)
                raise ConfigError(
                    key,
                    value,
                    f"{p.stages} stages x {v} chunks: no more pieces than the model's {profile.n_units} units",
                )
            results[name] = _predict_one(schedule_run(cfg, name, chunks, cap), profile, batches)
        except ConfigError as e:  # refused by this layout (PACI on a cut splitting tied parameters, ...)
            if len(schedules) == 1:
                raise
            errors[name] = f"{e.key}: {e.allowed}"
            continue
        if why := over_budget(results[name], cap):
            errors[name] = why
    if not results:
        raise ConfigError("pipeline.stages", p.stages, "; ".join(f"{n}: {msg}" for n, msg in errors.items()))
    return Prediction(cfg, profile, where, cached, results, errors, cap)


def schedule_run(cfg: RunConfig, name: str, chunks: int, cap: int | None) -> RunConfig:
    """``cfg`` run under schedule ``name`` (``chunks`` per stage if interleaved) with ``cap`` as its device
    budget, read as the search reads a point (:func:`paci_tune.tune.setup.point_run`): PACI's staleness
    controls and torch's class off where the schedule has none, and a profile clock where the config's is
    the wall (zb-h1 and interleaved exist only there on the emulated runtime; memory does not read it)."""
    spec = schedule_of(name)
    over: dict[str, Any] = {"pipeline.schedule": name, "pipeline.chunks": chunks if spec.chunks is None else None}
    if spec.synchronous:
        over.update({f"pipeline.{k}": False if k == "predict_weights" else None for k in STALENESS_KEYS})
    if name not in TORCH_RUN:
        over["pipeline.torch_schedule"] = False
    if cfg.training.clock == "wall":
        over["training.clock"] = "sim"
    if cap is not None:
        over["hardware.memory"] = cap
    return derive_run(cfg.to_doc(), over)


def _predict_one(run: RunConfig, profile: Profile, batches: int) -> SimResult:
    """One schedule's simulated run on the cut its run would use, each stage's memory the search's figure
    (module docstring)."""
    p = run.pipeline
    sizes = budget_cut(run, profile)
    res = simulator.simulate(
        p.layout.with_partition(sizes),
        profile,
        batches,
        optimizer=run.optimizer.name,
        backward_weights=p.backward_weights,
    )
    reserve = budget_reserve(profile)
    memory = [dataclasses.replace(m, overhead=reserve) for m in predicted_stage_memory(run, profile, sizes)]
    stages = [dataclasses.replace(st, memory=m) for st, m in zip(res.per_stage, memory, strict=True)]
    return dataclasses.replace(res, per_stage=stages)


def over_budget(result: SimResult, cap: int | None) -> str | None:
    """Why ``result``'s layout does not fit ``cap`` bytes a device (None when it does, or without a cap)."""
    if cap is None or result.peak_memory_bytes <= cap:
        return None
    worst = max(result.per_stage, key=lambda st: st.peak_memory_bytes)
    return (
        f"predicted peak {format_bytes(worst.peak_memory_bytes)} on stage {worst.stage} over the budget of "
        f"{format_bytes(cap)} a device, on its leanest cut"
    )
