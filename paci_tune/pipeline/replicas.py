"""Data parallelism inside a pipeline: D replicas of every stage, averaged at that stage's own step.

``pipeline.data_parallel: D`` runs D copies of the P-stage pipeline. Replica ``r`` is fed its own
micro-batches (:class:`~paci_tune.data.stream.MicroBatchStream`'s ``replica``), so a global batch
is ``D * a * b`` sequences. At each optimizer step of stage ``s`` its D replicas replace their
window's gradients by the mean over the replicas, then all step: replicas start identical and stay
identical. Each last stage already scales its loss by ``1/a``, so the mean over replicas is exactly
plain gradient accumulation over the whole global batch, up to the order of float summation. The
average is a collective of stage ``s``'s replicas only: PACI's stages still never wait for each
other, and the drift a micro-batch sees (a property of one replica's action order) is unchanged.

One mechanism, two transports, with the same arithmetic (sum in replica order, then divide by D):

- :func:`average_gradients` -- the emulated runtime holds the D replicas of a stage in one process
  and averages their gradient lists in place;
- :class:`GradientAllReduce` -- the distributed runtime all-reduces a stage's gradients inside that
  stage's data-parallel group, bucketed and asynchronous: every bucket is launched before the
  first is waited for, so flattening later buckets (and copying earlier ones back) overlaps with
  the transfer of the others. For D = 2 a sum of two terms is the same in either order, so the two
  runtimes agree bit for bit; for more replicas the collective's summation order may differ by
  float rounding.

Losses: each replica's last stage sees its own micro-batches; the global batch's loss is the mean
over replicas of their window means (:class:`ReplicaLosses`, or a sum over the group in the
distributed runtime), all replicas' micro-batches being the same size. May import: torch,
:mod:`.runtime`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .runtime import OnBatch

BUCKET_BYTES = 25 * 2**20
"""Bytes per all-reduce bucket (DistributedDataParallel's default): big enough to amortise a launch."""


@torch.no_grad()
def average_gradients(replica_grads: Sequence[Sequence[torch.Tensor]]) -> None:
    """Replace each replica's gradients, in place, by their mean over replicas (summed in replica order)."""
    n = len(replica_grads)
    for tensors in zip(*replica_grads, strict=True):
        total = tensors[0].clone()
        for t in tensors[1:]:
            total.add_(t)
        total.div_(n)
        for t in tensors:
            t.copy_(total)


def buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``limit`` bytes each (a bigger tensor goes alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != t.dtype:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


class GradientAllReduce:
    """Averages one stage's gradients over its data-parallel group (the stage's D replicas)."""

    def __init__(self, group: dist.ProcessGroup, size: int, wire: torch.device, bucket_bytes: int = BUCKET_BYTES):
        """``wire``: where the collective's buffers live (host memory on gloo, the GPU on NCCL)."""
        self.group, self.size, self.wire, self.bucket_bytes = group, size, wire, bucket_bytes

    @torch.no_grad()
    def average(self, grads: Sequence[torch.Tensor]) -> None:
        launched = []
        for bucket in buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(self.wire)
            launched.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        for bucket, flat, work in launched:
            work.wait()
            flat.div_(self.size)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


class ReplicaLosses:
    """Global-batch losses from the replicas' window means: reported once every replica's is in.

    Emulated runtime: replica ``r``'s last stage reports through :meth:`for_replica`; the batch's
    loss is the sum in replica order divided by D (the distributed runtime's all-reduce does the
    same sum).
    """

    def __init__(self, replicas: int, on_batch: OnBatch) -> None:
        self.replicas, self.on_batch = replicas, on_batch
        self._parts: dict[int, dict[int, float]] = {}

    def for_replica(self, r: int) -> OnBatch:
        def add(k: int, loss: float) -> None:
            parts = self._parts.setdefault(k, {})
            parts[r] = loss
            if len(parts) == self.replicas:
                del self._parts[k]
                self.on_batch(k, sum(parts[i] for i in range(self.replicas)) / self.replicas)

        return add


class LossAllReduce:
    """The distributed runtime's :class:`ReplicaLosses`: the last stage's window means summed over its group.

    Launched asynchronously as each replica completes a batch, collected at the next step (after
    that stage's gradient all-reduce, which the group runs later) or at the segment's end; only
    the reporting replica reports.
    """

    def __init__(self, group: dist.ProcessGroup, size: int, wire: torch.device, on_batch: OnBatch | None) -> None:
        self.group, self.size, self.wire, self.on_batch = group, size, wire, on_batch
        self._pending: list[tuple[int, torch.Tensor, dist.Work]] = []

    def add(self, k: int, loss: float) -> None:
        t = torch.tensor([loss], dtype=torch.float64, device=self.wire)
        self._pending.append((k, t, dist.all_reduce(t, group=self.group, async_op=True)))

    def collect(self) -> None:
        for k, t, work in self._pending:
            work.wait()
            if self.on_batch is not None:
                self.on_batch(k, float(t.item()) / self.size)
        self._pending.clear()
