"""One pipeline stage: its units, its optimizer, its local accumulation counter, its drift record.

The stage steps its optimizer through parameter aliases (:mod:`.optim`), so a step never trips
autograd's in-place check on a micro-batch in flight. Which weights that micro-batch's backward then
reads is ``backward_weights`` (:mod:`.versions`): ``forward``, the values its forward used (one copy
per version still needed, made on step), or ``current``, the weights as they are now (no copy). In bf16
(``dtype=torch.bfloat16``) the stage's parameters *are* bf16 -- the module is converted, not run
under autocast, whose per-forward weight casts autograd would keep for every micro-batch in flight
(a cast per micro-batch, where ``forward`` keeps one copy per version) -- its inputs and activations
are bf16, the loss is fp32 (:func:`~paci_tune.model.loss.next_token_loss`), and the optimizer keeps
fp32 masters written back in place after each step. The conversion leaves alone the buffers that
must stay exact (:func:`to_compute_dtype`): complex ones and non-persistent ones (derived caches such
as a rotary ``inv_freq``, which in bf16 puts cos/sin at position 4095 off by up to 1.9).

**Modes.** A stage's module trains in train mode (dropout on: :meth:`Stage.forward`, and torch's
schedule classes, which call the module) and is scored in eval mode (:meth:`Stage.evaluate`, every
validation of every runtime and schedule), its mode restored after.

**Frozen parameters** (``requires_grad=False``) are computed with and never stepped: the optimizer,
the fp32 masters, the weight versions and the drift record cover the trainable parameters only. A
stage with nothing to train has an optimizer over no parameters and takes no step, so its weights
keep their one version and its drift record stays empty (:attr:`Stage.trains`). Its backward runs
only where a gradient has somewhere to go: a stage whose input needs no gradient (``input_grad``:
nothing upstream trains) computes none, and a stage whose output needs none (nothing in it or
upstream trains) runs no backward at all. The message to the previous stage is then
:data:`NO_GRADIENT`, so every stage's program and the transport's order stay the same.
May import: :mod:`.optim`, :mod:`.versions`, :mod:`.precision`,
:mod:`paci_tune.model`,
:mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ..config.optimizer import OptimizerConfig
from ..config.schema import BACKWARD_WEIGHTS
from ..model.loss import next_token_loss
from .optim import MASTER_DTYPES, AliasedOptimizer
from .precision import to_compute_dtype
from .versions import WeightVersions


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of a stage's parameters and activations: bf16 (fp32 masters in :mod:`.optim`) or fp32."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


class BackwardRead(NamedTuple):
    """What one micro-batch's backward at a stage saw: weight versions are optimizer-update counts."""

    mb: int
    forward_version: int  # the weights its forward used
    read_version: int  # the weights its backward multiplied by (``forward``: the same; ``current``: now)
    backward_version: int  # the stage's weights when the backward ran (drift = this - forward_version)


BACKWARD_LOG = 4096  # micro-batches a stage remembers in :attr:`Stage.backward_log` (a long run's tail)

NO_GRADIENT = torch.empty(0)
"""What a backward sends upstream when no gradient flows to the previous stage (nothing there or
before it trains): an empty tensor in the gradient's place, so the message order is unchanged."""


def carries_gradient(grad: torch.Tensor | None) -> bool:
    """Whether a gradient received from the next stage is one (not :data:`NO_GRADIENT`)."""
    return grad is not None and grad.numel() > 0


@dataclass
class _InFlight:
    """What a micro-batch leaves at a stage between its forward and its backward."""

    inputs: torch.Tensor | None  # whose gradient goes upstream; None: the input needs none
    outputs: torch.Tensor | None  # activations, or the scaled loss on the last stage; None: no backward to run
    updates_at_forward: int
    held: bool  # whether it holds its forward's weight version (``forward`` mode)


@dataclass
class DriftStats:
    """Optimizer updates crossed between forward and backward, over every micro-batch seen.

    ``read_histogram``: for each micro-batch, how many updates newer than its forward's were the
    weights its backward read (0 in ``forward`` mode, the drift in ``current`` mode): what each
    backward saw, beside how late it came.
    """

    count: int = 0
    total: int = 0
    maximum: int = 0
    histogram: dict[int, int] = field(default_factory=dict)
    read_histogram: dict[int, int] = field(default_factory=dict)

    def add(self, drift: int, read_ahead: int | None = None) -> None:
        """One micro-batch: ``drift`` updates crossed; its backward read weights ``read_ahead`` updates newer.

        ``read_ahead`` defaults to ``drift`` (the current weights).
        """
        self.count += 1
        self.total += drift
        self.maximum = max(self.maximum, drift)
        self.histogram[drift] = self.histogram.get(drift, 0) + 1
        seen = drift if read_ahead is None else read_ahead
        self.read_histogram[seen] = self.read_histogram.get(seen, 0) + 1

    @property
    def max_read_ahead(self) -> int:
        """Most updates any backward's weights were newer than its forward's."""
        return max(self.read_histogram, default=0)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def state_dict(self) -> dict:
        return {
            "count": self.count,
            "total": self.total,
            "maximum": self.maximum,
            "histogram": dict(self.histogram),
            "read_histogram": dict(self.read_histogram),
        }

    def load_state_dict(self, state: dict) -> None:
        self.count, self.total, self.maximum = state["count"], state["total"], state["maximum"]
        self.histogram = {int(k): int(v) for k, v in state["histogram"].items()}
        # Checkpoints from before the record existed were all read at the current weights.
        self.read_histogram = {int(k): int(v) for k, v in state.get("read_histogram", state["histogram"]).items()}


class Stage:
    """A contiguous run of model units on one device, trained with local gradient accumulation.

    ``lr_at(k)`` gives the learning rate of the stage's k-th optimizer step (0-based); under PACI
    every stage takes the same number of steps, so a step budget gives every stage the same
    schedule with no communication. ``dtype``: the parameters' and activations' dtype, fp32 or
    bf16 (module docstring). ``input_grad``: whether the stage's input needs a gradient, i.e.
    whether some unit before this stage trains (module docstring); False on the first stage.
    ``hidden``: per unit, whether it lies between the model's first and last (Muon takes its
    matrices); ``predict``: steps of weight prediction (:mod:`.optim`; 0: none).
    """

    def __init__(
        self,
        index: int,
        stages: int,
        units: Sequence[nn.Module],
        *,
        window: int,
        optimizer: OptimizerConfig | AliasedOptimizer,
        lr_at: Callable[[int], float] | None,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        backward_weights: str = "current",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
        input_grad: bool = True,
        hidden: Sequence[bool] | None = None,
        predict: int = 0,
    ) -> None:
        if backward_weights not in BACKWARD_WEIGHTS:
            raise ValueError(f"backward_weights must be one of {BACKWARD_WEIGHTS}, got {backward_weights!r}")
        self.index, self.stages, self.window = index, stages, window
        self.input_grad = input_grad and index > 0
        self.device, self.dtype = device, dtype
        self.module = nn.Sequential(*units)
        self.module.to(device)
        if dtype != torch.float32:
            to_compute_dtype(self.module, dtype)
        self.module.train()  # a stage trains (dropout on); :meth:`evaluate` scores in eval mode
        self.lr_at, self.loss_fn = lr_at, loss_fn
        if isinstance(optimizer, AliasedOptimizer):  # built by the caller over this module's parameters
            self.optim = optimizer
            names = {id(p): n for n, p in self.module.named_parameters()}
            self.params = list(optimizer.params)
            self.param_names = [names[id(p)] for p in self.params]
            self.grad_clip = optimizer.grad_clip
        else:
            named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
            self.param_names = [n for n, _ in named]
            self.params = [p for _, p in named]
            flags = [bool(hidden[int(n.split(".", 1)[0])]) for n in self.param_names] if hidden is not None else None
            self.optim = AliasedOptimizer.from_config(self.params, optimizer, flags, predict)
            self.grad_clip = optimizer.grad_clip
        self.backward_weights = backward_weights
        # Indices in ``params`` of copies of a tied parameter whose gradient another stage's norm counts.
        self.counted_elsewhere: frozenset[int] = frozenset()
        truth = self.optim.masters if self.optim.predict else None  # evaluations score the trained weights
        self.versions = WeightVersions(list(zip(self.param_names, self.params, strict=True)), truth)
        self.backwards = 0
        self.drift = DriftStats()
        # The last micro-batches' reads, one record each; ``drift`` keeps the whole run's histograms.
        self.backward_log: deque[BackwardRead] = deque(maxlen=BACKWARD_LOG)
        self._inflight: dict[int, _InFlight] = {}

    @property
    def updates(self) -> int:
        """Optimizer steps taken: the version of the weights the parameters hold now."""
        return self.versions.current

    @updates.setter
    def updates(self, value: int) -> None:
        self.versions.current = value

    @property
    def trains(self) -> bool:
        """Whether the stage has a parameter to train (else it has no optimizer and takes no step)."""
        return self.optim.trains

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        """Floating inputs in the stage's dtype (token ids stay as they are)."""
        if self.dtype != torch.float32 and x.is_floating_point():
            return x.to(self.dtype)
        return x

    def forward(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run the stage on micro-batch ``mb``; keep what its backward needs.

        Returns the activation to send on, or, on the last stage, the detached *unscaled* loss.
        The last stage scales the loss by 1/a so a window's gradients average, like plain gradient
        accumulation over a global batch.
        """
        inputs = self._cast(inputs.to(self.device, non_blocking=True))
        if not self.is_first:
            inputs = inputs.detach().requires_grad_(self.input_grad and inputs.is_floating_point())
        held = self.backward_weights == "forward"
        if held:
            with self.versions.recording():
                out = self.module(inputs)
                if self.is_last:  # a loss with weights of its own saves them too
                    assert targets is not None
                    loss = self.loss_fn(out, targets.to(self.device))
            self.versions.hold(self.updates)
        else:
            out = self.module(inputs)
            if self.is_last:
                assert targets is not None
                loss = self.loss_fn(out, targets.to(self.device))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.index} returned {type(out).__name__}; a pipeline stage passes on one tensor")
        if self.is_last:
            out = loss / self.window
        # What needs no gradient has no backward: the stage need not hold it.
        kept_in = inputs if inputs.requires_grad else None
        self._inflight[mb] = _InFlight(kept_in, out if out.requires_grad else None, self.updates, held)
        return loss.detach() if self.is_last else out.detach()

    def backward(self, mb: int, grad: torch.Tensor | None = None, *, warmup: bool = False) -> torch.Tensor | None:
        """Backward of micro-batch ``mb``; returns what to send the previous stage (None on the first).

        That is the input gradient, or :data:`NO_GRADIENT` where none flows (module docstring). It
        reads the weights its forward used (``forward``) or the current ones (``current``). Where the
        output needs no gradient, or ``grad`` is :data:`NO_GRADIENT`, there is no backward to run.

        ``warmup=True`` discards the gradients and records nothing: a warm-up pass before the run
        leaves weights, optimizer state and counters exactly as they were.
        """
        rec = self._inflight.pop(mb)
        try:
            if rec.outputs is not None and self.is_last:
                rec.outputs.backward()
            elif rec.outputs is not None and carries_gradient(grad):
                assert grad is not None
                rec.outputs.backward(grad.to(self.device, dtype=rec.outputs.dtype, non_blocking=True))
        finally:
            if rec.held:
                self.versions.release(rec.updates_at_forward)
        if warmup:
            self.optim.discard_grads()
        else:
            self.backwards += 1
            if self.trains:  # a stage with nothing to train has nothing to drift
                drift = self.updates - rec.updates_at_forward
                self.drift.add(drift, 0 if rec.held else drift)
                read = rec.updates_at_forward if rec.held else self.updates
                self.backward_log.append(BackwardRead(mb, rec.updates_at_forward, read, self.updates))
        if self.is_first:
            return None
        grad_in = rec.inputs.grad if rec.inputs is not None else None
        return grad_in if grad_in is not None else NO_GRADIENT

    def gradients(self) -> list[torch.Tensor]:
        """This window's accumulated gradients, as the step will apply them (averaged in place under DP)."""
        return self.optim.gradients()

    def grad_sq_norm(self) -> float:
        """Squared L2 norm of this stage's accumulated gradients (for clipping across stages).

        A tied parameter's copy counts at its first holder only (:attr:`counted_elsewhere`), so the
        stages' norms add up to the whole model's.
        """
        return self.optim.grad_sq_norm(self.counted_elsewhere)

    def step(self, grad_norm: float | None = None) -> None:
        """Apply the accumulated window at this step's LR (see :meth:`.AliasedOptimizer.step` for ``grad_norm``).

        Weights a micro-batch in flight or a pending evaluation still needs are copied first
        (:meth:`.WeightVersions.preserve`); ``lr_at=None`` leaves the LR to the caller's scheduler.
        A stage with nothing to train takes no step: its weights keep their one version.
        """
        if not self.trains:
            return
        if self.lr_at is not None:
            self.optim.set_lr(self.lr_at(self.updates))
        self.versions.preserve()
        self.optim.step(grad_norm)
        self.updates += 1

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, weights: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Forward without autograd, in eval mode: the activation, or on the last stage the loss.

        ``weights``: score these parameters (a snapshot) instead of the current ones, without
        touching the module (:func:`torch.func.functional_call`), so training state is unchanged.
        """
        x = self._cast(inputs.to(self.device))
        if weights is None:  # the live weights: under weight prediction, the trained ones (:mod:`.versions`)
            weights = self.versions.weights(self.updates)
        training = self.module.training
        self.module.eval()  # dropout off, as plain PyTorch validates; the training mode comes back after
        try:
            out = self.module(x) if weights is None else torch.func.functional_call(self.module, weights, (x,))
            if self.is_last:
                assert targets is not None
                return self.loss_fn(out, targets.to(self.device))
            return out
        finally:
            self.module.train(training)

    def state_dict(self) -> dict:
        """Everything an exact resume needs; in bf16 that includes the fp32 master weights."""
        if self._inflight:
            raise RuntimeError("a stage can only be checkpointed drained (no micro-batch in flight)")
        state = {
            "module": self.module.state_dict(),
            # every parameter's names, frozen and tied ones too: what the checkpoint tells from buffers
            "param_names": [n for n, _ in self.module.named_parameters(remove_duplicate=False)],
            "optimizer": self.optim.state_dict(),
            "updates": self.updates,
            "backwards": self.backwards,
            "drift": self.drift.state_dict(),
            "opt_names": self._optimizer_order(),  # optimizer state index -> parameter name (resharding)
        }
        if self.optim.mixed:
            state["masters"] = [m.detach() for m in self.optim.master_weights()]
            # whose masters they are: bf16 parameters', or every one's under weight prediction (resharding)
            state["master_names"] = [
                n
                for n, m, a in zip(self.param_names, self.optim.masters, self.optim.aliases, strict=True)
                if m is not a
            ]
        return state

    def _optimizer_order(self) -> list[str]:
        """Parameter names in the optimizer's index order, so a checkpoint can be read per parameter."""
        if self.optim.optimizer is None:
            return []
        by_id = {id(m): n for n, m in zip(self.param_names, self.optim.masters, strict=True)}
        return [by_id[id(m)] for g in self.optim.optimizer.param_groups for m in g["params"]]

    @torch.no_grad()
    def _load_params(self, state: dict) -> None:
        """A resharded state: per parameter name its fp32 value and optimizer state (moments, step).

        The value goes into the fp32 master (bf16) and the parameter (rounded to its dtype), so a
        stage cut differently from the one that wrote the checkpoint continues the same numbers. A
        frozen parameter takes the value alone; one trained here but not in the checkpoint (frozen
        there) starts with fresh optimizer state.
        """
        entries = state["params"]
        names = [n for n, _ in self.module.named_parameters()]
        missing = sorted(set(names) - set(entries))
        if missing:
            raise KeyError(f"stage {self.index}: the checkpoint has no parameters {missing}")
        for name in set(names) - set(self.param_names):  # frozen here
            self.module.get_parameter(name).data.copy_(entries[name]["value"].to(self.device))
        opt_state = self.optim.optimizer.state if self.optim.optimizer is not None else {}
        for name, p, master in zip(self.param_names, self.params, self.optim.masters, strict=True):
            value = entries[name]["value"].to(self.device)
            master.copy_(value)
            if master is not p.data:
                p.data.copy_(master)
            if entries[name]["state"]:
                opt_state[master] = {
                    k: v.clone() if k == "step" else v.to(self.device).clone()
                    for k, v in entries[name]["state"].items()
                }
        for name, buf in state.get("buffers", {}).items():
            self.module.get_buffer(name).copy_(buf)

    def load_state_dict(self, state: dict) -> None:
        if "params" in state:  # resharded (paci_tune.train.checkpoint.reshard)
            self._load_params(state)
            self.updates = state["updates"] if self.trains else 0  # nothing to train: one version, ever
            self.backwards = state["updates"] * self.window
            return
        self.module.load_state_dict(state["module"])
        self.optim.load_state_dict(state["optimizer"])
        if self.optim.mixed:
            # A checkpoint without masters (fp32 parameters) holds the weights themselves in fp32.
            names = [n for n, p in zip(self.param_names, self.params, strict=True) if p.dtype in MASTER_DTYPES]
            masters = state.get("masters") or [state["module"][n] for n in names]
            self.optim.load_master_weights(masters)
        self.updates, self.backwards = state["updates"], state["backwards"]
        self.drift.load_state_dict(state["drift"])

    def parameter_bytes(self) -> int:
        """Bytes of the trainable parameters the stage computes with (bf16 ones in bf16; the masters not
        counted): what one weight copy clones. Frozen parameters never change, so they are never copied."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def copies_stats(self) -> dict:
        """What ``forward`` mode's weight copies cost here: the most held at once, and how many were made."""
        return {
            "backward_weights": self.backward_weights,
            "weight_copies_peak": self.versions.peak_copies,
            "weight_copies_made": self.versions.copies_made,
            "weight_copy_bytes": self.versions.weight_bytes,
        }
