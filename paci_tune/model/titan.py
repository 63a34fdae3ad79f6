"""``model: {torchtitan: llama3, ...}``: torchtitan 0.3.0's Llama 3 as pipeline units.

The spec: ``torchtitan: llama3`` (the one model wired here), ``flavor`` (a key of torchtitan's
``llama3_configs``, default ``debugmodel``), ``block_size`` (default :data:`DEFAULT_BLOCK`),
``vocab_size`` (default the data's; at least the data's), ``n_layers`` (the flavor's first n layers).

The units are ``[embedding, layer 0, ..., layer n-1, norm + output]``; each keeps torchtitan's own
parameter names (``tok_embeddings.weight``, ``layers.3.attention...``, ``lm_head.weight``), so the
units' state dicts together load into torchtitan's ``Llama3Model``. Two changes to the flavor, both
because a pipeline unit passes one tensor: attention is torchtitan's ``ScaledDotProductAttention``
(causal), not its flex default, which needs a ``BlockMask`` per forward and has no backward on CPU
(``NotImplementedError: FlexAttention does not support backward on CPU``); and each layer's rotary
table (``ComplexRoPE.cache``, torchtitan's ``freqs_cis``: complex64, non-persistent) holds
``block_size`` positions, as torchtitan's own trainer sizes it to ``training.seq_len``, not 131072.

Like a preset, a rank builds only its own units: on the meta device, then made real and filled by
torchtitan's own ``init_states`` under a seed of (run seed, unit), so a unit's weights do not
depend on the depth or on which units a process builds. ``verify`` (run by
:mod:`paci_tune.pipeline.checks` before any run) builds the whole ``Llama3Model`` over the units'
tensors and refuses, naming ``model.torchtitan``, unless the chained units give its logits to
:data:`TOLERANCE`. Flavors that tie the embedding to the output (1B, 3B) are refused, as torchtitan
refuses them under pipeline parallelism. May import: torch, numpy, torchtitan, the model layer's
modules, :mod:`paci_tune.errors`, :mod:`paci_tune.base`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import numpy as np
import torch
from torch import nn

from ..base.processes import physical_memory_bytes
from ..errors import ConfigError
from .loader import MAX_UNITS, LoadedModel, _check_indices, _check_keys

KEY = "model.torchtitan"
TITAN_KEYS = ("torchtitan", "flavor", "block_size", "vocab_size", "n_layers")
VERSION = "0.3.0"
MODELS = ("llama3",)
DEFAULT_FLAVOR = "debugmodel"
DEFAULT_BLOCK = 1024
TOLERANCE = 1e-5
INSTALL = (
    f"pip install torchtitan=={VERSION} triton (the extra paci-tune[torchtitan]; torchtitan {VERSION} "
    "imports triton, which torch's CPU build does not bring)"
)


def _titan(value: object) -> Any:
    """torchtitan's llama3 package, or the one-line refusal saying how to get it."""
    try:
        found = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise ConfigError(KEY, value, f"{INSTALL}: torchtitan is not installed") from None
    if found != VERSION:
        raise ConfigError(KEY, value, f"torchtitan {VERSION} (found {found}; its model API changes between releases)")
    try:
        import torchtitan.models.llama3 as llama3
    except ImportError as exc:
        raise ConfigError(KEY, value, f"{INSTALL}: import failed: {exc}") from None
    return llama3


def _int(spec: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"model.{key}", value, f"an integer in {low}..{high}")
    return value


def titan_config(spec: Mapping[str, Any], vocab_size: int) -> Any:
    """The ``Llama3Model.Config`` the spec names: the flavor, SDPA attention, its overrides (module docstring)."""
    _check_keys(spec, TITAN_KEYS)
    if spec["torchtitan"] not in MODELS:
        raise ConfigError(KEY, spec["torchtitan"], "one of: " + ", ".join(MODELS))
    llama3 = _titan(spec["torchtitan"])
    from torchtitan.models.common.attention import ScaledDotProductAttention

    flavor = spec.get("flavor", DEFAULT_FLAVOR)
    if not isinstance(flavor, str) or flavor not in llama3.llama3_configs:
        raise ConfigError("model.flavor", flavor, "one of: " + ", ".join(llama3.llama3_configs))
    cfg = llama3.llama3_configs[flavor](attn_backend="flex")
    if cfg.enable_weight_tying:
        untied = [f for f in llama3.llama3_configs if not llama3.llama3_configs[f]("flex").enable_weight_tying]
        why = "its embedding is tied to its output, which torchtitan refuses under pipeline parallelism"
        raise ConfigError("model.flavor", flavor, f"one of: {', '.join(untied)} ({flavor}: {why})")
    n_layers = _int(spec, "n_layers", len(cfg.layers), 1, min(len(cfg.layers), MAX_UNITS - 2))
    longest = cfg.max_seq_len
    block = _int(spec, "block_size", min(DEFAULT_BLOCK, longest), 1, longest)
    vocab = _int(spec, "vocab_size", vocab_size, vocab_size, 2**31 - 1)
    layers = [
        dataclasses.replace(
            layer,
            attention=dataclasses.replace(
                layer.attention,
                inner_attention=ScaledDotProductAttention.Config(),
                rope=dataclasses.replace(layer.attention.rope, max_seq_len=block),
            ),
        )
        for layer in cfg.layers[:n_layers]
    ]
    return dataclasses.replace(
        cfg,
        vocab_size=vocab,
        tok_embeddings=dataclasses.replace(cfg.tok_embeddings, num_embeddings=vocab),
        lm_head=dataclasses.replace(cfg.lm_head, out_features=vocab),
        layers=layers,
    )


def _rope_tables(module: nn.Module) -> None:
    """Recompute every rotary table in ``module`` (complex64, on its device) from its config."""
    from torchtitan.models.common.rope import RoPE

    for m in module.modules():
        if isinstance(m, RoPE):
            m._init_self_buffers(buffer_device=m.cache.device)


class TitanEmbedding(nn.Module):
    """Unit 0: token ids ``(b, T)`` to hidden states, torchtitan's ``tok_embeddings``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.tok_embeddings = cfg.tok_embeddings.build()

    def parts(self) -> list[nn.Module]:
        return [self.tok_embeddings]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class TitanLayer(nn.Module):
    """One ``Llama3TransformerBlock``, held as ``layers.<i>`` (torchtitan's names), causal, on one tensor.

    The rotary table is a function of the config, not state: every move or cast (``.to``, ``to_empty``,
    a bf16 conversion that would drop its imaginary part) recomputes it in complex64 where it lands.
    """

    def __init__(self, cfg: Any, i: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): cfg.layers[i].build()})

    def parts(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, None, None)  # no masks: SDPA's is_causal; no positions: 0..T-1
        return h

    def _apply(self, fn: Any, recurse: bool = True) -> TitanLayer:
        with warnings.catch_warnings():  # a cast to a real dtype drops the table's imaginary part: recomputed below
            warnings.filterwarnings("ignore", "Casting complex values to real")
            super()._apply(fn, recurse)
        _rope_tables(self)
        return self


class TitanHead(nn.Module):
    """The last unit: torchtitan's final ``norm`` and ``lm_head``, hidden states to logits ``(b, T, V)``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm = cfg.norm.build()
        self.lm_head = cfg.lm_head.build()

    def parts(self) -> list[nn.Module]:
        return [self.norm, self.lm_head]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def _make(cfg: Any, i: int) -> TitanEmbedding | TitanLayer | TitanHead:
    if i == 0:
        return TitanEmbedding(cfg)
    if i == len(cfg.layers) + 1:
        return TitanHead(cfg)
    return TitanLayer(cfg, i - 1)


def unit_seed(seed: int, i: int) -> int:
    """A 63-bit seed of (run seed, unit): numpy's version-stable hash, as the built-in GPT's units use."""
    words = np.random.SeedSequence([seed % 2**64, i]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def build_unit(cfg: Any, i: int, seed: int) -> nn.Module:
    """Unit ``i``, real on CPU, initialised by torchtitan's ``init_states`` under :func:`unit_seed` only."""
    with torch.device("meta"):
        unit = _make(cfg, i)
    unit.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(unit_seed(seed, i))
        for part in unit.parts():
            part.init_states(buffer_device=torch.device("cpu"))
    return unit


def _sizes(cfg: Any) -> tuple[list[int], list[float]]:
    """Per unit: parameters, and forward FLOPs per token (2 x matrix weights, plus attention's 4 T d per layer)."""
    n = len(cfg.layers) + 2
    with torch.device("meta"):
        shapes = [_make(cfg, i) for i in (0, 1, n - 1)]
    params = [sum(p.numel() for p in u.parameters()) for u in shapes]
    mats = [sum(p.numel() for p in u.parameters() if p.dim() == 2) for u in shapes]
    block = cfg.layers[0].attention.rope.max_seq_len
    flops = [float(cfg.dim), *[2.0 * mats[1] + 4.0 * block * cfg.dim] * (n - 2), 2.0 * mats[2]]
    return [params[0], *[params[1]] * (n - 2), params[2]], flops


def load_torchtitan(spec: Mapping[str, Any], vocab_size: int, seed: int, indices: Iterable[int] | None) -> LoadedModel:
    """The units ``indices`` (default all) of the torchtitan model ``spec`` names (module docstring)."""
    cfg = titan_config(spec, vocab_size)
    n = len(cfg.layers) + 2
    wanted = _check_indices(indices, n)
    params, flops = _sizes(cfg)
    ram = physical_memory_bytes()
    need = 4 * sum(params[i] for i in wanted)
    if ram is not None and need > ram:
        got = spec["torchtitan"]
        raise ConfigError(
            KEY, got, f"a model whose weights fit this machine's {ram / 2**30:.0f} GiB ({need / 2**30:.0f} GiB)"
        )
    return LoadedModel(
        units={i: build_unit(cfg, i, seed) for i in wanted},
        n_units=n,
        names=["embed", *(f"layer{i}" for i in range(n - 2)), "head"],
        flops=flops,
        block_size=cfg.layers[0].attention.rope.max_seq_len,
        gpt=None,
        trainable=[True] * n,
        matrices=[True] * n,  # the embedding table, every layer's projections, the output
        ties=[],  # tied flavors are refused (titan_config)
        verify=lambda: verify_split(cfg, seed, spec["torchtitan"]),
    )


def whole_model(cfg: Any, units: list[nn.Module]) -> nn.Module:
    """torchtitan's own ``Llama3Model`` of ``cfg`` over the units' tensors (shared, not copied)."""
    with torch.device("meta"):
        model = cfg.build()
    state: dict[str, torch.Tensor] = {}
    for unit in units:
        state.update(unit.state_dict(keep_vars=True))
    model.load_state_dict(state, strict=True, assign=True)
    for m in model.modules():  # the rotary tables are not state: computed where the weights are
        if getattr(m, "cache", None) is not None and m.cache.is_meta:
            m._init_self_buffers(buffer_device=torch.device("cpu"))
    return model


@torch.no_grad()
def verify_split(cfg: Any, seed: int, where: object) -> None:
    """Refuse unless the chained units equal torchtitan's ``Llama3Model`` forward to :data:`TOLERANCE`."""
    units = [build_unit(cfg, i, seed) for i in range(len(cfg.layers) + 2)]
    gen = torch.Generator().manual_seed(0)
    t = min(cfg.layers[0].attention.rope.max_seq_len, 128)
    x = torch.randint(0, cfg.vocab_size, (2, t), generator=gen)
    try:
        want = whole_model(cfg, units)(x)
        got = x
        for unit in units:
            got = unit(got)
    except Exception as exc:  # torchtitan's model under this split: say what broke, as configuration
        why = f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"
        raise ConfigError(KEY, where, f"a model whose units run ({why})") from None
    diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
    if not diff <= TOLERANCE:
        raise ConfigError(
            KEY, where, f"units whose chained forward equals Llama3Model's (they differ by {diff:.3g} > {TOLERANCE})"
        )
