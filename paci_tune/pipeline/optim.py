"""Stepping an optimizer through parameter aliases: PACI's weight update without a weight copy.

The optimizer is built over *aliases* of the parameters (``p.data``), not the parameters
themselves. Stepping through an alias updates the shared storage in place without bumping the
parameter's autograd version counter, so a micro-batch still in flight (forward done, backward
pending) runs its backward against the *current* weights -- PACI's semantics -- with no weight
stash and no "modified by an inplace operation" error. Stepping the parameters directly would
raise that error; replacing ``p.data`` out of place would silently keep the old weights alive.

**bf16 parameters** get mixed precision as large-scale trainers do it (fp32 master weights): the
module computes with its bf16 parameters, and the optimizer steps an fp32 *master* copy of each.
A hook on the parameter adds every backward's bf16 gradient into the master's fp32 ``.grad`` and
frees it, so a window's gradients accumulate in fp32 (one rounding to bf16 per micro-batch's
gradient, none across the window). After the step, each master is written into its parameter's
storage **in place, through the same alias** (``alias.copy_(master)``, rounding to nearest), so an
in-flight backward uses the new bf16 weights, as in fp32, with no per-micro-batch copy. What that
holds per parameter: 2 bytes of bf16 weight, 4 of fp32 master, 4 of fp32 gradient, the optimizer
state (AdamW: 8), and for the length of one backward the parameter's bf16 gradient. No loss
scaling: bf16 has fp32's exponent range, so gradients do not underflow as they do in fp16 (fp16
parameters are refused). Parameters of any other dtype are their own masters (the fp32 path).

:class:`AliasedOptimizer` is the one implementation of that step (with gradient-norm clipping),
used by a pipeline :class:`~paci_tune.pipeline.stage.Stage`, by the calibrator's stage pattern and
by the drop-in :class:`~paci_tune.pipelining.SchedulePACI`.

**Nothing to train.** A stage whose parameters are all frozen (``requires_grad=False``), or that has
none, gets an :class:`AliasedOptimizer` over no parameters: it holds no torch optimizer (torch
refuses an empty parameter list), and every method is the empty case of the general one -- no
gradients, a norm of 0, a step that does nothing, an empty state -- so callers need no second path.
**Weight prediction** (``predict``: PACI's ``pipeline.predict_weights``, SpecTrain / PipeOptim): a
stage whose gradients arrive up to ``tau`` updates late runs its forwards on the weights extrapolated
``tau`` steps along the optimizer's last step, ``W_hat = W + tau (W - W_prev) = W - lr tau Delta``.
The parameters hold ``W_hat`` and the masters hold ``W`` (an fp32 copy, as for bf16: the one extra
copy), so the gradients, taken at ``W_hat``, land on ``W``; after each step the new ``W_hat`` is
written into the parameters in place, as a bf16 master is. Delta is whatever the optimizer did
(AdamW's ``m_hat / (sqrt(v_hat) + eps) + lambda W``, Muon's orthogonalised momentum), read off the
step itself. May import: torch and :mod:`paci_tune.config`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config.optimizer import OptimizerConfig
from .optimizers import OptimizerChain, build_optimizer, steps_as_one

MASTER_DTYPES = (torch.bfloat16,)
"""Parameter dtypes that get an fp32 master copy (module docstring)."""

_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter -> the hook folding its gradient into its master; the newest optimizer over it owns it."""


def master_for(alias: torch.Tensor) -> torch.Tensor:
    """What the optimizer steps for a parameter with alias ``alias``: an fp32 copy for bf16, else the alias."""
    if alias.dtype == torch.float16:
        raise ValueError("fp16 parameters need loss scaling, which paci-tune does not do: use bf16 or fp32")
    if alias.dtype in MASTER_DTYPES:
        return alias.float()
    return alias


def _fold_grad(param: torch.Tensor, master: torch.Tensor) -> None:
    """Add the parameter's gradient (one backward's, in bf16) into the master's fp32 gradient; free it."""
    if param.grad is None:
        return
    if master.grad is None:
        master.grad = param.grad.float()
    else:
        master.grad.add_(param.grad)
    param.grad = None


def _own(param: torch.Tensor, master: torch.Tensor) -> None:
    """Fold every gradient autograd accumulates on ``param`` into ``master`` (replacing an older owner)."""
    release_masters([param])
    _HOOKS[param] = param.register_post_accumulate_grad_hook(lambda p: _fold_grad(p, master))


def release_masters(params: Sequence[torch.Tensor]) -> None:
    """Stop folding these parameters' gradients into masters (frees masters no optimizer uses any more)."""
    for p in params:
        old = _HOOKS.pop(p, None)
        if old is not None:
            old.remove()


class AliasedOptimizer:
    """An optimizer whose param groups hold ``p.data`` aliases of ``params``, or their fp32 masters.

    fp32 parameters: gradients accumulate on the parameters as usual (autograd writes ``p.grad``);
    :meth:`step` hands them to the aliases, clips, steps and clears both. bf16 parameters: the
    optimizer steps fp32 ``masters`` whose gradients accumulate in fp32 as backwards run, and
    :meth:`step` writes them back into the aliases in place (module docstring). Build it from the
    config (:meth:`from_config`), or rebind an optimizer the caller built over the parameters
    themselves (:meth:`rebind`, for ``SchedulePACI``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        aliases: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer | OptimizerChain | None,
        grad_clip: float | None = None,
        masters: Sequence[torch.Tensor] | None = None,
        predict: int = 0,
    ) -> None:
        """``optimizer`` is None exactly when there is no parameter to train (module docstring). ``predict``:
        the steps ahead the parameters are extrapolated (0: none); every master is then its own copy."""
        if (optimizer is None) != (not params):
            raise ValueError("an AliasedOptimizer has a torch optimizer exactly when it has parameters to train")
        self.params, self.aliases = list(params), list(aliases)
        self.masters = list(masters) if masters is not None else list(self.aliases)
        if predict and any(m is a for m, a in zip(self.masters, self.aliases, strict=True)):
            raise ValueError("weight prediction needs a master copy of every parameter (from_config makes them)")
        self.optimizer, self.grad_clip, self.predict = optimizer, grad_clip, predict
        for p, alias, master in zip(self.params, self.aliases, self.masters, strict=True):
            if master is not alias:
                _own(p, master)

    @property
    def trains(self) -> bool:
        """Whether there is anything to train: False for a stage whose parameters are all frozen (or absent)."""
        return self.optimizer is not None

    @property
    def mixed(self) -> bool:
        """Whether any parameter has an fp32 master (bf16 parameters)."""
        return any(m is not a for m, a in zip(self.masters, self.aliases, strict=True))

    @classmethod
    def from_config(
        cls,
        params: Sequence[torch.Tensor],
        cfg: OptimizerConfig,
        hidden: Sequence[bool] | None = None,
        predict: int = 0,
    ) -> AliasedOptimizer:
        """The optimizer ``cfg`` names over ``params`` (``hidden``: which may go to Muon,
        :func:`.optimizers.build_optimizer`), with ``predict`` steps of weight prediction (module docstring)."""
        aliases = [p.data for p in params]
        masters = [master_for(a) for a in aliases]
        if predict:
            masters = [m.detach().clone() if m is a else m for m, a in zip(masters, aliases, strict=True)]
        return cls(params, aliases, build_optimizer(masters, cfg, hidden), cfg.grad_clip, masters, predict)

    @classmethod
    def rebind(
        cls, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, grad_clip: float | None = None
    ) -> AliasedOptimizer:
        """Point a fresh optimizer's param groups, in place, at aliases of their parameters (or fp32 masters).

        ``None``: the stage has nothing to train (an optimizer over no parameters). A sequence (Muon on
        the matrices, AdamW on the rest) is stepped as one (:class:`.optimizers.OptimizerChain`).
        """
        if optimizer is None:
            return cls([], [], None, grad_clip)
        if not isinstance(optimizer, OptimizerChain):
            optimizer = steps_as_one(optimizer)
        params: list[torch.Tensor] = []
        aliases: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            group_aliases = [p.data for p in group["params"]]
            group_masters = [master_for(a) for a in group_aliases]
            params += group["params"]
            aliases += group_aliases
            masters += group_masters
            group["params"] = group_masters
        return cls(params, aliases, optimizer, grad_clip, masters)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            group["lr"] = lr

    def _collect(self) -> None:
        """Put every accumulated gradient where the optimizer reads it: on the aliases, or the masters."""
        for p, alias, master in zip(self.params, self.aliases, self.masters, strict=True):
            if master is alias:
                alias.grad = p.grad
            else:
                _fold_grad(p, master)  # a gradient set on the parameter by hand, not by a backward

    def gradients(self) -> list[torch.Tensor]:
        """The accumulated gradients the next :meth:`step` applies, in parameter order.

        What data parallelism averages in place across replicas before the step. Parameters no
        backward reached are left out (and stay untouched by the step, as without replicas); every
        replica runs the same modules on the same shapes, so all leave out the same ones.
        """
        self._collect()
        return [m.grad for m in self.masters if m.grad is not None]

    def gradient_of(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s gradient as accumulated so far: on the parameter, or on its fp32 master."""
        p, alias, master = self.params[i], self.aliases[i], self.masters[i]
        return p.grad if master is alias else master.grad

    def set_gradient(self, i: int, value: torch.Tensor) -> None:
        """Make ``value`` parameter ``i``'s accumulated gradient, where :meth:`step` reads it (a tied
        parameter's copy that no backward reached takes the other holders' sum, :mod:`.tied`)."""
        p, alias, master = self.params[i], self.aliases[i], self.masters[i]
        if master is alias:
            p.grad = value.to(p.dtype)
        else:
            master.grad = value.float()

    def watch_gradients(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(i)`` whenever a backward has finished parameter ``i``'s gradient.

        Registered after the fold into the master (hooks run in registration order), so
        :meth:`gradient_of` then sees this backward's contribution wherever it lives.
        """
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: callback(i))

    def grad_sq_norm(self, skip: Collection[int] = ()) -> float:
        """Squared L2 norm of the accumulated gradients (summed across stages for a global clip).

        ``skip``: parameters another stage counts (its copies of a tied parameter, :mod:`.tied`).
        """
        self._collect()
        grads = [m.grad for i, m in enumerate(self.masters) if m.grad is not None and i not in skip]
        if not grads:
            return 0.0
        return float(sum(torch.linalg.vector_norm(g.float()) ** 2 for g in grads))

    def step(self, grad_norm: float | None = None) -> None:
        """Apply the accumulated gradients through the aliases, then clear them.

        With ``grad_clip``, gradients are scaled down to that norm as ``clip_grad_norm_`` does.
        ``grad_norm`` is the norm to clip by -- the whole model's under a flush schedule, which
        synchronises its steps anyway; ``None`` means these parameters' own norm, which is what a
        PACI stage can do without coordinating with the others. Nothing to train: nothing happens.
        """
        if self.optimizer is None:
            return
        self._collect()
        if self.grad_clip:
            norm = grad_norm if grad_norm is not None else self.grad_sq_norm() ** 0.5
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                for master in self.masters:
                    if master.grad is not None:
                        master.grad.mul_(coef)
        before = [m.detach().clone() for m in self.masters] if self.predict else None
        self.optimizer.step()
        for i, (p, alias, master) in enumerate(zip(self.params, self.aliases, self.masters, strict=True)):
            if before is not None:  # W_hat = W + tau (W - W_prev), into the parameter's storage in place
                alias.copy_(master.detach() + self.predict * (master.detach() - before[i]))
            elif master is not alias:
                alias.copy_(master)  # in place into the bf16 storage: no version bump, no new tensor
            p.grad = None
            master.grad = None

    def discard_grads(self) -> None:
        for p, master in zip(self.params, self.masters, strict=True):
            p.grad = None
            master.grad = None

    def state_dict(self) -> dict:
        """The torch optimizer's state, or with nothing to train an empty one of its shape: what a checkpoint keeps."""
        return self.optimizer.state_dict() if self.optimizer is not None else {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (nothing to restore with nothing to train)."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state)

    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 masters of the bf16 parameters, in parameter order (what a checkpoint must keep)."""
        return [m for m, a in zip(self.masters, self.aliases, strict=True) if m is not a]

    @torch.no_grad()
    def load_master_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Restore :meth:`master_weights` in place, and the bf16 parameters from them (under weight
        prediction the parameters hold the extrapolated weights: the caller restores those)."""
        pairs = [(m, a) for m, a in zip(self.masters, self.aliases, strict=True) if m is not a]
        if len(weights) != len(pairs):
            raise ValueError(f"{len(weights)} master weights for {len(pairs)} bf16 parameters")
        for (master, alias), w in zip(pairs, weights, strict=True):
            master.copy_(w)
            if not self.predict:
                alias.copy_(master)
