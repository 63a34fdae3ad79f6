"""Planning layer: cost profiles, a discrete-event pipeline simulator, a memory-aware partitioner.

Everything here predicts; nothing trains. The simulator replays the same schedule action lists
the runtimes execute, with durations from a measured or hand-written profile, so predictions and
runs cannot disagree about what a schedule is. Calibration (which imports torch) and plotting
(which imports matplotlib) are left to their modules so importing this package stays light.
"""

from .memory import DEFAULT_OVERHEAD_BYTES, StageMemory, peak_inflight, stage_memory
from .partitioner import Partition, PartitionModel, min_max_partition, partition
from .profile import P2PCost, Profile, UnitCost, UnitProfile
from .simulator import SimResult, StageResult, simulate

__all__ = [
    "DEFAULT_OVERHEAD_BYTES",
    "P2PCost",
    "Partition",
    "PartitionModel",
    "Profile",
    "SimResult",
    "StageMemory",
    "StageResult",
    "UnitCost",
    "UnitProfile",
    "min_max_partition",
    "partition",
    "peak_inflight",
    "simulate",
    "stage_memory",
]
