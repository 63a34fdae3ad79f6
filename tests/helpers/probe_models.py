"""Small entry models for what every model must get right: causality, dropout modes, per-unit FLOPs, and
building only a rank's own units. Named in a config as ``entry: "helpers.probe_models:<function>"``
(``tests/`` on the path: :data:`helpers.guide_models.PYTHONPATH` for subprocesses).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from helpers.guide_models import Block, Embed, Head, build

BUILT_LOG = "PACI_TEST_BUILT_LOG"
"""Environment variable: a file :func:`build_own` appends what each call was asked to build to."""


class Bidirectional(Block):
    """The guide's block attending both ways (no causal mask): every position sees the future."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v)  # is_causal forgotten
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


def build_noncausal(leaky: int = 2, **kwargs: int) -> list[nn.Module]:
    """The guide's model with block ``leaky`` (its unit index) attending both ways."""
    units = build(**kwargs)
    old = units[leaky]
    assert isinstance(old, Block)
    units[leaky] = Bidirectional(old.ln1.normalized_shape[0], old.n_head)
    return units


class DropoutBlock(nn.Module):
    """A linear layer followed by heavy dropout: training and evaluation differ visibly."""

    def __init__(self, d_model: int, p: float) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(d_model, d_model), nn.Dropout(p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc(h))


def build_dropout(
    vocab_size: int = 64, d_model: int = 32, block_size: int = 32, n_layer: int = 2, p: float = 0.5
) -> list[nn.Module]:
    """Embedding, ``n_layer`` dropout blocks (p = 0.5), head: a model whose eval and train passes differ."""
    return [
        Embed(vocab_size, d_model, block_size),
        *(DropoutBlock(d_model, p) for _ in range(n_layer)),
        Head(d_model, vocab_size),
    ]


class Mlp(nn.Module):
    """A position-wise block of two linears (d -> 4d -> d): 2 * 8 * d * d forward FLOPs per token."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class LookupEmbed(nn.Module):
    """Token embedding only: a table lookup, no FLOPs whatever its size."""

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)


class LinearHead(nn.Module):
    """One linear to the vocabulary: 2 * d * V forward FLOPs per token."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h)


def build_wide_vocab(vocab_size: int = 8192, d_model: int = 32, n_layer: int = 12) -> list[nn.Module]:
    """A huge embedding and vocabulary head around equal small blocks (a Llama-vocabulary toy)."""
    return [LookupEmbed(vocab_size, d_model), *(Mlp(d_model) for _ in range(n_layer)), LinearHead(d_model, vocab_size)]


def analytic_flops(vocab_size: int, d_model: int, n_layer: int) -> list[float]:
    """Forward FLOPs per token of :func:`build_wide_vocab`'s units, 2 * in * out per linear (the oracle)."""
    block = 2.0 * (d_model * 4 * d_model + 4 * d_model * d_model)
    return [0.0, *([block] * n_layer), 2.0 * d_model * vocab_size]


def _log_built(asked: list[int] | None) -> None:
    path = os.environ.get(BUILT_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "units": asked}) + "\n")


def _unit(i: int, vocab_size: int, d_model: int, n_layer: int, n_head: int, block_size: int) -> nn.Module:
    """Unit ``i`` of the guide's model on a seed of its own: any subset comes out as the whole model's."""
    torch.manual_seed(1000 + i)
    if i == 0:
        return Embed(vocab_size, d_model, block_size)
    if i == n_layer + 1:
        return Head(d_model, vocab_size)
    return Block(d_model, n_head)


def build_own(
    vocab_size: int = 64,
    d_model: int = 32,
    n_layer: int = 4,
    n_head: int = 2,
    block_size: int = 32,
    units: list[int] | None = None,
) -> list[nn.Module] | dict[int, nn.Module]:
    """Opt-in entry: builds only ``units`` (a dict index -> unit), or every unit when ``units`` is None.

    Records what it was asked to build (:data:`BUILT_LOG`), so a test sees what each rank built.
    """
    _log_built(units)
    size = (vocab_size, d_model, n_layer, n_head, block_size)
    if units is None:
        return [_unit(i, *size) for i in range(n_layer + 2)]
    return {i: _unit(i, *size) for i in units}


def build_all(
    vocab_size: int = 64, d_model: int = 32, n_layer: int = 4, n_head: int = 2, block_size: int = 32
) -> list[nn.Module]:
    """:func:`build_own`'s model without the opt-in: every rank builds every unit."""
    return [_unit(i, vocab_size, d_model, n_layer, n_head, block_size) for i in range(n_layer + 2)]
