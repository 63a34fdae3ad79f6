"""What a piece of code holds in memory: the bytes it allocates (the CPU allocator's profiler events,
or CUDA's counters), and the tensors autograd saves for backward (saved-tensor hooks).

Shared by the tests that bound a stage's memory or check that it keeps no weight copy (the stage,
bf16, forward-mode weight copies, the GPU); a helper module, so no test imports another.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


class SavedTensors:
    """Records every tensor autograd saves for backward while the context is active."""

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.saved}


def allocated_cpu(fn: Callable[[], None]) -> tuple[int, int]:
    """(net, peak) bytes the CPU allocator handed out while ``fn`` ran, from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    running = list(itertools.accumulate(e["args"]["Bytes"] for e in mem if e["args"].get("Device Type") == 0))
    return (running[-1], max(0, *running)) if running else (0, 0)


def allocated_cuda(fn: Callable[[], None]) -> tuple[int, int]:
    """(net, peak) bytes allocated on the current CUDA device while ``fn`` ran."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
