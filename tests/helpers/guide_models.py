"""The user models of docs/guide.md's "Your own model", as importable code: the tests train them.

Each ```python block of that section is this file's text, verbatim (tests/test_frozen.py checks it),
so what the guide shows is what the tests run: ``mymodel.py`` (:func:`build`), a frozen prefix
(:func:`build_frozen`), a unit without parameters (:func:`build_with_gelu`), a block returning a
tuple and its wrapper (:func:`build_tuple`, :func:`build_wrapped`), and a head tied to the
embedding (:func:`build_tied`). Named in a config as ``entry: "helpers.guide_models:build"``
(``tests/`` is on the path in-process; :data:`PYTHONPATH` for subprocesses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers import REPO

PYTHONPATH = str(REPO / "tests")
"""What a subprocess (the CLI, torchrun's workers) needs on its path to import this module."""

SMALL = {"vocab_size": 64, "d_model": 32, "n_layer": 4, "n_head": 2, "block_size": 32}
"""The tests' size: 6 units (embedding, 4 blocks, head) over BASE_CONFIG's 64-token synthetic data."""

# ---- docs/guide.md: mymodel.py


class Embed(nn.Module):  # unit 0: token ids (b, T) -> hidden states (b, T, d)
    def __init__(self, vocab_size, d_model, block_size):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(block_size, d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):  # a pre-norm causal transformer block: (b, T, d) -> (b, T, d)
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


class Head(nn.Module):  # last unit: hidden states -> logits (b, T, vocab)
    def __init__(self, d_model, vocab_size):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)

    def forward(self, h):
        return self.out(self.ln(h))


def build(vocab_size=256, d_model=128, n_layer=4, n_head=4, block_size=128):
    return [
        Embed(vocab_size, d_model, block_size),
        *(Block(d_model, n_head) for _ in range(n_layer)),
        Head(d_model, vocab_size),
    ]


# ---- docs/guide.md: frozen units


def build_frozen(frozen=(0, 1, 2), **kwargs):  # fine-tune the last blocks and the head
    units = build(**kwargs)
    for i in frozen:
        units[i].requires_grad_(False)  # no gradient, no optimizer state, no step
    return units


# ---- docs/guide.md: a unit without parameters


class Gelu(nn.Module):  # nothing to train: a stage of only such units takes no step
    def forward(self, h):
        return F.gelu(h)


def build_with_gelu(**kwargs):
    units = build(**kwargs)
    return [*units[:2], Gelu(), *units[2:]]


# ---- docs/guide.md: a block that returns a tuple


class TupleBlock(Block):  # HF-style: (hidden states, attention scores) -- refused as a unit
    def forward(self, h):
        return super().forward(h), h.new_zeros(h.shape[0], self.n_head, h.shape[1], h.shape[1])


class HiddenState(nn.Module):  # the unit: wraps the block and passes on its hidden state only
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h):
        return self.block(h)[0]


def build_tuple(vocab_size=256, d_model=128, n_layer=4, n_head=4, block_size=128):
    return [
        Embed(vocab_size, d_model, block_size),
        *(TupleBlock(d_model, n_head) for _ in range(n_layer)),
        Head(d_model, vocab_size),
    ]


def build_wrapped(**kwargs):
    units = build_tuple(**kwargs)
    return [units[0], *(HiddenState(b) for b in units[1:-1]), units[-1]]


# ---- docs/guide.md: an output head tied to the embedding


class TiedHead(nn.Module):  # logits from the embedding's own matrix (GPT-2 style weight tying)
    def __init__(self, embed, d_model):
        super().__init__()
        self.ln, self.tok = nn.LayerNorm(d_model), embed.tok  # the same Parameter, not a copy

    def forward(self, h):
        return self.ln(h) @ self.tok.weight.T


def build_tied(vocab_size=256, d_model=128, n_layer=4, n_head=4, block_size=128):
    embed = Embed(vocab_size, d_model, block_size)
    return [embed, *(Block(d_model, n_head) for _ in range(n_layer)), TiedHead(embed, d_model)]


# ---- not in the guide: the mutation test's broken units


class DictBlock(Block):  # returns a dict: refused
    def forward(self, h):
        return {"hidden_states": super().forward(h)}


def build_dict(**kwargs):
    units = build(**kwargs)
    return [units[0], DictBlock(kwargs.get("d_model", 128), kwargs.get("n_head", 4)), *units[2:]]
