"""Planning layer: cost profiles, a discrete-event pipeline simulator, a memory-aware partitioner.

Everything here predicts; nothing trains. The simulator replays the same schedule action lists
the runtimes execute, with durations from a measured or hand-written profile, so predictions and
runs cannot disagree about what a schedule is. Torch-free: measuring a profile is the job of
:mod:`paci_tune.calibrate`, which stands above the runtimes. Plotting (matplotlib) is imported by
:mod:`.plot` only when a picture is drawn. May import: :mod:`paci_tune.schedule`,
:mod:`paci_tune.base`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`, PyYAML and the standard library.
"""

from .costs import UnitCost, UnitProfile
from .memory import DEFAULT_OVERHEAD_BYTES, StageMemory, stage_copies, stage_memory
from .partitioner import Partition, PartitionModel, partition
from .profile import P2PCost, Profile
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
    "partition",
    "simulate",
    "stage_copies",
    "stage_memory",
]
