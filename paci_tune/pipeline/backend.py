"""Which ``torch.distributed`` backend the distributed runtime uses, and where tensors travel.

Two facts decide it (torch's backend table and NCCL's own checks):

- **Gloo moves CPU tensors only** for point-to-point ``send`` / ``recv`` (its CUDA support covers
  some collectives, not P2P). A pipeline on CUDA over gloo must therefore stage every activation
  and gradient through host memory: correct, and slow -- for checking numerics, not for speed.
- **NCCL needs one GPU per rank.** Two ranks on one GPU fail when the communicator is created
  ("Duplicate GPU detected"), which happens inside the first transfer, long after start-up and
  with a message that does not name the setting to change.

So ``backend: auto`` picks NCCL on CUDA when this machine has a GPU for every stage process it
runs, gloo otherwise (CPU, or more stages than GPUs: the stages then share GPUs and their
transfers go through host memory); an explicit ``nccl`` that cannot work is a config error. May
import: torch, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def uses_cuda(device: str, n_gpus: int) -> bool:
    """Whether ``pipeline.device`` resolves to CUDA on a machine with ``n_gpus`` visible GPUs."""
    return device == "cuda" or (device == "auto" and n_gpus > 0)


def choose_backend(requested: str, device: str, local_ranks: int, n_gpus: int) -> str:
    """The backend for ``local_ranks`` stage processes on a machine with ``n_gpus`` visible GPUs.

    ``requested`` and ``device`` are ``pipeline.backend`` and ``pipeline.device`` as configured.
    """
    cuda = uses_cuda(device, n_gpus)
    if requested == "gloo":
        return "gloo"
    if requested == "nccl":
        if not cuda:
            raise ConfigError("pipeline.backend", "nccl", "gloo or auto (NCCL moves CUDA tensors; the device is cpu)")
        if local_ranks > n_gpus:
            raise ConfigError(
                "pipeline.backend",
                "nccl",
                f"gloo or auto: {local_ranks} stage processes on this machine but {n_gpus} GPU(s) visible, and "
                "NCCL cannot put two ranks on one GPU (auto shares the GPUs and stages transfers through host "
                "memory over gloo)",
            )
        return "nccl"
    return "nccl" if cuda and local_ranks <= n_gpus else "gloo"


def shares_gpus(backend: str, device: str, local_ranks: int, n_gpus: int) -> bool:
    """True when stages share GPUs and move tensors through host memory (worth telling the user)."""
    return backend == "gloo" and uses_cuda(device, n_gpus) and local_ranks > n_gpus


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a tensor must be to be sent or received over ``backend`` (gloo: host memory only)."""
    return torch.device("cpu") if backend == "gloo" else device
