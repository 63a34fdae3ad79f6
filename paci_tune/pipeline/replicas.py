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
  stage's data-parallel group, bucketed and asynchronous: each bucket is launched during the
  backward that closes the window, as soon as that backward has finished its gradients, so the
  transfer overlaps the rest of the backward, and the step waits for what is still in flight.
  For D = 2 a sum of two terms is the same in either order, so the two
  runtimes agree bit for bit; for more replicas the collective's summation order may differ by
  float rounding.

Losses: each replica's last stage sees its own micro-batches; the global batch's loss is the mean
over replicas of their window means (:class:`ReplicaLosses`, or a sum over the group in the
distributed runtime), all replicas' micro-batches being the same size. May import: torch,
:mod:`.optim`, :mod:`.runtime`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .optim import AliasedOptimizer
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


def buckets(sizes: Sequence[tuple[torch.dtype, int]], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``(dtype, numel)`` tensors in consecutive same-dtype runs of at most ``limit`` bytes each.

    A tensor bigger than ``limit`` goes alone. The input order is the bucket order.
    """
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (dt, numel) in enumerate(sizes):
        nbytes = numel * dt.itemsize
        if not out or size + nbytes > limit or dt != dtype:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += nbytes
    return out


class GradientAllReduce:
    """Averages one stage's gradients over its data-parallel group, launched while the last backward runs.

    The runtime :meth:`arm` s it before the backward that closes a window; as that backward finishes
    each parameter's gradient (:meth:`AliasedOptimizer.watch_gradients`), the parameter's bucket is
    launched asynchronously once all its parameters are done -- buckets in a fixed order, parameters
    taken last to first as a backward produces them, as DistributedDataParallel does -- so the
    all-reduce overlaps the rest of that backward. :meth:`average`, at the step, launches what is left
    (parameters no backward reached), waits, divides by D and writes the means back in place. The
    fixed order keeps every replica's collectives in the same sequence whatever order hooks fire in;
    its price is that a bucket of unused parameters holds the later ones back to the step (still
    correct, less overlap).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        size: int,
        wire: torch.device,
        optim: AliasedOptimizer,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """``wire``: where the collective's buffers live (host memory on gloo, the GPU on NCCL)."""
        self.group, self.size, self.wire, self.optim = group, size, wire, optim
        order = list(reversed(range(len(optim.masters))))
        shapes = [(optim.masters[i].dtype, optim.masters[i].numel()) for i in order]
        self.buckets = [[order[j] for j in b] for b in buckets(shapes, bucket_bytes)]
        self._bucket_of = {i: n for n, b in enumerate(self.buckets) for i in b}
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = False
        self._launched: list[tuple[list[int], torch.Tensor, dist.Work]] = []
        self.waited_s = 0.0  # time the steps spent finishing the all-reduce: the part compute did not hide
        optim.watch_gradients(self._done)

    def arm(self) -> None:
        """The next backward closes the window: launch each bucket as soon as its gradients are final."""
        self._armed = True
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._launched = []

    def _done(self, i: int) -> None:
        if self._armed:
            self._ready[self._bucket_of[i]] += 1
            self._launch(force=False)

    def _launch(self, force: bool) -> None:
        """Launch, in bucket order, every bucket whose gradients are final (all of them with ``force``)."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and self._ready[self._next] < len(bucket):
                return
            parts = []
            for i in bucket:
                g = self.optim.gradient_of(i)
                parts.append(torch.zeros_like(self.optim.masters[i]) if g is None else g)
            flat = torch.cat([g.reshape(-1) for g in parts]).to(self.wire)
            self._launched.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
            self._next += 1

    @torch.no_grad()
    def average(self) -> None:
        """At the step: finish every bucket and replace the gradients by their mean over the replicas."""
        t0 = time.perf_counter()
        if not self._armed:
            self.arm()  # a step with no armed backward before it: reduce everything now
        self._launch(force=True)
        for bucket, flat, work in self._launched:
            work.wait()
            flat.div_(self.size)
            offset = 0
            for i in bucket:
                n = self.optim.masters[i].numel()
                g = self.optim.gradient_of(i)
                if g is not None:  # one no backward reached stays without a gradient, as on every replica
                    g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        self._armed = False
        self._launched = []
        self.waited_s += time.perf_counter() - t0


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
