"""Where every (replica, stage) of the distributed runtime runs: the ("dp", "pp") device mesh.

``pipeline.data_parallel: D`` with ``pipeline.stages: P`` runs on P x D processes laid out by
``torch.distributed.device_mesh.init_device_mesh(type, (D, P), mesh_dim_names=("dp", "pp"))``.
``pp`` is the inner dimension, so ``rank = replica * P + stage``:

- replica r's pipe is the P consecutive ranks ``r*P .. r*P + P-1`` (its point-to-point links);
  with ``torchrun --nnodes N --nproc-per-node P*D/N`` a node holding whole pipes keeps the
  per-micro-batch activation traffic on its own links, and only the once-per-window gradient
  all-reduce crosses nodes;
- stage s's data-parallel group is ranks ``s, P+s, .., (D-1)*P+s`` (the mesh makes one
  ``new_group`` per stage), the only collective a PACI stage takes part in while training;
- replica 0's last stage, rank P-1, sees the losses of replica 0 and reports (D = 1: the last
  rank, as before).

The mesh works on gloo and the CPU as on NCCL (checked on torch 2.13), so both backends get the
same layout. May import: torch, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import ConfigError


def rank_of(replica: int, stage: int, stages: int) -> int:
    """The global rank of ``stage`` in ``replica`` (module docstring)."""
    return replica * stages + stage


def reporter_rank(stages: int) -> int:
    """The rank that reports: replica 0's last stage."""
    return rank_of(0, stages - 1, stages)


def check_world(world: int, stages: int, replicas: int) -> None:
    """A launch must start exactly P x D processes in all (over every node); say which setting to change."""
    if world != stages * replicas:
        raise ConfigError(
            "pipeline.data_parallel" if replicas > 1 else "pipeline.stages",
            replicas if replicas > 1 else stages,
            f"pipeline.stages x pipeline.data_parallel = {stages} x {replicas} = {stages * replicas} must equal "
            f"the number of launched processes, the world size ({world}): start P x D processes in all "
            "(torchrun --nnodes N --nproc-per-node P*D/N)",
        )


@dataclass
class Mesh:
    """This rank's place in the mesh and the two groups it uses."""

    replica: int
    stage: int
    replicas: int
    pipe_ranks: list[int]  # global rank of each stage of this rank's replica
    dp_group: dist.ProcessGroup  # this stage's replicas
    pp_group: dist.ProcessGroup  # this replica's stages


def build_mesh(stages: int, replicas: int, device_type: str) -> Mesh:
    """This rank's :class:`Mesh`; every rank must call it (creating the groups is collective)."""
    check_world(dist.get_world_size(), stages, replicas)
    mesh = init_device_mesh(device_type, (replicas, stages), mesh_dim_names=("dp", "pp"))
    replica, stage = divmod(dist.get_rank(), stages)
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank("pp")) == (replica, stage), "unexpected mesh layout"
    return Mesh(
        replica,
        stage,
        replicas,
        [rank_of(replica, s, stages) for s in range(stages)],
        mesh.get_group("dp"),
        mesh.get_group("pp"),
    )
