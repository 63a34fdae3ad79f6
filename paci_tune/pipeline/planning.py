"""Decisions made before a run starts: the stage cut, and whether the stages fit in memory.

With a cost profile (``training.profile``), ``partition: auto`` uses the measured, memory-aware
partitioner, and the run's predicted peak memory per stage is checked against the device: a
configuration that will not fit is refused with the numbers, not discovered by an OOM. Without
one, the cut balances FLOP estimates and no prediction is made.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..config.schema import RunConfig
from ..errors import ConfigError
from ..sim.memory import GIB, stage_memory
from ..sim.partitioner import partition as profile_partition
from ..sim.profile import Profile
from .partition import resolve_partition, stage_units
from .schedules import inflight_cap


def load_profile(cfg: RunConfig, n_units: int) -> Profile | None:
    """The run's cost profile, checked against the model it is used for."""
    path = cfg.training.profile
    if not path:
        return None
    profile = Profile.load(path, key="training.profile")
    if profile.n_units != n_units:
        raise ConfigError(
            "training.profile", path, f"a profile of this model ({n_units} units; this one has {profile.n_units})"
        )
    return profile


def memory_available(device: torch.device, processes_here: int) -> float:
    """Bytes one stage process may use: the GPU's memory, or this machine's free RAM shared out."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(free) / max(processes_here, 1)


def predicted_memory(cfg: RunConfig, profile: Profile, sizes: Sequence[int]) -> list[int]:
    """Peak bytes per stage: weights, gradients, optimizer state, in-flight activations."""
    p = cfg.pipeline
    assert p.window is not None and p.microbatch_size is not None
    out = []
    for s, units in enumerate(stage_units(sizes)):
        inflight = inflight_cap(p.schedule, s, p.stages, p.window, p.inflight)
        mem = stage_memory(
            profile, list(units), p.microbatch_size, inflight, last=s == p.stages - 1, optimizer=cfg.optimizer.name
        )
        out.append(mem.total)
    return out


def choose_partition(
    cfg: RunConfig, unit_costs: Sequence[float], profile: Profile | None, device: torch.device, distributed: bool
) -> list[int]:
    """Stage sizes: pinned by hand, profile-optimal and memory-checked, or FLOP-balanced."""
    p = cfg.pipeline
    assert p.window is not None and p.microbatch_size is not None
    if profile is None or isinstance(p.partition, list):
        sizes = resolve_partition(p.partition, unit_costs, p.stages)
    else:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1
        sizes = profile_partition(
            profile,
            p.stages,
            schedule=p.schedule,
            window=p.window,
            microbatch_size=p.microbatch_size,
            memory_bytes=memory_available(device, here) if distributed else None,
            inflight=p.inflight,
            optimizer=cfg.optimizer.name,
        ).sizes
    if profile is not None:
        check_memory(cfg, profile, sizes, device, distributed)
    return sizes


def check_memory(
    cfg: RunConfig, profile: Profile, sizes: Sequence[int], device: torch.device, distributed: bool
) -> None:
    """Refuse a run whose predicted peak memory exceeds what this machine has for it."""
    need = predicted_memory(cfg, profile, sizes)
    if distributed:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = memory_available(device, here)
        worst = max(range(len(need)), key=lambda s: need[s])
        if need[worst] > have:
            raise ConfigError(
                "pipeline.microbatch_size",
                cfg.pipeline.microbatch_size,
                f"a size whose stages fit: stage {worst} is predicted {need[worst] / GIB:.2f} GiB vs "
                f"{have / GIB:.2f} GiB available per stage process",
            )
        return
    have = memory_available(device, 1)
    if sum(need) > have:
        raise ConfigError(
            "pipeline.microbatch_size",
            cfg.pipeline.microbatch_size,
            f"a size that fits one device with all {len(need)} stages (emulated): predicted "
            f"{sum(need) / GIB:.2f} GiB vs {have / GIB:.2f} GiB available",
        )
