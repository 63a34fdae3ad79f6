"""PACI as a drop-in schedule for ``torch.distributed.pipelining``.

Teams that already pipeline with PyTorch's ``PipelineStage`` + ``Schedule1F1B`` can try PACI by
swapping the schedule line. Import it as ``from paci_tune.pipelining import SchedulePACI``::

    stage = PipelineStage(my_stage_module, rank, world_size, device)
    opt = torch.optim.AdamW(my_stage_module.parameters(), lr=3e-4)
    # schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule = SchedulePACI(stage, n_microbatches=8, loss_fn=loss_fn, window=4, optimizer=opt)
    with schedule:
        for x, y in batches:
            if rank == 0:
                schedule.step(x)
            elif rank == world_size - 1:
                losses = []
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            # no opt.step() here: each stage steps its own optimizer every `window` backwards
    # leaving the `with` block drained the pipeline: evaluate or checkpoint now

What is reused, not re-implemented: the per-stage action order comes from
:func:`paci_tune.schedule.stage_actions` (the same lists paci-tune's own runtimes execute), and each
forward, backward and optimizer step is a :class:`paci_tune.pipeline.stage.Stage`'s -- the runtimes'
own stage, built over the ``PipelineStage``'s module with the caller's optimizer rebound to
:class:`paci_tune.pipeline.optim.AliasedOptimizer`, so loss scaling, which weights a backward reads
(``backward_weights``), fp32 masters and drift records are the runtimes' too. Activations and
gradients travel over :class:`paci_tune.pipeline.p2p.P2P`. From torch's ``PipelineStage`` only the
module, stage index, stage count, device and process group are used: its own send/recv machinery
assumes chunk ids below ``n_microbatches`` and a flush per ``step()``, which an un-flushed pipeline
breaks. May import: :mod:`paci_tune.pipeline`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from .config.schema import BACKWARD_WEIGHTS
from .pipeline.backend import wire_device
from .pipeline.optim import AliasedOptimizer
from .pipeline.p2p import P2P
from .pipeline.stage import Stage
from .pipeline.step_batches import Batches
from .schedule import FLUSH, Action, Op, stage_actions

__all__ = ["SchedulePACI"]


class _StageUnit(nn.Module):
    """The user's stage module as the :class:`Stage`'s one unit.

    It passes stage 0's further ``step()`` arguments (``extra``, set around each forward) after the
    one input a :class:`Stage` forwards, and refuses any output but one tensor with SchedulePACI's
    own message, before the loss sees it. The user's module is held, not changed: its own
    ``state_dict`` keys, parameters, dtype and device stay as they were.
    """

    def __init__(self, module: nn.Module, index: int) -> None:
        super().__init__()
        self.inner, self.index = module, index
        self.extra: tuple[torch.Tensor, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x, *self.extra, **self.kwargs)
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"stage {self.index} returned {type(out).__name__}; SchedulePACI needs one tensor")
        return out


def _of_stage(name: str, doc: str, *, settable: bool = False) -> Any:
    """A property of :class:`SchedulePACI` that reads (and if ``settable`` writes) its :class:`Stage`'s ``name``."""

    def get(self: SchedulePACI) -> Any:
        return getattr(self._stage, name)

    def put(self: SchedulePACI, value: Any) -> None:
        setattr(self._stage, name, value)

    return property(get, put if settable else None, doc=doc)


class SchedulePACI:
    """PACI asynchronous pipeline schedule with the calling convention of torch's ``Schedule1F1B``.

    ``step(*args, target=..., losses=...)``: stage 0 passes the full batch in ``args`` (split into
    ``n_microbatches`` chunks along dim 0), the last stage passes ``target`` (split the same way) and
    gets one unscaled loss per micro-batch appended to ``losses``. Unlike ``Schedule1F1B`` the
    pipeline never flushes: each ``step()`` runs this stage's PACI action list up to the point where
    its next action would forward a micro-batch not submitted yet, so the next ``step()``'s
    micro-batches enter while earlier ones drain. Every rank derives that point from the number of
    ``step()`` calls alone, so no extra communication is needed and no rank waits on data its
    neighbour will not send. Each stage steps ``optimizer`` after every ``window`` of its own
    backwards (the loss is scaled by ``1/window`` so a window's gradients average), with no
    coordination between stages. Call :meth:`drain` (or leave the ``with`` block) before evaluating
    or checkpointing; :meth:`restart` continues training afterwards.

    ``backward_weights``: which weights a micro-batch's backward reads when this stage stepped its
    optimizer between that micro-batch's forward and backward (:mod:`paci_tune.pipeline.versions`),
    as ``pipeline.backward_weights`` in paci-tune's own runs. ``"forward"`` (default): the weights its
    forward used, so each gradient is consistent, only late. Nothing is copied at forward time;
    an optimizer step copies the stage's weights once, in their own dtype, if a micro-batch in
    flight still needs them, and the copy is freed with its last such backward: at most
    ``ceil((P-s-1)/window)`` copies at stage ``s`` of ``P``, none at the last stage or with
    ``flush=True`` (:meth:`copies_stats`). ``"current"``: the weights as they are when the backward
    runs (the PACI paper's "no weight stashing"), with no copy at all.

    ``flush=True`` is synchronous 1F1B-flush for A/B runs in one script: every ``step()`` drains
    and the optimizer steps once at its end over all ``n_microbatches`` (loss scaled by
    ``1/n_microbatches``, as ``Schedule1F1B`` scales its gradients), numerically the same as
    ``Schedule1F1B`` followed by ``optimizer.step()`` (no step ever finds a micro-batch in flight,
    so both ``backward_weights`` agree).

    Optimizer: ``optimizer`` must be freshly built over this stage's trainable parameters -- one torch
    optimizer, or a list of them over disjoint parameters (``[torch.optim.Muon(matrices),
    torch.optim.AdamW(rest)]``, stepped as one; ``lr_scheduler`` may then be a list too) -- or be
    ``None`` for a stage with nothing to train (every parameter frozen, ``requires_grad=False``, or
    none at all): that stage then takes no step, and its backward runs only where an earlier stage
    trains (the stages tell each other once, when the schedule is built: a collective over the
    group). Frozen parameters are computed with and never stepped. Its param groups
    are rebound, in place, to aliases of the parameters (``p.data``), as paci-tune's own
    :class:`~paci_tune.pipeline.stage.Stage` does: stepping through an alias updates the shared
    storage without bumping the autograd version counter, so a step with micro-batches in flight
    raises no in-place modification error and moves no parameter (their backwards then read what
    ``backward_weights`` says). Hyper-parameters and any ``lr_scheduler`` built on the same optimizer
    keep working; ``lr_scheduler.step()`` is called after every optimizer step. The module must
    already be on the ``PipelineStage``'s device (as torch's own schedules need too): SchedulePACI
    moves and converts nothing.

    bf16: convert the stage module to bf16 (``module.to(torch.bfloat16)``) before building the
    optimizer, and do not run it under ``torch.autocast``: autocast's per-forward weight casts would
    be kept for every micro-batch in flight -- a copy of the weights per micro-batch, and backwards
    reading their forward's weights whatever ``backward_weights`` says -- where a bf16 module holds
    one copy per version still needed (``"forward"``) or none (``"current"``). Parameters in bf16
    get fp32 master weights in the optimizer, fp32 gradient accumulation over the window, and the
    masters written back into the bf16 parameters in place after each step
    (:mod:`paci_tune.pipeline.optim`; ``"forward"``'s copies are of the bf16 weights, never of the
    masters); compute the loss in fp32 (``logits.float()``). No loss scaling is needed for bf16.
    Checkpoint with :meth:`state_dict` (the optimizer's state *and* the fp32 masters, which
    ``optimizer.state_dict()`` does not hold) next to the module's own.

    Pre-split micro-batches, torchtitan 0.3.0's call: ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=,
    loss_kwargs=, return_outputs=False)`` (:mod:`.pipeline.step_batches`); the loss is then
    ``loss_fn(output, target, **loss_kwargs)``, still divided by ``window`` as under torch's
    ``scale_grads=True`` (torchtitan's ``scale_grads=False`` loss is not: ``docs/models.md``).

    Limits: one stage per rank, stage ``i`` on group rank ``i`` (no multi-stage schedule: Interleaved1F1B,
    ZBV, DualPipeV); a single tensor flows between
    stages and keeps one shape; ``step()`` returns ``None`` (outputs of micro-batches still in flight
    do not exist yet). Activation checkpointing inside the module (``torch.utils.checkpoint``)
    recomputes its part of the forward at the backward, with the weights current then, so
    ``"forward"`` does not hold for that part.
    """

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        window: int,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        lr_scheduler: Any | None = None,
        flush: bool = False,
        backward_weights: str = "forward",
    ) -> None:
        if not isinstance(stage, PipelineStage):
            raise ValueError(
                "SchedulePACI needs one torch.distributed.pipelining.PipelineStage per rank (no multi-stage "
                f"schedule such as Interleaved1F1B), got {type(stage).__name__}"
            )
        group_size = dist.get_world_size(stage.group)
        if stage.num_stages != group_size:
            raise ValueError(f"SchedulePACI runs one stage per rank: {stage.num_stages} stages on {group_size} ranks")
        if stage.stage_index != dist.get_rank(stage.group):
            raise ValueError(
                f"SchedulePACI runs stage i on group rank i: stage {stage.stage_index} is on rank "
                f"{dist.get_rank(stage.group)}"
            )
        if n_microbatches < 1 or window < 1:
            raise ValueError(f"n_microbatches and window must be positive, got {n_microbatches} and {window}")
        if n_microbatches % window:
            raise ValueError(
                f"n_microbatches ({n_microbatches}) must be a multiple of window ({window}) so every step() "
                "submits whole accumulation windows"
            )
        if backward_weights not in BACKWARD_WEIGHTS:
            raise ValueError(f"backward_weights must be one of {BACKWARD_WEIGHTS}, got {backward_weights!r}")
        self.module = stage.submod
        self.index, self.stages, self.device = stage.stage_index, stage.num_stages, stage.device
        trains = any(p.requires_grad for p in self.module.parameters())
        if optimizer is None and trains:
            raise ValueError(
                "optimizer=None is for a stage with nothing to train; this stage's module has "
                "parameters with requires_grad=True"
            )
        if optimizer is not None:
            _check_optimizer(optimizer, self.module)
        _check_device(self.module, self.device)
        upstream = _stages_that_train(trains, self.stages, stage.group, self.device)[: self.index]
        self.n_microbatches, self.flush = n_microbatches, flush
        self.window = n_microbatches if flush else window
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self._unit = _StageUnit(self.module, self.index)
        # fp32 so the Stage casts nothing: a bf16 module is the caller's conversion (class docstring).
        self._stage = Stage(
            self.index,
            self.stages,
            [self._unit],
            window=self.window,
            optimizer=AliasedOptimizer.rebind(optimizer),
            lr_at=None,
            device=self.device,
            dtype=torch.float32,
            backward_weights=backward_weights,
            loss_fn=loss_fn,
            input_grad=any(upstream),
        )
        ranks = [i if stage.group is None else dist.get_global_rank(stage.group, i) for i in range(self.stages)]
        self._p2p = P2P(ranks, self.device)
        self._seg_first = 0  # first global batch of the current segment (a segment ends at drain())
        self._submitted = 0  # global batches submitted in this segment
        self._actions: list[Action] = []
        self._pos = 0  # actions of the current segment already executed
        self._horizon = 0  # global batches covered by self._actions
        self._drained = False
        self._batches = Batches(n_microbatches, self.device)
        self._losses: list | None = None

    # ------------------------------------------------------------------------------ properties
    is_first = _of_stage("is_first", "True on the pipeline's first stage.")
    is_last = _of_stage("is_last", "True on the pipeline's last stage.")
    backward_weights = _of_stage("backward_weights", '``"forward"`` or ``"current"`` (class docstring).')
    loss_fn = _of_stage("loss_fn", "The last stage's loss, ``loss_fn(output, target)``.", settable=True)
    updates = _of_stage("updates", "Optimizer steps this stage has taken.", settable=True)
    drift = _of_stage(
        "drift", "Updates each micro-batch crossed here between its forward and backward, and what its backward read."
    )

    @property
    def max_drift(self) -> int:
        """Most optimizer updates any micro-batch crossed here between its forward and backward."""
        return self._stage.drift.maximum

    def copies_stats(self) -> dict:
        """What ``backward_weights="forward"`` cost here: most weight copies held at once, copies made, bytes of one."""
        return self._stage.copies_stats()

    # ---------------------------------------------------------------------------------- public
    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        arg_mbs: list[tuple[torch.Tensor, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[torch.Tensor] | None = None,
        loss_kwargs: dict[str, Any] | None = None,
        return_outputs: bool = False,
    ) -> None:
        """Submit one batch of ``n_microbatches``, whole or pre-split, and run as far as the schedule allows."""
        if self._drained:
            raise RuntimeError("step() after drain(): call restart() to continue training")
        if return_outputs:  # the outputs of micro-batches still in flight do not exist yet
            raise ValueError("SchedulePACI.step() returns None: pass return_outputs=False")
        first, ends = (self._seg_first + self._submitted) * self.window, (self.is_first, self.is_last)
        self._batches.submit(first, ends, args, target, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)
        self._losses = losses
        per_step = self.n_microbatches // self.window
        self._submitted += per_step
        if self.flush:
            acts = stage_actions(FLUSH, self.index, self.stages, self.window, self._seg_first, per_step)
            self._announce(acts)
            for act in acts:
                self._run(act)
            self._seg_first += per_step
            self._submitted = 0
            self._p2p.wait_all()
            return
        limit = (self._seg_first + self._submitted) * self.window  # first micro-batch not submitted
        self._ensure_horizon(self._submitted + math.ceil(self.stages / self.window) + 1)
        start = self._pos
        while True:
            act = self._actions[self._pos]
            if act.op is Op.FORWARD and act.mb >= limit:
                break
            self._pos += 1
        self._announce(self._actions[start : self._pos])
        for act in self._actions[start : self._pos]:
            self._run(act)

    def drain(self) -> None:
        """Finish every micro-batch in flight (backwards and optimizer steps) and end the segment."""
        if self._drained:
            return
        if not self.flush and self._submitted:
            final = stage_actions("paci", self.index, self.stages, self.window, self._seg_first, self._submitted)
            rest = final[self._pos :]
            self._announce(rest)
            for act in rest:
                self._run(act)
            self._seg_first += self._submitted
        self._p2p.wait_all()
        self._submitted, self._actions, self._pos, self._horizon = 0, [], 0, 0
        self._drained = True

    def restart(self) -> None:
        """Allow ``step()`` again after :meth:`drain` (a new segment of the run)."""
        self._drained = False

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, fp32 master weights (bf16 parameters), updates and drift; call it drained."""
        if self._submitted:
            raise RuntimeError("state_dict() with micro-batches in flight: drain() first")
        return {
            "optimizer": self._stage.optim.state_dict(),
            "masters": [m.detach().clone() for m in self._stage.optim.master_weights()],
            "updates": self.updates,
            "drift": self.drift.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after loading the module's own ``state_dict``)."""
        self._stage.optim.load_state_dict(state["optimizer"])
        self._stage.optim.load_master_weights(state["masters"])
        self.updates = state["updates"]
        self.drift.load_state_dict(state["drift"])

    def __enter__(self) -> SchedulePACI:
        self.restart()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.drain()

    # -------------------------------------------------------------------------------- internal
    def _ensure_horizon(self, n_batches: int) -> None:
        """Extend the segment's PACI list; prefixes agree, so executed actions stay valid."""
        if self._horizon >= n_batches:
            return
        self._horizon = max(n_batches, 2 * self._horizon)
        self._actions = stage_actions("paci", self.index, self.stages, self.window, self._seg_first, self._horizon)

    def _announce(self, acts: list[Action]) -> None:
        """Tell the transport which messages these actions will receive, so it can post them early."""
        if not self.is_first:
            self._p2p.expect(self.index - 1, [("act", a.mb) for a in acts if a.op is Op.FORWARD])
        if not self.is_last:
            self._p2p.expect(self.index + 1, [("grad", a.mb) for a in acts if a.op is Op.BACKWARD])

    def _run(self, act: Action) -> None:
        if act.op is Op.FORWARD:
            self._forward(act.mb)
        elif act.op is Op.BACKWARD:
            self._backward(act.mb)
        else:
            self._optimizer_step()

    def _forward(self, mb: int) -> None:
        """:meth:`Stage.forward`: its input from the batch or the previous stage; on the activation, or the loss."""
        if self.is_first:
            x, *extra = self._batches.inputs.pop(mb)
        else:
            x, extra = self._p2p.recv(self.index - 1, self.index, "act", mb)[0], []
        target = self._batches.targets.pop(mb) if self.is_last else None
        self._unit.extra, self._unit.kwargs = tuple(extra), self._batches.kwargs.pop(mb, {})
        loss_kwargs, loss_fn = self._batches.loss_kwargs.pop(mb, None), self._stage.loss_fn
        if loss_kwargs:
            self._stage.loss_fn = functools.partial(loss_fn, **loss_kwargs)
        try:
            out = self._stage.forward(mb, x, target)
        finally:
            self._unit.extra, self._unit.kwargs, self._stage.loss_fn = (), {}, loss_fn
        if self.is_last:
            if self._losses is not None:
                self._losses.append(out)  # unscaled, detached
        else:
            self._p2p.send(self.index, self.index + 1, "act", mb, out)

    def _backward(self, mb: int) -> None:
        """:meth:`Stage.backward` with the next stage's gradient; the input gradient goes back."""
        grad = None if self.is_last else self._p2p.recv(self.index + 1, self.index, "grad", mb)[0]
        grad_in = self._stage.backward(mb, grad)
        if not self.is_first:
            self._p2p.send(self.index, self.index - 1, "grad", mb, grad_in)

    def _optimizer_step(self) -> None:
        """:meth:`Stage.step` (through the aliases; the LR is the caller's), then the caller's scheduler."""
        self._stage.step()
        schedulers = self.lr_scheduler if isinstance(self.lr_scheduler, list | tuple) else [self.lr_scheduler]
        for scheduler in schedulers:
            if scheduler is not None:
                scheduler.step()


def _check_optimizer(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], module: nn.Module) -> None:
    """Fresh torch optimizers (one, or several over disjoint parameters: Muon's matrices and AdamW's rest)
    over this stage module's own parameters (they are rebound to aliases)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if (
        not isinstance(optimizers, Sequence)
        or not optimizers
        or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers)
    ):
        raise ValueError(
            "optimizer must be a torch.optim.Optimizer, a list of them (e.g. Muon and AdamW) or None, "
            f"got {type(optimizer).__name__}"
        )
    if any(o.state for o in optimizers):
        raise ValueError("optimizer must be fresh (no state yet): its parameters are rebound to aliases")
    own = {id(p) for p in module.parameters()}
    held = [id(p) for o in optimizers for group in o.param_groups for p in group["params"]]
    if any(i not in own for i in held):
        raise ValueError("optimizer holds parameters that are not the stage module's")
    if len(set(held)) < len(held):
        raise ValueError("the optimizers hold a parameter twice: give each parameter to one of them")


def _stages_that_train(trains: bool, stages: int, group: Any, device: torch.device) -> list[bool]:
    """Every stage's ``trains``, gathered once over the pipeline's group (where each stage's input needs a gradient)."""
    wire = wire_device(dist.get_backend(group), device)
    flags = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(stages)]
    dist.all_gather(flags, torch.tensor([int(trains)], dtype=torch.int64, device=wire), group=group)
    return [bool(f.item()) for f in flags]


def _check_device(module: nn.Module, device: torch.device) -> None:
    """Refuse a module not already on the stage's device: the :class:`Stage` would move it silently."""
    here = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>"
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if t.device != here:
            raise ValueError(
                f"the stage module's {name} is on {t.device}, the PipelineStage's device is {here}: "
                "move the module there (module.to(device)) before building the optimizer"
            )
