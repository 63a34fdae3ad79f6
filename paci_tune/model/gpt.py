"""A GPT family laid out as a flat list of pipeline units.

The model is ``[Embedding, Block_0, ..., Block_{n-1}, Head]`` rather than one ``nn.Module`` so
a pipeline partitioner can cut between *any* two units and each rank builds only what it owns.

Two properties matter more here than in a single-process trainer:

- **Per-unit determinism.** Unit ``i``'s initial weights depend only on ``(seed, i)``. A rank
  that builds units 5..8 gets bit-identical weights to a process that builds the whole model,
  so the emulated and distributed runtimes start from the same point and their losses can be
  compared exactly. Units are created on the meta device and then filled from a private
  ``torch.Generator``, so the global RNG is never read or advanced.
- **No dropout.** Dropout draws from an RNG whose state would differ between runtimes that run
  the same micro-batches in a different interleaving; with none, numerics depend only on the
  order of operations. May import: torch, numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

INIT_STD = 0.02


class GPTConfigError(ValueError):
    """A GPTConfig field is invalid; carries the field name so callers can name the config key."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}: got {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``block_size`` is the (maximum) sequence length the position table covers."""

    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    vocab_size: int = 256
    bias: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "bias":
                if not isinstance(value, bool):
                    raise GPTConfigError("bias", value, "true or false")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise GPTConfigError(f.name, value, "a positive integer")
        if self.d_model % self.n_head:
            raise GPTConfigError("d_model", self.d_model, f"a multiple of n_head={self.n_head}")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128),
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, d_model=1024, block_size=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, d_model=1280, block_size=1024),
}


class Embedding(nn.Module):
    """Token plus learned position embedding: ids (b, T) long -> activations (b, T, d)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; SDPA picks the fastest kernel and needs no mask buffer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    """The 4x GELU feed-forward of GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: residual attention then residual MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the output projection: (b, T, d) -> logits (b, T, vocab).

    ``lm_head`` is deliberately *not* tied to the token embedding. The embedding lives on the
    first pipeline stage and the head on the last; tying them would need a cross-stage
    all-reduce of their gradients every step, which couples the two ends of the pipeline that
    asynchronous schedules are meant to keep independent.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def num_units(cfg: GPTConfig) -> int:
    """Embedding + blocks + head."""
    return cfg.n_layer + 2


def unit_names(cfg: GPTConfig) -> list[str]:
    """Stable human-readable names, used in logs and checkpoint keys."""
    return ["embed", *(f"block{i}" for i in range(cfg.n_layer)), "head"]


def _check_index(cfg: GPTConfig, i: int) -> None:
    if not 0 <= i < num_units(cfg):
        raise IndexError(f"unit index {i} out of range [0, {num_units(cfg)})")


def _unit_seed(seed: int, i: int) -> int:
    """A 63-bit seed that depends only on (seed, i), via numpy's well-mixed, version-stable hash."""
    words = np.random.SeedSequence([seed % 2**64, i]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def _make_unit(cfg: GPTConfig, i: int) -> nn.Module:
    if i == 0:
        return Embedding(cfg)
    if i == num_units(cfg) - 1:
        return Head(cfg)
    return Block(cfg)


@torch.no_grad()
def _init_unit(unit: nn.Module, gen: torch.Generator, resid_std: float) -> None:
    """nanoGPT init, drawn from ``gen``; fails loudly if a parameter would stay uninitialised."""
    done: set[int] = set()
    residual = {id(m.proj) for m in unit.modules() if isinstance(m, CausalSelfAttention | MLP)}
    for m in unit.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            std = resid_std if id(m) in residual else INIT_STD
            nn.init.normal_(m.weight, mean=0.0, std=std, generator=gen)
            done.add(id(m.weight))
        elif isinstance(m, nn.LayerNorm) and m.weight is not None:
            nn.init.ones_(m.weight)
            done.add(id(m.weight))
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.Tensor):
            nn.init.zeros_(bias)
            done.add(id(bias))
    missed = [name for name, p in unit.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"parameters left uninitialised: {missed}")


def build_units(cfg: GPTConfig, seed: int, indices: Iterable[int] | None = None) -> dict[int, nn.Module]:
    """Build units ``indices`` (default: all) on CPU, each a pure function of ``(seed, i)``.

    Modules are created on the meta device (no default init, no RNG use, no wasted memory) and
    then materialised and filled from a generator seeded by ``(seed, i)``; the global RNG state
    is untouched. Move the result to the accelerator afterwards: initialising on CPU keeps the
    bits independent of the device type.
    """
    wanted = range(num_units(cfg)) if indices is None else sorted(set(indices))
    resid_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    units: dict[int, nn.Module] = {}
    for i in wanted:
        _check_index(cfg, i)
        with torch.device("meta"):
            unit = _make_unit(cfg, i)
        unit = unit.to_empty(device="cpu")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_unit_seed(seed, i))
        _init_unit(unit, gen, resid_std)
        units[i] = unit
    return units


def _block_matmul_params(cfg: GPTConfig) -> int:
    return 12 * cfg.d_model * cfg.d_model


def unit_flops(cfg: GPTConfig, i: int, tokens: int) -> float:
    """Forward FLOPs of unit ``i`` for ``tokens`` tokens; only used to balance pipeline stages.

    Matmuls cost 2 * weights per token. Attention adds QK^T and AV, 2 * 2 * T * d per token
    (counted as full, not causal-halved, like the PaLM MFU convention). The embedding is a
    lookup plus an add, about d per token. LayerNorms and GELU are ignored.
    """
    _check_index(cfg, i)
    d = cfg.d_model
    if i == 0:
        return float(tokens * d)
    if i == num_units(cfg) - 1:
        return float(2 * cfg.vocab_size * d * tokens)
    return float((2 * _block_matmul_params(cfg) + 4 * cfg.block_size * d) * tokens)


def model_flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token, PaLM style: 6N + 12 L T d, for MFU.

    N counts matmul weights only (blocks plus the untied lm_head); embedding lookups cost no
    matmul FLOPs, so they are left out, as in the PaLM appendix.
    """
    n = cfg.n_layer * _block_matmul_params(cfg) + cfg.vocab_size * cfg.d_model
    return float(6 * n + 12 * cfg.n_layer * cfg.block_size * cfg.d_model)
