"""Schedules as data, torch-free: per-stage action lists, their replay in time, cutting units into stages.

The runtimes (:mod:`paci_tune.pipeline`) execute these lists and the simulator (:mod:`paci_tune.sim`)
times them; both stand on this package and neither needs the other to know what a schedule is.
May import: :mod:`paci_tune.errors` and the standard library only.
"""

from .actions import SCHEDULES, Action, Op, build, drift_bound, execution_order, inflight_cap, stage_actions
from .partition import (
    balanced_partition,
    check_depth,
    check_partition,
    min_max_partition,
    resolve_partition,
    stage_units,
)
from .replay import Timeline, drift_per_microbatch, peak_inflight, replay

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "Timeline",
    "balanced_partition",
    "build",
    "check_depth",
    "check_partition",
    "drift_bound",
    "drift_per_microbatch",
    "execution_order",
    "inflight_cap",
    "min_max_partition",
    "peak_inflight",
    "replay",
    "resolve_partition",
    "stage_actions",
    "stage_units",
]
