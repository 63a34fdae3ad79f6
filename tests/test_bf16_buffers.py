"""A bf16 stage converts its parameters, not the buffers that must stay exact (pipeline.precision).

Oracles: transformers' own Llama rotary embedding in fp32 (its cos/sin at position 4095, rounded to bf16
once, as the fp32 module's output would be), and a complex buffer's imaginary part.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paci_tune.config import OptimizerConfig
from paci_tune.pipeline.stage import Stage

BF16 = torch.bfloat16


def _bf16_stage(unit: nn.Module) -> Stage:
    cfg = OptimizerConfig(lr=1e-3)
    return Stage(0, 2, [unit], window=1, optimizer=cfg, lr_at=None, device=torch.device("cpu"), dtype=BF16)


class Rotary(nn.Module):
    """A unit holding a Llama rotary embedding and a linear layer (something to train)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary, self.proj = rotary, nn.Linear(8, 8)


class Buffers(nn.Module):
    """A complex rotary table (torchtitan's ``freqs_cis``), a persistent float state and a non-persistent cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        angles = torch.outer(torch.arange(4096.0), torch.tensor([1.0, 1e-2]))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.register_buffer("stats", torch.full((4,), 1.0 / 3.0))  # state: converts like before
        self.register_buffer("cache", torch.full((4,), 1.0 / 3.0), persistent=False)


def test_a_llama_rotary_embedding_keeps_inv_freq_fp32_and_its_cos_sin_exact() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, max_position_embeddings=4096,
    )  # fmt: skip
    fp32 = LlamaRotaryEmbedding(cfg)
    stage = _bf16_stage(Rotary(copy.deepcopy(fp32)))
    rotary = stage.module[0].rotary
    assert stage.module[0].proj.weight.dtype == BF16  # the parameters are converted
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, fp32.inv_freq)
    pos = torch.arange(4096)[None]
    cos, sin = rotary(torch.zeros(1, 4096, 64, dtype=BF16), pos)
    want_cos, want_sin = fp32(torch.zeros(1, 4096, 64), pos)
    assert cos.dtype == BF16
    assert torch.equal(cos[0, 4095], want_cos[0, 4095].to(BF16)) and torch.equal(sin, want_sin.to(BF16))


def test_complex_and_cache_buffers_stay_and_state_buffers_convert() -> None:
    unit = Buffers()
    want = unit.freqs_cis.clone()
    stage = _bf16_stage(unit)
    got = stage.module[0]
    assert got.freqs_cis.dtype == torch.complex64 and torch.equal(got.freqs_cis, want)
    assert got.freqs_cis.imag.abs().max() > 0.9  # the imaginary part is all there
    assert got.cache.dtype == torch.float32 and got.stats.dtype == BF16 and got.proj.weight.dtype == BF16
    assert set(got.state_dict()) == {"proj.weight", "proj.bias", "stats"}  # what a checkpoint holds
