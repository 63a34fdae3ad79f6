"""Model units: per-unit determinism, shapes, causality, preset sizes and the loader's errors."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from paci_tune.errors import ConfigError
from paci_tune.model import PRESETS, GPTConfig, build_units, load_model, model_flops_per_token
from paci_tune.model.gpt import Block, Embedding, Head, num_units, unit_flops, unit_names

TINY = PRESETS["tiny"]


def _chain(units: dict[int, nn.Module], x: torch.Tensor) -> torch.Tensor:
    for i in sorted(units):
        x = units[i](x)
    return x


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_subset_build_is_bit_identical_to_full_build() -> None:
    full = build_units(TINY, seed=7)
    assert sorted(full) == list(range(num_units(TINY)))
    for subset in ([0], [2, 4], [num_units(TINY) - 1], [3, 1]):
        part = build_units(TINY, seed=7, indices=subset)
        assert sorted(part) == sorted(subset)
        for i, unit in part.items():
            assert _same_weights(unit, full[i])


def test_weights_depend_on_seed_and_unit_index() -> None:
    a, b = build_units(TINY, seed=0, indices=[1, 2]), build_units(TINY, seed=1, indices=[1])
    assert not _same_weights(a[1], b[1])
    assert not _same_weights(a[1], a[2])


def test_build_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    build_units(TINY, seed=3)
    assert torch.equal(torch.rand(5), expected)


def test_init_statistics_follow_nanogpt() -> None:
    cfg = dataclasses.replace(TINY, n_layer=8, d_model=256, bias=True)
    block = build_units(cfg, seed=0, indices=[1])[1]
    assert isinstance(block, Block)
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 0.02/sqrt(2*8)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.count_nonzero(block.attn.qkv.bias) == 0
    assert torch.equal(block.ln1.weight, torch.ones(256))


def test_forward_shapes_through_chained_units() -> None:
    cfg = dataclasses.replace(TINY, n_layer=2, vocab_size=97)
    units = build_units(cfg, seed=0)
    assert [type(units[i]) for i in sorted(units)] == [Embedding, Block, Block, Head]
    assert unit_names(cfg) == ["embed", "block0", "block1", "head"]
    x = torch.randint(0, 97, (3, 50))
    h = units[0](x)
    assert h.shape == (3, 50, cfg.d_model) and h.dtype == torch.float32
    assert _chain(units, x).shape == (3, 50, 97)
    with pytest.raises(ValueError, match="block_size"):
        units[0](torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    units = build_units(dataclasses.replace(TINY, n_layer=2), seed=0)
    x = torch.randint(0, 256, (2, 32))
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = _chain(units, x), _chain(units, x2)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def _analytic_params(cfg: GPTConfig) -> int:
    """Written independently of the model code: GPT-2 layout, untied head, no biases."""
    d, v, t, n = cfg.d_model, cfg.vocab_size, cfg.block_size, cfg.n_layer
    per_block = 4 * d * d + 8 * d * d + 2 * d  # qkv + out-proj, fc + proj, two LayerNorm weights
    return v * d + t * d + n * per_block + d + d * v  # embeddings, blocks, ln_f, lm_head


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts_match_formula(name: str) -> None:
    cfg = dataclasses.replace(PRESETS[name], vocab_size=50257)
    with torch.device("meta"):  # counts shapes without allocating hundreds of MB
        units = [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg)]
    assert sum(p.numel() for u in units for p in u.parameters()) == _analytic_params(cfg)


def test_preset_shapes() -> None:
    shapes = {name: (c.n_layer, c.n_head, c.d_model, c.block_size, c.vocab_size) for name, c in PRESETS.items()}
    assert shapes == {
        "tiny": (4, 4, 128, 128, 256),
        "gpt2-small": (12, 12, 768, 1024, 256),
        "gpt2-medium": (24, 16, 1024, 1024, 256),
        "gpt2-large": (36, 20, 1280, 1024, 256),
    }
    medium = dataclasses.replace(PRESETS["gpt2-medium"], vocab_size=50257)
    total = _analytic_params(medium)
    tied_equivalent = total - medium.vocab_size * medium.d_model  # the usual "GPT-2 medium 350M"
    assert 345e6 < tied_equivalent < 360e6


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="d_model"):
        GPTConfig(n_layer=2, n_head=3, d_model=128, block_size=16)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0, n_head=4, d_model=128, block_size=16)
    with pytest.raises(ValueError, match="bias"):
        GPTConfig(n_layer=1, n_head=4, d_model=128, block_size=16, bias=1)  # type: ignore[arg-type]


def test_flops_estimates_are_consistent() -> None:
    cfg = PRESETS["gpt2-small"]
    forward = sum(unit_flops(cfg, i, 1) for i in range(num_units(cfg)))
    assert 3 * forward == pytest.approx(model_flops_per_token(cfg), rel=1e-3)
    assert unit_flops(cfg, 1, 10) == 10 * unit_flops(cfg, 1, 1)
    assert unit_flops(cfg, 0, 1) < unit_flops(cfg, 1, 1)


def test_load_preset_with_overrides_and_subset() -> None:
    spec = {"preset": "tiny", "n_layer": 2, "d_model": 64}
    loaded = load_model(spec, vocab_size=100, seed=5, indices=[1, 2])
    assert loaded.gpt is not None and loaded.gpt.vocab_size == 100 and loaded.gpt.d_model == 64
    assert (loaded.n_units, loaded.block_size, sorted(loaded.units)) == (4, 128, [1, 2])
    assert loaded.names == ["embed", "block0", "block1", "head"]
    assert loaded.flops is not None and len(loaded.flops) == 4
    full = load_model({**spec, "vocab_size": 300}, vocab_size=100, seed=5)
    assert full.gpt is not None and full.gpt.vocab_size == 300
    assert _same_weights(full.units[1], loaded.units[1])


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"preset": "huge"}, "model.preset"),
        ({"preset": "tiny", "n_layers": 2}, "model.n_layers"),
        ({"preset": "tiny", "n_head": 5}, "model.d_model"),
        ({"preset": "tiny", "n_layer": -1}, "model.n_layer"),
        ({"preset": "tiny", "entry": "a:b"}, "model"),
        ({}, "model"),
        ({"entry": "no_such_module_xyz:f", "block_size": 8}, "model.entry"),
        ({"entry": "no_colon", "block_size": 8}, "model.entry"),
        ({"entry": "math:no_such_fn", "block_size": 8}, "model.entry"),
    ],
)
def test_model_spec_errors_name_the_key(spec: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_model(spec, vocab_size=256, seed=0)
    assert info.value.key == key


ENTRY_MODULE = """
    import torch
    from torch import nn

    class Tail(nn.Module):
        def __init__(self, width, vocab):
            super().__init__()
            self.proj = nn.Linear(width, vocab)

        def forward(self, x):
            return self.proj(torch.tanh(x))

    def build(width=8, vocab=11):
        return [nn.Embedding(vocab, width), nn.Linear(width, width), Tail(width, vocab)]

    def not_a_list():
        return nn.Linear(2, 2)

    def list_of_junk():
        return [nn.Linear(2, 2), "junk"]
"""


@pytest.fixture
def entry_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "paci_test_entry_model"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(ENTRY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_entry_model_loads_deterministically(entry_module: str) -> None:
    spec = {"entry": f"{entry_module}:build", "kwargs": {"width": 6}, "block_size": 16}
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a = load_model(spec, vocab_size=11, seed=4)
    assert torch.equal(torch.rand(3), expected)  # global RNG untouched
    b = load_model(spec, vocab_size=11, seed=4, indices=[])
    assert (a.n_units, a.block_size, a.flops, a.gpt) == (3, 16, None, None)
    assert a.names == ["unit0", "unit1", "unit2"] and sorted(b.units) == [0, 1, 2]  # always all units
    assert _same_weights(a.units[2], b.units[2])
    assert not _same_weights(a.units[2], load_model(spec, vocab_size=11, seed=5).units[2])
    assert _chain(a.units, torch.randint(0, 11, (2, 16))).shape == (2, 16, 11)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"entry": "{m}:not_a_list"}, "model.entry"),
        ({"entry": "{m}:list_of_junk"}, "model.entry"),
        ({"block_size": None}, "model.block_size"),
        ({"kwargs": {"depth": 3}}, "model.kwargs"),
        ({"kwargs": [1]}, "model.kwargs"),
        ({"n_layer": 3}, "model.n_layer"),
    ],
)
def test_entry_errors_name_the_key(entry_module: str, extra: dict[str, object], key: str) -> None:
    spec: dict[str, object] = {"entry": f"{entry_module}:build", "block_size": 16}
    spec.update({k: v.format(m=entry_module) if isinstance(v, str) else v for k, v in extra.items()})
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        load_model(spec, vocab_size=11, seed=0)
    assert info.value.key == key
