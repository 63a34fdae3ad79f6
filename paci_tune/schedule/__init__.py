"""Schedules as data, torch-free: the registry of schedules, per-stage action lists, their replay in
time, cutting units into stages.

The runtimes (:mod:`paci_tune.pipeline`) execute these lists and the simulator (:mod:`paci_tune.sim`)
times them; both stand on this package and neither needs the other to know what a schedule is. What
each schedule is lives in :mod:`.registry`, one value per schedule. May import:
:mod:`paci_tune.errors` and the standard library only.
"""

from .actions import Action, Op, dependency, drift_bound, execution_order, sweep
from .partition import (
    balanced_partition,
    check_depth,
    check_partition,
    min_max_partition,
    resolve_partition,
    stage_units,
)
from .program import Program, build, needs_snapshot, stage_actions
from .registry import (
    DEFAULT_CHUNKS,
    FLUSH,
    NAMES,
    OWN_PROGRAM,
    REGISTRY,
    SYNCHRONOUS,
    Schedule,
    copies_bound,
    inflight_cap,
    preference,
    schedule_of,
    sides,
    strongest,
)
from .replay import Placer, Timeline, drift_per_microbatch, inflight_per_chunk, peak_inflight, replay

__all__ = [
    "DEFAULT_CHUNKS",
    "FLUSH",
    "NAMES",
    "OWN_PROGRAM",
    "REGISTRY",
    "SYNCHRONOUS",
    "Action",
    "Op",
    "Placer",
    "Program",
    "Schedule",
    "Timeline",
    "balanced_partition",
    "build",
    "check_depth",
    "check_partition",
    "copies_bound",
    "dependency",
    "drift_bound",
    "drift_per_microbatch",
    "execution_order",
    "inflight_cap",
    "inflight_per_chunk",
    "min_max_partition",
    "needs_snapshot",
    "peak_inflight",
    "preference",
    "replay",
    "resolve_partition",
    "schedule_of",
    "sides",
    "stage_actions",
    "stage_units",
    "strongest",
    "sweep",
]
