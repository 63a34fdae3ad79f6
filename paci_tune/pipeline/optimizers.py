"""The torch optimizer a stage steps, built from the ``optimizer`` section, and its per-stage momentum.

:func:`build_optimizer` makes AdamW, SGD, NAdam (decoupled weight decay) or Muon with AdamW beside it,
each with weight decay on matrices only (:mod:`paci_tune.config.optimizer`). Muon takes the 2-D
matrices of the model's hidden units (``hidden``: per parameter, whether Muon may take it) and AdamW
the rest; the two are stepped as one by :class:`OptimizerChain`, which a user's own pair (a Muon and
an AdamW handed to :class:`~paci_tune.pipelining.SchedulePACI`) becomes too.

:func:`stage_config` applies PACI's per-stage momentum (``pipeline.stage_momentum``, Ajanthan et al.,
ICML 2025): a stage whose gradients arrive up to ``tau`` updates late gets
``beta1 + tau (beta1_max - beta1) / P`` -- AdamW's and NAdam's ``betas[0]``, Muon's and SGD's
``momentum`` (and Muon's AdamW part's ``betas[0]``) -- so the stalest stages average over the longest
horizon.

Muon is :class:`.muon.Muon`: torch's, with its Newton-Schulz iterations in fp32 on the CPU (why: there).
May import: torch and :mod:`paci_tune.config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from ..config.optimizer import OptimizerConfig
from .muon import Muon


class _RoutedState(MutableMapping):
    """The chain's ``state``: each parameter's entry read from, and written to, the optimizer that owns it."""

    def __init__(self, chain: OptimizerChain) -> None:
        self.chain = chain

    def _owner(self, p: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self.chain.optimizers:
            if any(q is p for g in opt.param_groups for q in g["params"]):
                return opt
        raise KeyError("a tensor none of the chained optimizers steps")

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._owner(p).state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self.chain.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self.chain.optimizers)


class OptimizerChain:
    """Several torch optimizers over disjoint parameters, used as one: Muon's matrices and AdamW's rest.

    It has what the stage reads of an optimizer: ``param_groups`` (every optimizer's, in order, the
    same dicts, so setting a group's ``lr`` sets that optimizer's), ``state`` (routed by parameter),
    ``step``, and a ``state_dict`` in torch's own format, its parameters numbered across the chain in
    ``param_groups`` order -- so a checkpoint reads it per parameter like any optimizer's.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("an OptimizerChain needs at least one optimizer")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> _RoutedState:
        return _RoutedState(self)

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, offset, start = state_dict["param_groups"], 0, 0
        for opt in self.optimizers:
            mine = groups[start : start + len(opt.param_groups)]
            n = sum(len(g["params"]) for g in opt.param_groups)
            opt.load_state_dict(
                {
                    "state": {i - offset: s for i, s in state_dict["state"].items() if offset <= int(i) < offset + n},
                    "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
                }
            )
            start += len(opt.param_groups)
            offset += n


def steps_as_one(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> Any:
    """A user's optimizer(s) as the stage steps them: one as it is, several as an :class:`OptimizerChain`."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return OptimizerChain(list(optimizer))


def _decay_groups(params: Sequence[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (biases and gains take none); empty groups left out."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _adamw(params: Sequence[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_decay_groups(params, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_optimizer(
    params: Sequence[torch.Tensor], cfg: OptimizerConfig, hidden: Sequence[bool] | None = None
) -> torch.optim.Optimizer | OptimizerChain | None:
    """The torch optimizer ``cfg`` names over ``params`` (module docstring); None with no parameter.

    ``hidden``: per parameter, whether it belongs to a unit between the model's first and last
    (Muon takes those of them that are matrices); None: none does.
    """
    if not params:
        return None
    if cfg.name == "sgd":
        return torch.optim.SGD(_decay_groups(params, cfg.weight_decay), lr=cfg.lr, momentum=cfg.momentum_value)
    if cfg.name == "nadam":
        groups = _decay_groups(params, cfg.weight_decay)
        return torch.optim.NAdam(
            groups,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            momentum_decay=cfg.momentum_decay,
            decoupled_weight_decay=True,
        )
    if cfg.name == "muon":
        flags = list(hidden) if hidden is not None else [False] * len(params)
        matrices = [p for p, h in zip(params, flags, strict=True) if h and p.dim() == 2]
        taken = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in taken]
        parts: list[torch.optim.Optimizer] = []
        if matrices:
            parts.append(
                Muon(
                    matrices,
                    lr=cfg.lr,
                    weight_decay=cfg.weight_decay,
                    momentum=cfg.momentum_value,
                    nesterov=cfg.nesterov,
                    ns_steps=cfg.ns_steps,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        if rest:
            parts.append(_adamw(rest, cfg))
        return parts[0] if len(parts) == 1 else OptimizerChain(parts)
    return _adamw(params, cfg)


def stage_config(cfg: OptimizerConfig, beta1_max: float | None, tau: int, stages: int) -> OptimizerConfig:
    """``cfg`` with stage momentum for a stage whose gradients are at most ``tau`` updates late (module
    docstring); unchanged without ``beta1_max`` or staleness."""
    if beta1_max is None or tau <= 0:
        return cfg
    raised = lambda b: b + tau * (beta1_max - b) / stages  # noqa: E731
    betas = (raised(cfg.betas[0]), cfg.betas[1])
    if cfg.name in ("sgd", "muon"):
        return dataclasses.replace(cfg, momentum=raised(cfg.momentum_value), betas=betas)
    return dataclasses.replace(cfg, betas=betas)
