"""A finished run's measured peak memory held against its device budget (``hardware.memory``).

The run was admitted on a prediction (:func:`paci_tune.pipeline.planning.check_budget`); what it then
held is a measurement, and a user who set a budget must hear when the two disagree. The comparison
uses the allocator's count (``peak_allocated_bytes``: CUDA's ``max_memory_allocated``, or the CPU
tracker when it ran); a CPU process's resident set counts the Python interpreter and torch's
libraries too, so it is not held against a budget for tensors. On the emulated runtime one process
holds every stage of every replica, so its peak is held against the budget of all P x D devices it
stands for. The summary also carries the run's predicted peak per device, the figure ``simulate`` and
the search give for the same layout (:func:`predicted`). May import: :mod:`paci_tune.config`,
:mod:`paci_tune.pipeline` (the prediction), :mod:`paci_tune.errors` and the standard library.
"""

from __future__ import annotations

from typing import Any

from ..config.schema import RunConfig
from ..errors import ConfigError
from ..pipeline.planning import budget_peaks


def predicted(cfg: RunConfig, profile: Any) -> dict[str, Any]:
    """The run's predicted peak per device on its pinned cut, the device reserve included: what ``simulate``
    prints and a search holds ``hardware.memory`` to (:func:`paci_tune.pipeline.planning.budget_peaks`).
    Empty without a profile, or where the profile cannot price this layout (another micro-batch size)."""
    cut = cfg.pipeline.partition
    if profile is None or not isinstance(cut, list):
        return {}
    try:
        peaks = budget_peaks(cfg, profile, cut)
    except (ConfigError, KeyError, ValueError):
        return {}
    return {"predicted_peak_bytes": max(peaks), "predicted_stage_peak_bytes": peaks}


def _measured(stage: dict[str, Any]) -> int | None:
    allocated = stage.get("peak_allocated_bytes")
    return int(allocated) if allocated is not None else None


def against_budget(cfg: RunConfig, stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's budget figures: the cap, and the stages (or the process) measured above it.

    ``memory_over_budget`` is a list of ``{stage, measured_bytes, budget_bytes}`` (empty: all within),
    or None when nothing comparable was measured. Empty when the run has no budget.
    """
    cap = cfg.hardware.memory_bytes
    if cap is None:
        return {}
    measured = [(st["stage"], _measured(st)) for st in stats]
    if all(m is None for _, m in measured):
        return {"memory_budget_bytes": cap, "memory_over_budget": None}
    if cfg.pipeline.runtime == "distributed":
        over = [
            {"stage": s, "measured_bytes": m, "budget_bytes": cap} for s, m in measured if m is not None and m > cap
        ]
    else:  # one process, all stages: its peak against the devices it emulates
        whole = max(m for _, m in measured if m is not None)
        budget = cap * cfg.pipeline.stages * cfg.pipeline.data_parallel
        over = [{"stage": "all", "measured_bytes": whole, "budget_bytes": budget}] if whole > budget else []
    return {"memory_budget_bytes": cap, "memory_over_budget": over}


def allocated(stats: list[dict[str, Any]], meter: Any, device_type: str) -> dict[str, Any]:
    """The summary's peak of allocated tensor bytes (each stage's ``peak_allocated_bytes``: per stage process
    on the distributed runtime, the one process's on the emulated one) and what measured it (``meter``, the
    runtime's, :mod:`paci_tune.pipeline.meter`), or None where nothing did (a CPU run without
    ``PACI_TUNE_TRACK_MEMORY=1``)."""
    peaks = [x.get("peak_allocated_bytes") for x in stats]
    return {
        "peak_allocated_bytes": None if None in peaks else max(peaks),
        "peak_allocated_measured_with": None if meter is None else meter.measured_with,
        "peak_memory_measured_with": "torch.cuda.max_memory_allocated"
        if device_type == "cuda"
        else "process peak resident set (ru_maxrss)",
    }
