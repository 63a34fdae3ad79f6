"""Small records shared among the ranks as JSON bytes, never as pickles.

torch's ``all_gather_object`` and ``broadcast_object_list`` pickle what they send and unpickle what
they receive: a process that could feed bytes into the group's connections could run code in every
rank. The distributed runtime shares only plain records (timings, the run summary's per-stage
entries, a loss, a flag), so it sends them as UTF-8 JSON in a byte tensor: lengths first, then the
bytes padded to the longest. JSON keeps floats exactly (``repr``), and NaN and infinities too.
May import: torch.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors must live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(json.dumps(value, allow_nan=True).encode())  # never empty: at least "null"
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor, n: int) -> Any:
    return json.loads(bytes(t[:n].cpu().tolist()).decode())


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (JSON-able), in rank order, on every rank."""
    device = _device(group)
    mine = _encode(value, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_decode(t, n) for t, n in zip(out, lengths, strict=True)]


def broadcast_json(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``value`` (JSON-able), on every rank (the others' ``value`` is ignored)."""
    device = _device(group)
    mine = _encode(value, device) if dist.get_rank() == src else None
    size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = mine if mine is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return _decode(buf, int(size.item()))
