"""Building a rank's own units of a transformers model: a skeleton on the meta device, only the wanted units made real.

The whole model is built on the meta device (no memory), split (:mod:`.hf_split`), and only the units a
rank owns get real tensors. Their weights do not depend on the depth or on which units are built:
each module is initialised by the model's own ``_init_weights`` under a seed of its own, derived from
the run's seed, its unit and its path in the unit (children before parents, as ``nn.Module.apply``
goes, so a block's scaled re-initialisation of its projections still wins). A parameter shared by
several units (GPT-2's output head is its embedding) is made real once per process and initialised
as its first holder's module initialises it, so every holder starts equal wherever it is built.
Weights from a folder are read tensor by tensor with safetensors' lazy ``safe_open``, as fp32. May
import: torch, transformers, safetensors, the model layer's modules, :mod:`paci_tune.errors`,
:mod:`paci_tune.base`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..base.processes import physical_memory_bytes
from ..errors import ConfigError
from .hf_split import Split, SplitError, split_model
from .loader import MAX_UNITS, LoadedModel, Tie, shared_parameters
from .untie import untie_units

KEY = "model.hf"


def skeleton(config: Any, where: object) -> nn.Module:
    """The whole model on the meta device, on SDPA attention where the architecture has it (else eager)."""
    from transformers import AutoModelForCausalLM

    def make(impl: str) -> nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation=impl)

    try:
        try:
            model = make("sdpa")
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc):
                raise
            model = make("eager")  # e.g. Gemma 2: no SDPA in transformers; the equality check decides
    except (ValueError, TypeError, KeyError) as exc:
        first = next(iter(str(exc).splitlines()), "")
        raise ConfigError(KEY, where, f"a causal LM transformers builds from its config ({first})") from None
    return model


def unit_seed(seed: int, unit: int, path: str) -> int:
    """A 63-bit seed of (run seed, unit, module path): numpy's version-stable hash."""
    words = [seed % 2**64, unit, *path.encode()]
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def _materialise(module: nn.Module, memo: dict[int, nn.Parameter]) -> None:
    """Real (uninitialised, CPU) tensors for ``module``'s meta parameters and buffers; one per shared parameter."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
                m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def _init(model: nn.Module, unit: nn.Module, u: int, seed: int, only: str | None = None) -> None:
    """Initialise ``unit``'s modules (or the one at path ``only``) with the model's ``_init_weights``, each seeded."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for path, m in _post_order(unit):
            if only is not None and path != only:
                continue
            torch.manual_seed(unit_seed(seed, u, path))
            model._init_weights(m)


def _ties(units: list[nn.Module]) -> list[Tie]:
    out = []
    for us, names in shared_parameters(units):
        p = units[us[0]].get_parameter(names[0])
        out.append(Tie(us, names, p.requires_grad, p.numel()))
    return out


def _renamer(model: nn.Module, where: object) -> Any:
    """How a file's key becomes the model's name: transformers' own renamings for the architecture (a file
    saved in an original format, e.g. GPT-NeoX's ``embed_out``); a weight needing a conversion is refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversions: names are the model's
        return lambda key: key
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        new, converted = rename_source_key(key, renamings, converters)
        if converted is not None:
            raise ConfigError(KEY, where, f"weights stored as the model's parameters ({key} needs a conversion)")
        return new

    return rename


class _Weights:
    """A folder's safetensors weights, opened lazily: one tensor read at a time, by the model's name for it."""

    def __init__(self, folder: Path, model: nn.Module, where: object) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        rename = _renamer(model, where)
        self.handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self.where: dict[str, tuple[Any, str]] = {
            rename(k): (h, k)
            for h in self.handles
            for k in h.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
        }
        self.prefix, self.spec = model.base_model_prefix, where

    def read(self, names: list[str], shape: torch.Size) -> torch.Tensor:
        for name in names:
            for key in (name, name.removeprefix(self.prefix + ".")):
                if key in self.where:
                    handle, stored = self.where[key]
                    t = handle.get_tensor(stored)
                    if tuple(t.shape) != tuple(shape):
                        raise ConfigError(KEY, self.spec, f"weights of the config's shapes ({key}: {tuple(t.shape)})")
                    return t.float()
        raise ConfigError(KEY, self.spec, f"safetensors weights for every parameter (none for {names[0]})")


def _load(model: nn.Module, units: dict[int, nn.Module], folder: Path, where: object) -> None:
    """Fill the built units' parameters from the folder's safetensors, each by the model's name(s) for it."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    weights = _Weights(folder, model, where)
    done: set[int] = set()
    with torch.no_grad():
        for unit in units.values():
            for p in unit.parameters():
                if id(p) not in done and id(p) in names:
                    p.copy_(weights.read(names[id(p)], p.shape))
                    done.add(id(p))


def _flops(units: list[nn.Module], block: int, hidden: int) -> list[float]:
    """Forward FLOPs per token per unit (to balance a cut without a profile): 2 x matrix weights, plus
    attention's 4 T d for a block and about d for the embedding lookup, as :func:`.gpt.unit_flops` counts."""
    out = []
    for i, unit in enumerate(units):
        mats = sum(
            p.numel()
            for m in unit.modules()
            if not isinstance(m, nn.Embedding)
            for p in m._parameters.values()
            if p is not None and p.dim() == 2
        )
        if i == 0:
            out.append(float(hidden))
        elif i == len(units) - 1:
            out.append(float(2 * mats))
        else:
            out.append(float(2 * mats + 4 * block * hidden))
    return out


def _check_fits(units: list[nn.Module], wanted: list[int], where: object) -> None:
    """Refuse to build units whose fp32 weights alone exceed this machine's memory (as presets are refused)."""
    ram = physical_memory_bytes()
    seen: set[int] = set()
    params = 0
    for i in wanted:
        for p in units[i].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel()
    if ram is not None and 4 * params > ram:
        need = 4 * params / 2**30
        raise ConfigError(
            KEY, where, f"a model whose weights fit this machine's {ram / 2**30:.0f} GiB ({need:.0f} GiB)"
        )


def build(
    config: Any, seed: int, indices: list[int] | None, folder: Path | None, untie: bool, block: int, where: object
) -> tuple[LoadedModel, Any]:
    """The :class:`LoadedModel` of units ``indices`` (None: all), as the module docstring describes, and the
    transformers model whose modules they are (meta but for those units)."""
    model, split, ties = build_model(config, seed, indices, folder, where)
    n = len(split.units)
    wanted = list(range(n)) if indices is None else sorted({i for i in indices if 0 <= i < n})
    units = {i: split.units[i] for i in wanted}
    untied = untie_units(units, ties) if untie else None
    loaded = LoadedModel(
        units=units,
        n_units=n,
        names=split.names,
        flops=_flops(split.units, block, int(getattr(config, "hidden_size", 0) or 0)),
        block_size=block,
        gpt=None,
        trainable=[any(p.requires_grad for p in u.parameters()) for u in split.units],
        matrices=[any(p.requires_grad and p.dim() == 2 for p in u.parameters()) for u in split.units],
        ties=[] if untie else ties,
        untied=untied,
    )
    return loaded, model


def build_model(
    config: Any, seed: int, indices: list[int] | None, folder: Path | None, where: object
) -> tuple[Any, Split, list[Tie]]:
    """The model (meta except the units ``indices``, None: all), its split and the parameters its units share;
    those units initialised, or loaded from ``folder``."""
    model = skeleton(config, where)
    try:
        split = split_model(model)
    except SplitError as exc:
        arch = type(model).__name__
        raise ConfigError(KEY, where, f"a model this tool can cut into units ({arch}: it needs {exc})") from None
    n = len(split.units)
    if n > MAX_UNITS:
        raise ConfigError(KEY, where, f"at most {MAX_UNITS - 2} layers")
    wanted = list(range(n)) if indices is None else sorted({i for i in indices if 0 <= i < n})
    _check_fits(split.units, wanted, where)
    ties = _ties(split.units)  # on the skeleton, before a holder's copy is made real and others still meta
    memo: dict[int, nn.Parameter] = {}
    for i in wanted:
        _materialise(split.units[i], memo)
        _init(model, split.units[i], i, seed)
    # A shared parameter ends as its first holder's module makes it, whichever holders are built here.
    for tie in ties:
        if any(u in wanted for u in tie.units):
            first, name = tie.units[0], tie.names[0]
            path = name.rpartition(".")[0]
            _materialise(split.units[first].get_submodule(path), memo)
            _init(model, split.units[first], first, seed, only=path)
    if folder is not None:
        _load(model, {i: split.units[i] for i in wanted}, folder, where)
    return model, split, ties
