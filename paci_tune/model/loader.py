"""Turn the ``model:`` section of a config into pipeline units.

Two kinds of model are accepted, exactly one per config:

- ``preset: <name>`` plus overrides of any :class:`GPTConfig` field. These models are built unit
  by unit, so a pipeline rank builds only the units it owns.
- ``entry: "package.module:function"`` with optional ``kwargs`` and a required ``block_size``:
  any user model, as long as the function returns a list of ``nn.Module`` units whose first
  takes token ids (b, T) and whose last returns logits (b, T, V). The function is called under
  ``torch.manual_seed(seed)`` inside a forked RNG, so the weights are reproducible and the
  caller's RNG is untouched. Because the function builds everything at once, subsets cannot be
  built: ``indices`` is ignored (beyond a range check) and *all* units are returned. Callers
  rely on this -- ``len(units) == n_units`` is how they tell an entry model apart.

What a unit may take and return, and which parameters it may share, is checked on a sample by
:mod:`paci_tune.pipeline.checks` (it needs the data's vocabulary and the stage cut). Which units
train (:attr:`LoadedModel.trainable`: a parameter with ``requires_grad``) is read here, once, for
the whole model: a stage needs it to know whether its input needs a gradient
(:func:`input_grads`).

All bad input raises :class:`ConfigError` naming the ``model.<key>``, so the CLI can print one
line instead of a traceback. A size that cannot work on this machine (weights beyond its memory)
is bad input too. May import: torch, :mod:`.gpt`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paci_tune.base.processes import physical_memory_bytes
from paci_tune.errors import ConfigError
from paci_tune.model.gpt import (
    PRESETS,
    GPTConfig,
    GPTConfigError,
    build_units,
    num_units,
    unit_flops,
    unit_names,
)

GPT_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
PRESET_KEYS = ("preset", *GPT_KEYS)
ENTRY_KEYS = ("entry", "kwargs", "block_size")
MAX_UNITS = 100_000
"""Pipeline units of a built-in GPT: each is listed (names, FLOPs) and cut; more is not a model."""
_RETURNS = "a function returning a non-empty list of nn.Module"


@dataclass
class LoadedModel:
    """The units a rank owns plus what the partitioner and trainer need to know about the whole model.

    ``units`` holds the requested indices for presets and every unit for entry models;
    ``n_units``/``names`` always describe the full model.
    ``flops`` is forward FLOPs per token per unit, or ``None`` for entry models (unknown cost:
    partition by unit count instead). ``gpt`` is ``None`` for entry models. ``trainable[i]``: whether
    unit ``i`` has a parameter to train (every built-in GPT unit does); ``matrices[i]``: whether it has
    a 2-D one (what Muon steps, in the units between the first and the last).
    """

    units: dict[int, nn.Module]
    n_units: int
    names: list[str]
    flops: list[float] | None
    block_size: int
    gpt: GPTConfig | None
    trainable: list[bool]
    matrices: list[bool] = dataclasses.field(default_factory=list)


def trains(unit: nn.Module) -> bool:
    """Whether ``unit`` has a parameter to train (``requires_grad``); a frozen or parameter-free one does not."""
    return any(p.requires_grad for p in unit.parameters())


def trains_a_matrix(unit: nn.Module) -> bool:
    """Whether ``unit`` has a 2-D parameter to train (a weight matrix: what Muon steps)."""
    return any(p.requires_grad and p.dim() == 2 for p in unit.parameters())


def input_grads(trainable: Sequence[bool]) -> list[bool]:
    """Per unit: whether its input needs a gradient, i.e. whether a unit before it trains.

    Where none does, nothing upstream can use a gradient: the backward stops there (a frozen prefix
    runs no backward at all).
    """
    return [any(trainable[:i]) for i in range(len(trainable))]


def shared_parameters(units: Sequence[nn.Module]) -> list[tuple[list[int], list[str]]]:
    """Parameters held by more than one unit (tied weights): per parameter, the units and each one's name for it.

    One ``nn.Parameter`` object reachable from several units (an output head reusing the embedding's
    weight) is one parameter of the model; :func:`paci_tune.pipeline.checks.check_shared_parameters`
    decides whether the stage cut allows it.
    """
    holders: dict[int, tuple[list[int], list[str]]] = {}
    for i, unit in enumerate(units):
        for name, p in unit.named_parameters():
            units_of, names = holders.setdefault(id(p), ([], []))
            units_of.append(i)
            names.append(name)
    return [h for h in holders.values() if len(h[0]) > 1]


def load_model(
    spec: Mapping[str, Any], vocab_size: int, seed: int, indices: Iterable[int] | None = None
) -> LoadedModel:
    """Build the units ``indices`` (default all) of the model described by ``spec``.

    ``vocab_size`` is the data's vocabulary; preset models use it unless the spec sets its own.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError("model", spec, "a mapping with either 'preset' or 'entry'")
    has_preset, has_entry = "preset" in spec, "entry" in spec
    if has_preset == has_entry:
        given = sorted(k for k in ("preset", "entry") if k in spec)
        raise ConfigError("model", given, "exactly one of 'preset' or 'entry'")
    if has_preset:
        return _load_preset(spec, vocab_size, seed, indices)
    return _load_entry(spec, seed, indices)


def _check_keys(spec: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key, value in spec.items():
        if key not in allowed:
            raise ConfigError(f"model.{key}", value, "one of: " + ", ".join(allowed))


def _load_preset(spec: Mapping[str, Any], vocab_size: int, seed: int, indices: Iterable[int] | None) -> LoadedModel:
    _check_keys(spec, PRESET_KEYS)
    name = spec["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError("model.preset", name, "one of: " + ", ".join(PRESETS))
    overrides = {"vocab_size": vocab_size, **{k: v for k, v in spec.items() if k != "preset"}}
    try:
        cfg = dataclasses.replace(PRESETS[name], **overrides)
    except GPTConfigError as exc:
        raise ConfigError(f"model.{exc.field}", exc.value, exc.allowed) from None
    n = num_units(cfg)
    if n > MAX_UNITS:
        raise ConfigError("model.n_layer", cfg.n_layer, f"at most {MAX_UNITS - 2} (units are listed one by one)")
    wanted = _check_indices(indices, n)
    check_fits(cfg, wanted)
    return LoadedModel(
        units=build_units(cfg, seed, wanted),
        n_units=n,
        names=unit_names(cfg),
        flops=[unit_flops(cfg, i, 1) for i in range(n)],
        block_size=cfg.block_size,
        gpt=cfg,
        trainable=[True] * n,
        matrices=[True] * n,  # the embedding, every block's linear layers, the head
    )


def _unit_params(cfg: GPTConfig, i: int) -> int:
    """Parameters of unit ``i`` (to within the norms' few vectors), without building it."""
    d = cfg.d_model
    if i == 0:
        return (cfg.vocab_size + cfg.block_size) * d
    if i == num_units(cfg) - 1:
        return d * cfg.vocab_size + 2 * d
    return 12 * d * d + 4 * d


def check_fits(cfg: GPTConfig, wanted: list[int]) -> None:
    """Refuse to build units whose fp32 weights alone exceed this machine's memory: that cannot work.

    Only the units to be built count (a plan of a model bigger than this machine -- ``simulate``
    with a profile of other hardware -- builds none; a run to be trained here checks all of them
    before it starts, :mod:`paci_tune.pipeline.checks`), and only the weights: gradients, optimizer
    state and activations are the memory check's (:mod:`paci_tune.pipeline.planning`).
    """
    ram = physical_memory_bytes()
    if ram is None or not wanted:
        return
    first, last = _unit_params(cfg, 0), _unit_params(cfg, num_units(cfg) - 1)
    blocks = sum(1 for i in wanted if 0 < i < num_units(cfg) - 1)
    params = blocks * _unit_params(cfg, 1) + first * (0 in wanted) + last * (num_units(cfg) - 1 in wanted)
    if 4 * params > ram:
        raise ConfigError(
            "model",
            {k: getattr(cfg, k) for k in ("n_layer", "d_model", "vocab_size", "block_size")},
            f"a model whose weights fit in this machine's {ram / 2**30:.0f} GiB (these units need "
            f"{4 * params / 2**30:.0f} GiB in fp32)",
        )


def _check_indices(indices: Iterable[int] | None, n: int) -> list[int]:
    """Indices come from the partitioner, not the user, so a bad one is a bug: plain IndexError."""
    wanted = list(range(n)) if indices is None else sorted(set(indices))
    bad = [i for i in wanted if not 0 <= i < n]
    if bad:
        raise IndexError(f"unit indices {bad} out of range [0, {n})")
    return wanted


def _resolve_entry(entry: object) -> Callable[..., object]:
    shape = "'package.module:function' naming an importable function that returns a list of nn.Module"
    if not isinstance(entry, str) or entry.count(":") != 1:
        raise ConfigError("model.entry", entry, shape)
    module_name, attr = entry.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # other errors are bugs in the user's module: their traceback helps more
        raise ConfigError("model.entry", entry, f"{shape} (import failed: {exc!r})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("model.entry", entry, f"{shape} (module {module_name!r} has no function {attr!r})")
    return fn


def _load_entry(spec: Mapping[str, Any], seed: int, indices: Iterable[int] | None) -> LoadedModel:
    _check_keys(spec, ENTRY_KEYS)
    fn = _resolve_entry(spec["entry"])
    block_size = spec.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("model.block_size", block_size, "a positive integer (required for entry models)")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("model.kwargs", kwargs, "a mapping of keyword arguments")
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        allowed = f"arguments accepted by {spec['entry']} ({exc})"
        raise ConfigError("model.kwargs", dict(kwargs), allowed) from None
    except ValueError:
        pass  # no introspectable signature (builtins, C extensions): let the call decide
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # explicit list: no multi-GPU warning, CUDA RNG restored too
        torch.manual_seed(seed)
        built = fn(**kwargs)
    if not isinstance(built, list | tuple):
        raise ConfigError("model.entry", spec["entry"], f"{_RETURNS} (got {type(built).__name__})")
    if not built or not all(isinstance(m, nn.Module) for m in built):
        got = [type(m).__name__ for m in built]
        raise ConfigError("model.entry", spec["entry"], f"{_RETURNS} (got {got})")
    n = len(built)
    _check_indices(indices, n)
    return LoadedModel(
        units=dict(enumerate(built)),
        n_units=n,
        names=[f"unit{i}" for i in range(n)],
        flops=None,
        block_size=block_size,
        gpt=None,
        trainable=[trains(u) for u in built],
        matrices=[trains_a_matrix(u) for u in built],
    )
