"""What :class:`paci_tune.pipelining.SchedulePACI` holds of the batches ``step()`` submitted, per micro-batch.

A PACI stage may run a micro-batch's forward in a later ``step()`` call than the one that submitted
it (the pipeline never flushes), so everything that belongs to a micro-batch -- stage 0's inputs,
the last stage's target, the module kwargs of torchtitan's ``kwarg_mbs`` and the ``loss_kwargs`` of
its step -- is kept under the micro-batch's run-wide number until that forward takes it. Batches
come whole (split along dim 0, as ``Schedule1F1B.step(x, target=y)``) or pre-split (``arg_mbs=``,
``kwarg_mbs=``, ``target_mbs=``, as torchtitan 0.3.0's trainer calls). May import: torch.
"""

from __future__ import annotations

from typing import Any

import torch


class Batches:
    """Per micro-batch number: inputs, target, module kwargs and loss kwargs, until its forward takes them."""

    def __init__(self, n_microbatches: int, device: torch.device) -> None:
        self.n, self.device = n_microbatches, device
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.kwargs: dict[int, dict[str, Any]] = {}
        self.loss_kwargs: dict[int, dict[str, Any]] = {}

    def submit(
        self,
        first: int,
        ends: tuple[bool, bool],
        args: tuple[torch.Tensor, ...] = (),
        target: torch.Tensor | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Keep one ``step()``'s batch as micro-batches ``first .. first + n - 1`` (whole or pre-split, not both).

        ``ends``: whether this stage is the first (it keeps inputs) and the last (targets, loss kwargs).
        """
        if (arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None) and (args or target is not None):
            raise ValueError("step() takes the batch whole (*args, target=) or pre-split (arg_mbs=, ...), not both")
        is_first, is_last = ends
        if is_first and not (args or arg_mbs):
            raise ValueError("stage 0 must pass the batch to step()")
        if is_last and target is None and target_mbs is None:
            raise ValueError("the last stage must pass target= (or target_mbs=) to step()")
        if not is_first:
            args, arg_mbs = (), None
        if not is_last:
            target, target_mbs, loss_kwargs = None, None, None
        if args:
            self._keep(self.inputs, first, "args", list(zip(*self._split(args), strict=True)))
        if arg_mbs is not None:
            self._keep(self.inputs, first, "arg_mbs", [tuple(t.to(self.device) for t in a) for a in arg_mbs])
        if target is not None:
            self._keep(self.targets, first, "target", self._split((target,))[0])
        if target_mbs is not None:
            self._keep(self.targets, first, "target_mbs", [t.to(self.device) for t in target_mbs])
        if kwarg_mbs is not None:
            self._keep(self.kwargs, first, "kwarg_mbs", [dict(k) for k in kwarg_mbs])
        if loss_kwargs:
            self._keep(self.loss_kwargs, first, "loss_kwargs", [loss_kwargs] * self.n)

    def _split(self, tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        for t in tensors:
            if t.shape[0] % self.n:
                raise ValueError(f"batch size {t.shape[0]} is not divisible by n_microbatches={self.n}")
        return [t.to(self.device).chunk(self.n) for t in tensors]

    def _keep(self, store: dict, first: int, name: str, mbs: list) -> None:
        if len(mbs) != self.n:  # torch's own check of pre-split lists, in its words
            raise ValueError(f"Expecting {self.n} {name} but got {len(mbs)}")
        store.update(enumerate(mbs, start=first))
