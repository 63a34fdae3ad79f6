"""Schedules as data, torch-free: per-stage action lists, their replay in time, cutting units into stages.

The runtimes (:mod:`paci_tune.pipeline`) execute these lists and the simulator (:mod:`paci_tune.sim`)
times them; both stand on this package and neither needs the other to know what a schedule is.
May import: :mod:`paci_tune.errors` and the standard library only.
"""

from .actions import (
    SCHEDULES,
    Action,
    Op,
    copies_bound,
    dependency,
    drift_bound,
    execution_order,
    inflight_cap,
    sweep,
)
from .partition import (
    balanced_partition,
    check_depth,
    check_partition,
    min_max_partition,
    resolve_partition,
    stage_units,
)
from .program import Program, build, needs_snapshot, stage_actions
from .replay import Placer, Timeline, drift_per_microbatch, inflight_per_chunk, peak_inflight, replay
from .synchronous import INTERLEAVED, SYNCHRONOUS, ZB_H1, check_layout, sync_stage_actions, unsupported

__all__ = [
    "INTERLEAVED",
    "SCHEDULES",
    "SYNCHRONOUS",
    "ZB_H1",
    "Action",
    "Op",
    "Placer",
    "Program",
    "Timeline",
    "balanced_partition",
    "build",
    "check_depth",
    "check_layout",
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
    "replay",
    "resolve_partition",
    "stage_actions",
    "stage_units",
    "sweep",
    "sync_stage_actions",
    "unsupported",
]
