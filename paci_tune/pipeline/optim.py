"""Stepping an optimizer through parameter aliases: PACI's weight update without a weight copy.

The optimizer is built over *aliases* of the parameters (``p.data``), not the parameters
themselves. Stepping through an alias updates the shared storage in place without bumping the
parameter's autograd version counter, so a micro-batch still in flight (forward done, backward
pending) runs its backward against the *current* weights -- PACI's semantics -- with no weight
stash and no "modified by an inplace operation" error. Stepping the parameters directly would
raise that error; replacing ``p.data`` out of place would silently keep the old weights alive.

:class:`AliasedOptimizer` is the one implementation of that step (with gradient-norm clipping),
used by a pipeline :class:`~paci_tune.pipeline.stage.Stage`, by the calibrator's stage pattern and
by the drop-in :class:`~paci_tune.pipelining.SchedulePACI`. May import: torch and
:mod:`paci_tune.config`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config.schema import OptimizerConfig


def build_optimizer(params: Sequence[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on matrices only, as GPT-2 recipes do."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


class AliasedOptimizer:
    """An optimizer whose param groups hold ``p.data`` aliases of ``params`` (module docstring).

    Gradients accumulate on the parameters as usual (autograd writes ``p.grad``); :meth:`step`
    hands them to the aliases, clips, steps and clears both. Build it from the config
    (:meth:`from_config`), or rebind an optimizer the caller built over the parameters
    themselves (:meth:`rebind`, for ``SchedulePACI``).
    """

    def __init__(self, params: Sequence[torch.Tensor], aliases: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer, grad_clip: float | None = None) -> None:  # fmt: skip
        self.params, self.aliases = list(params), list(aliases)
        self.optimizer, self.grad_clip = optimizer, grad_clip

    @classmethod
    def from_config(cls, params: Sequence[torch.Tensor], cfg: OptimizerConfig) -> AliasedOptimizer:
        aliases = [p.data for p in params]
        return cls(params, aliases, build_optimizer(aliases, cfg), cfg.grad_clip)

    @classmethod
    def rebind(cls, optimizer: torch.optim.Optimizer, grad_clip: float | None = None) -> AliasedOptimizer:
        """Point a fresh optimizer's param groups, in place, at aliases of their parameters."""
        params: list[torch.Tensor] = []
        aliases: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            group_aliases = [p.data for p in group["params"]]
            params += group["params"]
            aliases += group_aliases
            group["params"] = group_aliases
        return cls(params, aliases, optimizer, grad_clip)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def grad_sq_norm(self) -> float:
        """Squared L2 norm of the accumulated gradients (summed across stages for a global clip)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        return float(sum(torch.linalg.vector_norm(g.float()) ** 2 for g in grads))

    def step(self, grad_norm: float | None = None) -> None:
        """Apply the accumulated gradients through the aliases, then clear them.

        With ``grad_clip``, gradients are scaled down to that norm as ``clip_grad_norm_`` does.
        ``grad_norm`` is the norm to clip by -- the whole model's under a flush schedule, which
        synchronises its steps anyway; ``None`` means these parameters' own norm, which is what a
        PACI stage can do without coordinating with the others.
        """
        for p, alias in zip(self.params, self.aliases, strict=True):
            alias.grad = p.grad
        if self.grad_clip:
            norm = grad_norm if grad_norm is not None else self.grad_sq_norm() ** 0.5
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                for alias in self.aliases:
                    if alias.grad is not None:
                        alias.grad.mul_(coef)
        self.optimizer.step()
        for p, alias in zip(self.params, self.aliases, strict=True):
            p.grad = None
            alias.grad = None

    def discard_grads(self) -> None:
        for p in self.params:
            p.grad = None
