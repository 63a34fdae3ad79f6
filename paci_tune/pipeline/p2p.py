"""Point-to-point transfers between neighbouring pipeline ranks.

Plain ``dist.isend`` / ``dist.irecv`` rather than ``batch_isend_irecv``, which is known to hang
under gloo in some orders. Sends never block, so two neighbours sending to each other cannot
deadlock.

Receives are *posted ahead*: a stage's program says exactly which messages will arrive from each
neighbour and in which order (activations, and the control message and activations of an
evaluation, on one ordered link; gradients on the other), so the next ones are posted before they
are needed. This matters: gloo moves a message only once the receiver has posted a buffer for it,
so a receive posted late makes the sender's transfer wait for a background thread that competes
with the sender's compute -- measured at 10-20 ms per activation on a 2-core CPU, a 15% bubble on
its own. Posted ahead, the transfer completes from the sender's call.

Every tensor is preceded by a small header (dtype, kind, micro-batch, a flag, an acknowledgement,
shape): the receiver checks that what arrives is what its program expects, so a schedule mismatch
fails loudly instead of silently training on the wrong data. The first message of each kind on a link is received blind
(header, then payload) to learn its shape; later ones reuse it. The flag carries one bit of news
along a gradient (the target was reached; see :mod:`.evaluation`). The acknowledgement is how many
payloads the sender has received from the receiver so far: those sends are then complete, and the
receiver lets go of them (gloo holds a sent tensor until its send is waited on, so without it a stage
kept every tensor it sent until the segment's end or ``max_pending``).

On gloo, which sends host memory only, CUDA tensors are staged through the CPU on both ends
(:mod:`paci_tune.pipeline.backend`); on NCCL they go GPU to GPU. Two stages on the same rank (the
pieces of interleaved 1F1B on a pipe of one rank) hand messages over in memory, in order: a process
cannot send to itself over gloo. May import: torch, :mod:`.backend`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backend import wire_device

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_KINDS = ["act", "grad", "ctl", "eval"]
_HEADER = 13  # dtype, kind, mb, flag, ack, ndim, up to 7 dims
_NDIM = 5  # where ndim sits; the dims follow it
POSTED_AHEAD = 2
"""Receives posted ahead per neighbour: their buffers are memory a stage holds all along (:mod:`.planning`)."""


EVAL_PENDING = 2
"""Validation chunks' outputs a piece leaves in flight to the next rank (:meth:`P2P.settle`): an
evaluation's forward-only link acknowledges nothing, so without a wait gloo kept every one it sent, up to
the transport's cap (measured: 16 MiB at rank 0 of a ZB-V, docs/benchmarks.md). Where the forward path
loops back to a rank (the registry's ``forward_loops``) the link from the last rank to the first (``wraps``)
is never waited on: a ring of ranks each waiting on the next deadlocked once the validation set outgrew
the cap."""


@dataclass
class _Posted:
    kind: str
    mb: int
    header: torch.Tensor
    header_work: dist.Work
    payload: torch.Tensor
    payload_work: dist.Work


class P2P:
    """Transport between pipeline stages that live on ranks ``rank_of[stage]``."""

    def __init__(
        self,
        rank_of: list[int],
        device: torch.device,
        depth: int = POSTED_AHEAD,
        max_pending: int | None = 64,
        wire: torch.device | None = None,
    ) -> None:
        """``wire`` is where tensors travel; by default host memory on gloo, ``device`` otherwise.
        ``max_pending``: sends left pending before the oldest is waited on; None: never (where the forward
        path loops back to this rank, a wait could be on its own later piece: :meth:`settle`)."""
        self.rank_of, self.device, self.depth = rank_of, device, depth
        self.wire = wire if wire is not None else wire_device(dist.get_backend(), device)
        self._sends: dict[int, deque[tuple[int, dist.Work, torch.Tensor]]] = {}  # per peer: (seq, work, tensor)
        self._sent: dict[int, int] = {}  # per peer: payloads sent to it
        self._received: dict[int, int] = {}  # per peer: payloads received from it (acknowledged in our headers)
        self._max_pending = max_pending
        self._layout: dict[tuple[int, str], tuple[torch.dtype, list[int]]] = {}
        self._plan: dict[int, deque[tuple[str, int]]] = {}  # per source: (kind, mb) in arrival order
        self._posted: dict[int, deque[_Posted]] = {}
        self._me = dist.get_rank()
        self._local: dict[int, deque[tuple[str, int, torch.Tensor, int]]] = {}  # per source on this rank

    # ------------------------------------------------------------------------------------ send
    def send(self, src: int, dst: int, kind: str, mb: int, tensor: torch.Tensor, flag: int = 0) -> None:
        if self.rank_of[dst] == self._me:  # a stage of this rank: in memory (module docstring)
            self._local.setdefault(src, deque()).append((kind, mb, tensor.detach().clone(), flag))
            return
        tensor = tensor.contiguous().to(self.wire)
        if tensor.dim() > _HEADER - _NDIM - 1:
            raise ValueError(f"cannot send a {tensor.dim()}-d tensor between stages (at most {_HEADER - _NDIM - 1})")
        peer = self.rank_of[dst]
        ack = self._received.get(peer, 0)
        head = [_DTYPES.index(tensor.dtype), _KINDS.index(kind), mb, flag, ack, tensor.dim(), *tensor.shape]
        header = torch.tensor(head + [0] * (_HEADER - len(head)), dtype=torch.int64, device=self.wire)
        seq = self._sent.get(peer, 0)
        self._sent[peer] = seq + 1
        pending = self._sends.setdefault(peer, deque())
        for t in (header, tensor):
            pending.append((seq, dist.isend(t, peer), t))
        while self._max_pending is not None and sum(map(len, self._sends.values())) > self._max_pending:
            _, work, _ = max(self._sends.values(), key=len).popleft()
            work.wait()

    def settle(self, dst: int, payloads: int) -> None:
        """Wait on the oldest sends to ``dst``'s rank until at most ``payloads`` are pending. On a link nothing
        comes back on (an evaluation's forwards) no acknowledgement frees them, and gloo holds a sent tensor
        until its send is waited on; a wait returns once the receiver has taken that payload. Safe only where
        ``dst``'s rank takes it without waiting on this rank first (not in a loop: the registry's
        ``forward_loops``)."""
        if self.rank_of[dst] == self._me:
            return
        pending = self._sends.get(self.rank_of[dst])
        while pending and len(pending) > 2 * payloads:  # a header and a payload each
            _, work, _ = pending.popleft()
            work.wait()

    def _acknowledged(self, peer: int, count: int) -> None:
        """``peer`` has received our first ``count`` payloads (its header says so): those sends are complete,
        so their tensors are let go now rather than at the segment's end. gloo reports a send complete only
        once waited on, and holds the tensor until then: without this a stage kept up to ``max_pending / 2``
        activation-sized tensors it had sent, for nothing."""
        pending = self._sends.get(peer)
        while pending and pending[0][0] < count:
            _, work, _ = pending.popleft()
            work.wait()  # already complete: returns at once

    # ------------------------------------------------------------------------------------ recv
    def expect(self, src: int, items: Iterable[tuple[str, int]]) -> None:
        """Announce the messages (kind, micro-batch) that will arrive from ``src``, in order; post the first."""
        if self.rank_of[src] == self._me:
            return  # handed over in memory: nothing to post
        self._plan.setdefault(src, deque()).extend(items)
        self._post(src)

    def _post(self, src: int) -> None:
        plan = self._plan.get(src)
        posted = self._posted.setdefault(src, deque())
        peer = self.rank_of[src]
        while plan and len(posted) < self.depth:
            kind, mb = plan[0]
            layout = self._layout.get((src, kind))
            if layout is None:
                return  # the first of its kind is received blind, and nothing after it is posted before it
            plan.popleft()
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.wire)
            payload = torch.empty(layout[1], dtype=layout[0], device=self.wire)
            hw = dist.irecv(header, peer)
            pw = dist.irecv(payload, peer)
            posted.append(_Posted(kind, mb, header, hw, payload, pw))

    def recv(self, src: int, dst: int, kind: str, mb: int) -> tuple[torch.Tensor, int]:
        """The next message from ``src``, which must be ``kind`` of ``mb``; (tensor, flag)."""
        if self.rank_of[src] == self._me:
            got_kind, got_mb, tensor, flag = self._local[src].popleft()
            if (got_kind, got_mb) != (kind, mb):
                raise RuntimeError(
                    f"stage {dst} expected {kind} of micro-batch {mb} from stage {src}, got {got_kind} of {got_mb}"
                )
            return tensor.to(self.device), flag
        posted = self._posted.get(src)
        if posted:
            p = posted.popleft()
            if (p.kind, p.mb) != (kind, mb):
                raise RuntimeError(f"stage {dst} wants {kind} {mb} from stage {src} but announced {p.kind} {p.mb}")
            p.header_work.wait()
            h = p.header.tolist()
            self._check(h, src, dst, kind, mb)
            p.payload_work.wait()
            self._got(self.rank_of[src], h)
            self._post(src)
            return p.payload.to(self.device), int(h[3])
        peer = self.rank_of[src]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.wire)
        dist.recv(header, peer)
        h = header.tolist()
        self._check(h, src, dst, kind, mb)
        dtype, shape = _DTYPES[h[0]], h[_NDIM + 1 : _NDIM + 1 + h[_NDIM]]
        out = torch.empty(shape, dtype=dtype, device=self.wire)
        dist.recv(out, peer)
        self._got(peer, h)
        plan = self._plan.get(src)
        if plan and plan[0] == (kind, mb):
            plan.popleft()
        self._layout[(src, kind)] = (dtype, shape)
        self._post(src)
        return out.to(self.device), int(h[3])

    def _got(self, peer: int, header: list[int]) -> None:
        """A payload from ``peer`` is in: count it, and let go of the sends its header acknowledges."""
        self._received[peer] = self._received.get(peer, 0) + 1
        self._acknowledged(peer, header[4])

    def _check(self, h: list[int], src: int, dst: int, kind: str, mb: int) -> None:
        got = (_KINDS[h[1]], h[2])
        if got != (kind, mb):
            raise RuntimeError(
                f"stage {dst} expected {kind} of micro-batch {mb} from stage {src}, got {got[0]} of {got[1]}"
            )
        layout = self._layout.get((src, kind))
        shape = h[_NDIM + 1 : _NDIM + 1 + h[_NDIM]]
        if layout is not None and (_DTYPES[h[0]], shape) != layout:
            raise RuntimeError(
                f"stage {dst}: {kind} from stage {src} changed layout to {_DTYPES[h[0]]} {shape} "
                f"from {layout[0]} {layout[1]}; tensors between stages must keep one shape within a run"
            )

    def wait_sends(self) -> None:
        """Finish every outstanding send and let go of its tensor (on a link nothing comes back on, no
        acknowledgement ever frees them: the evaluations between torch's schedule steps)."""
        for pending in self._sends.values():
            while pending:
                _, work, _ = pending.popleft()
                work.wait()

    def wait_all(self) -> None:
        """Finish every outstanding send (before buffers may be reused or the segment ends)."""
        self.wait_sends()
        leftover = {k: list(v) for k, v in self._plan.items() if v}
        leftover |= {k: [(kind, mb) for kind, mb, _, _ in v] for k, v in self._local.items() if v}
        if leftover or any(self._posted.values()):
            raise RuntimeError(f"receives announced but never taken: {leftover}")
