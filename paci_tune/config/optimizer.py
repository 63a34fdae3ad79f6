"""The ``optimizer`` section: which torch optimizer every stage steps, and its settings.

Four optimizers, each with weight decay on matrices only (as GPT-2 recipes decay):

- ``adamw``: ``torch.optim.AdamW`` (``betas``, ``eps``);
- ``sgd``: ``torch.optim.SGD`` with ``momentum`` (default 0.9);
- ``nadam``: ``torch.optim.NAdam`` with decoupled weight decay (``betas``, ``eps``, and
  ``momentum_decay``, its psi: the larger, the sooner its momentum schedule reaches ``betas[0]``);
- ``muon``: ``torch.optim.Muon`` on the 2-D weight matrices of every unit but the model's first and
  last (the embedding and the head), with ``adjust_lr_fn="match_rms_adamw"`` so ``lr`` keeps AdamW's
  scale, and AdamW (``betas``, ``eps``) on every other parameter; ``momentum`` (default 0.95, Muon's),
  ``nesterov`` and ``ns_steps`` (Newton-Schulz iterations) are Muon's.

Asynchronous-pipeline work reports that high momentum (NAdam with betas (0.99, 0.999)) and Muon
tolerate stale gradients far better than AdamW; these let a search find out for a user's model.
:meth:`OptimizerConfig.settings` is what changes an optimizer's numbers -- the keys of its own kind,
resolved -- so a checkpoint and a shared curve compare exactly those. May import:
:mod:`paci_tune.errors` and the standard library.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError

OptimizerName = Literal["adamw", "sgd", "nadam", "muon"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
MAX_LR = 1e3
"""A peak LR beyond this moves each weight by more than any model survives; it is a typo, not a setting."""
DEFAULT_MOMENTUM = {"sgd": 0.9, "muon": 0.95}
"""``momentum`` when the file does not give it: SGD's customary 0.9, Muon's own 0.95."""
_KEYS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "grad_clip"),
    "sgd": ("lr", "momentum", "weight_decay", "grad_clip"),
    "nadam": ("lr", "betas", "eps", "weight_decay", "momentum_decay", "grad_clip"),
    "muon": ("lr", "momentum", "nesterov", "ns_steps", "betas", "eps", "weight_decay", "grad_clip"),
}
"""The keys each optimizer reads: the rest of the section is ignored by it (and by its fingerprint)."""


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, value, "a positive number")


@dataclass(frozen=True)
class OptimizerConfig:
    name: OptimizerName = "adamw"
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    momentum: float | None = None  # sgd and muon; null: DEFAULT_MOMENTUM
    momentum_decay: float = 0.004  # nadam's psi
    nesterov: bool = True  # muon
    ns_steps: int = 5  # muon: Newton-Schulz iterations per step
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        self.check("optimizer")

    def check(self, key: str) -> None:
        _positive(f"{key}.lr", self.lr)
        if self.lr > MAX_LR:
            raise ConfigError(f"{key}.lr", self.lr, f"at most {MAX_LR:g} (a larger step turns every weight to inf)")
        _positive(f"{key}.eps", self.eps)
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"{key}.momentum", self.momentum, "null or a number in [0, 1)")
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"{key}.betas[{i}]", b, "a number in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"{key}.weight_decay", self.weight_decay, "a number >= 0")
        _positive(f"{key}.momentum_decay", self.momentum_decay)
        if not 1 <= self.ns_steps < 100:
            raise ConfigError(f"{key}.ns_steps", self.ns_steps, "an integer in [1, 100) (torch's Muon refuses more)")
        if self.grad_clip is not None:
            _positive(f"{key}.grad_clip", self.grad_clip)

    @property
    def momentum_value(self) -> float:
        """SGD's or Muon's momentum: the file's, or that optimizer's default."""
        return self.momentum if self.momentum is not None else DEFAULT_MOMENTUM.get(self.name, 0.9)

    @property
    def timing_key(self) -> str:
        """What a cost profile times this optimizer's step under: its name, and Muon's iterations when not 5."""
        return f"muon ns_steps={self.ns_steps}" if self.name == "muon" and self.ns_steps != 5 else self.name

    @property
    def beta1(self) -> float:
        """The first-moment coefficient stage momentum raises: Muon's and SGD's ``momentum``, else ``betas[0]``."""
        return self.momentum_value if self.name in DEFAULT_MOMENTUM else self.betas[0]

    def settings(self) -> dict[str, Any]:
        """What changes this optimizer's numbers: its name and the keys it reads, resolved (lists for tuples)."""
        out: dict[str, Any] = {"name": self.name}
        for k in _KEYS[self.name]:
            v = self.momentum_value if k == "momentum" else getattr(self, k)
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    def label(self) -> str:
        """``nadam b1=0.99 psi=0.004``, ``muon mu=0.95``: the optimizer and its momentum settings, for tables."""
        if self.name == "adamw":
            return f"adamw b1={self.betas[0]:g}"
        if self.name == "nadam":
            return f"nadam b1={self.betas[0]:g} psi={self.momentum_decay:g}"
        return f"{self.name} mu={self.momentum_value:g}"
