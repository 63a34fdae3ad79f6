"""One pipeline stage: its units, its optimizer, its local accumulation counter, its drift record.

The stage steps its optimizer through parameter aliases (:mod:`.optim`), so a micro-batch in flight
runs its backward against the current weights, PACI's semantics, with no weight copy. In bf16
(``dtype=torch.bfloat16``) the stage's parameters *are* bf16 -- the module is converted, not run
under autocast, whose per-forward weight casts autograd would keep for every micro-batch in flight
(a stashed copy each, and stale weights in the backward) -- its inputs and activations are bf16,
the loss is fp32 (:func:`~paci_tune.model.loss.next_token_loss`), and the optimizer keeps fp32
masters written back in place after each step. May import: :mod:`.optim`, :mod:`paci_tune.model`,
:mod:`paci_tune.config`, torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config.schema import OptimizerConfig
from ..model.loss import next_token_loss
from .optim import MASTER_DTYPES, AliasedOptimizer


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of a stage's parameters and activations: bf16 (fp32 masters in :mod:`.optim`) or fp32."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


@dataclass
class _InFlight:
    """What a micro-batch leaves at a stage between its forward and its backward."""

    inputs: torch.Tensor
    outputs: torch.Tensor  # activations, or the scaled loss on the last stage
    updates_at_forward: int


@dataclass
class DriftStats:
    """Optimizer updates crossed between forward and backward, over every micro-batch seen."""

    count: int = 0
    total: int = 0
    maximum: int = 0
    histogram: dict[int, int] = field(default_factory=dict)

    def add(self, drift: int) -> None:
        self.count += 1
        self.total += drift
        self.maximum = max(self.maximum, drift)
        self.histogram[drift] = self.histogram.get(drift, 0) + 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "total": self.total, "maximum": self.maximum, "histogram": dict(self.histogram)}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.total, self.maximum = state["count"], state["total"], state["maximum"]
        self.histogram = {int(k): int(v) for k, v in state["histogram"].items()}


class Stage:
    """A contiguous run of model units on one device, trained with local gradient accumulation.

    ``lr_at(k)`` gives the learning rate of the stage's k-th optimizer step (0-based); under PACI
    every stage takes the same number of steps, so a step budget gives every stage the same
    schedule with no communication. ``dtype``: the parameters' and activations' dtype, fp32 or
    bf16 (module docstring).
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        units: Sequence[nn.Module],
        *,
        window: int,
        optimizer: OptimizerConfig,
        lr_at: Callable[[int], float],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.index, self.n_stages, self.window = index, n_stages, window
        self.device, self.dtype = device, dtype
        self.module = nn.Sequential(*units).to(device)
        if dtype != torch.float32:
            self.module.to(dtype)
        self.lr_at = lr_at
        self.grad_clip = optimizer.grad_clip
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optim = AliasedOptimizer.from_config(self.params, optimizer)
        self.updates = 0
        self.backwards = 0
        self.drift = DriftStats()
        self._inflight: dict[int, _InFlight] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

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
            inputs = inputs.detach().requires_grad_(True)
        out = self.module(inputs)
        if self.is_last:
            assert targets is not None
            loss = next_token_loss(out, targets.to(self.device))
            out = loss / self.window
        self._inflight[mb] = _InFlight(inputs, out, self.updates)
        return loss.detach() if self.is_last else out.detach()

    def backward(self, mb: int, grad: torch.Tensor | None = None, *, warmup: bool = False) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` against the current weights; returns the input gradient.

        ``warmup=True`` discards the gradients and records nothing: a warm-up pass before the run
        leaves weights, optimizer state and counters exactly as they were.
        """
        rec = self._inflight.pop(mb)
        if self.is_last:
            rec.outputs.backward()
        else:
            assert grad is not None
            rec.outputs.backward(grad.to(self.device, dtype=rec.outputs.dtype, non_blocking=True))
        if warmup:
            self.optim.discard_grads()
        else:
            self.backwards += 1
            self.drift.add(self.updates - rec.updates_at_forward)
        return None if self.is_first else rec.inputs.grad

    def gradients(self) -> list[torch.Tensor]:
        """This window's accumulated gradients, as the step will apply them (averaged in place under DP)."""
        return self.optim.gradients()

    def grad_sq_norm(self) -> float:
        """Squared L2 norm of this stage's accumulated gradients (for clipping across stages)."""
        return self.optim.grad_sq_norm()

    def step(self, grad_norm: float | None = None) -> None:
        """Apply the accumulated window at this step's LR (see :meth:`.AliasedOptimizer.step` for ``grad_norm``)."""
        self.optim.set_lr(self.lr_at(self.updates))
        self.optim.step(grad_norm)
        self.updates += 1

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, weights: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Forward without autograd: the activation, or on the last stage the loss.

        ``weights``: score these parameters (a snapshot) instead of the current ones, without
        touching the module (:func:`torch.func.functional_call`), so training state is unchanged.
        """
        x = self._cast(inputs.to(self.device))
        out = self.module(x) if weights is None else torch.func.functional_call(self.module, weights, (x,))
        if self.is_last:
            assert targets is not None
            return next_token_loss(out, targets.to(self.device))
        return out

    def state_dict(self) -> dict:
        """Everything an exact resume needs; in bf16 that includes the fp32 master weights."""
        if self._inflight:
            raise RuntimeError("a stage can only be checkpointed drained (no micro-batch in flight)")
        state = {
            "module": self.module.state_dict(),
            "optimizer": self.optim.optimizer.state_dict(),
            "updates": self.updates,
            "backwards": self.backwards,
            "drift": self.drift.state_dict(),
        }
        if self.optim.mixed:
            state["masters"] = [m.detach() for m in self.optim.master_weights()]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optim.optimizer.load_state_dict(state["optimizer"])
        if self.optim.mixed:
            # A checkpoint without masters (fp32 parameters) holds the weights themselves in fp32.
            names = [n for n, p in zip(self.param_names, self.params, strict=True) if p.dtype in MASTER_DTYPES]
            masters = state.get("masters") or [state["module"][n] for n in names]
            self.optim.load_master_weights(masters)
        self.updates, self.backwards = state["updates"], state["backwards"]
        self.drift.load_state_dict(state["drift"])

    def parameter_bytes(self) -> int:
        """Bytes of the parameters the stage computes with (bf16 ones in bf16; the masters not counted)."""
        return sum(p.numel() * p.element_size() for p in self.params)
