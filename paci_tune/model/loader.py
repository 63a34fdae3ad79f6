"""Turn the ``model:`` section of a config into pipeline units.

Four sources of a model (:data:`SOURCES`), exactly one per config; the first two are here, the
others in :mod:`.hf` and :mod:`.titan`:

- ``preset: <name>`` plus overrides of any :class:`GPTConfig` field. These models are built unit
  by unit, so a pipeline rank builds only the units it owns.
- ``entry: "package.module:function"`` with optional ``kwargs`` and a required ``block_size``:
  any user model, as long as the function returns a list of ``nn.Module`` units whose first
  takes token ids (b, T) and whose last returns logits (b, T, V). The function is called under
  ``torch.manual_seed(seed)`` inside a forked RNG, so the weights are reproducible and the
  caller's RNG is untouched. A function builds every unit, so ``indices`` is ignored (beyond a
  range check) and *all* units are returned: every rank of a distributed run holds the whole model.
  **Opt-in:** a function that takes a keyword ``units`` is called ``units=None`` for the whole model
  and, where the caller passes the model's checked facts (``whole``: a rank building its stages,
  :func:`paci_tune.pipeline.factory.build_setup`), ``units=[i, ...]`` for those units alone, which it
  returns as a list in that order or a dict index -> module. Each unit must come out as the whole
  build's (seed it by its index, not by the call's RNG): a rank's units and the launcher's check
  must be the same model. Loads without ``whole`` (the checks, calibration) still get every unit.

``hf: ...`` is a transformers causal LM (:mod:`.hf`) and ``torchtitan: llama3`` torchtitan's Llama
(:mod:`.titan`), both built per rank like a preset. ``untie: true``
(entry and hf models) gives every parameter several units share a copy per unit (:mod:`.untie`), at
build time, so every schedule trains the same untied model.

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
SOURCES = ("preset", "entry", "hf", "torchtitan")
"""Where a model comes from, exactly one per config: a built-in GPT, a user function, transformers, torchtitan."""
MAX_UNITS = 100_000
"""Pipeline units of a built-in GPT: each is listed (names, FLOPs) and cut; more is not a model."""
_RETURNS = "a function returning a non-empty list of nn.Module"


@dataclass
class LoadedModel:
    """The units a rank owns plus what the partitioner and trainer need to know about the whole model.

    ``units`` holds the requested indices for presets and every unit for entry models (a rank's own for
    one that builds only its own units, loaded with ``whole``);
    ``n_units``/``names`` always describe the full model.
    ``flops`` is forward FLOPs per token per unit: the built-in GPT's formula; ``None`` for other models
    until :func:`paci_tune.pipeline.checks.check_units` counts them on a sample (what a cut without a
    profile balances). ``gpt`` is ``None`` for entry models. ``trainable[i]``: whether
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
    ties: list[Tie] | None = None
    """Parameters units share, where known without the units (a model built per rank); None: read the units."""
    untied: str | None = None
    """What ``model.untie`` did: "untie: +N parameters (...)", stated in a run's opening line and best.yaml."""
    verify: Callable[[], None] | None = None
    """A check of the model's own, run before any run (:func:`paci_tune.pipeline.checks.check_model_and_data`)."""


@dataclass(frozen=True)
class Tie:
    """One parameter held by several units: the units, each one's name for it, whether it trains, its elements."""

    units: list[int]
    names: list[str]
    trainable: bool
    numel: int


def model_ties(meta: LoadedModel) -> list[Tie]:
    """The parameters units of ``meta`` share: its ``ties`` where given, else read from its units (all of them:
    a user entry model always holds every unit); the built-in GPT ties nothing."""
    if meta.ties is not None:
        return meta.ties
    if meta.gpt is not None:
        return []
    out = []
    for units, names in shared_parameters([meta.units[i] for i in range(meta.n_units)]):
        p = meta.units[units[0]].get_parameter(names[0])
        out.append(Tie(units, names, p.requires_grad, p.numel()))
    return out


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
    spec: Mapping[str, Any],
    vocab_size: int,
    seed: int,
    indices: Iterable[int] | None = None,
    *,
    whole: LoadedModel | None = None,
) -> LoadedModel:
    """Build the units ``indices`` (default all) of the model described by ``spec``.

    ``vocab_size`` is the data's vocabulary; preset models use it unless the spec sets its own.
    ``whole``: the same model loaded whole before (a run's checked metadata). Given it, an entry function
    that builds only the units asked for (keyword ``units``) is asked for ``indices`` alone
    (:func:`_load_entry`); without it, entry functions build every unit.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError("model", spec, "a mapping with one of: " + ", ".join(SOURCES))
    given = [k for k in SOURCES if k in spec]
    if len(given) != 1:
        raise ConfigError("model", given, "exactly one of: " + ", ".join(SOURCES))
    if given[0] == "preset":
        return _load_preset(spec, vocab_size, seed, indices)
    if given[0] == "entry":
        return _load_entry(spec, seed, indices, whole)
    if given[0] == "hf":  # transformers is an optional extra: imported only for such a model
        from .hf import load_hf

        return load_hf(spec, vocab_size, seed, indices)
    from .titan import load_torchtitan

    return load_torchtitan(spec, vocab_size, seed, indices)


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


def builds_own_units(fn: Callable[..., object]) -> bool:
    """Whether an entry function opts in to building only some units: it takes a keyword ``units``."""
    try:
        param = inspect.signature(fn).parameters.get("units")
    except ValueError:  # no introspectable signature: it builds everything
        return False
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def _own_units(entry: str, built: object, wanted: list[int]) -> dict[int, nn.Module]:
    """What an opt-in entry function returned for ``units=wanted``: those units, by index."""
    if isinstance(built, list | tuple) and len(built) == len(wanted):
        built = dict(zip(wanted, built, strict=True))
    modules = isinstance(built, dict) and all(isinstance(m, nn.Module) for m in built.values())
    if not isinstance(built, dict) or sorted(built) != wanted or not modules:
        got = sorted(built) if isinstance(built, dict) else type(built).__name__
        raise ConfigError(
            "model.entry",
            entry,
            f"a function that, called with units={wanted}, returns those units: a list in that order, or a dict "
            f"index -> nn.Module (got {got})",
        )
    return {i: built[i] for i in wanted}


def _load_entry(
    spec: Mapping[str, Any], seed: int, indices: Iterable[int] | None, whole: LoadedModel | None = None
) -> LoadedModel:
    """A user function's units (module docstring). One that takes a keyword ``units`` is asked for ``indices``
    alone when ``whole`` (the model's facts, loaded whole before) is given, and the rest is ``whole``'s."""
    _check_keys(spec, (*ENTRY_KEYS, "untie"))  # untie: every model source's (:mod:`.untie`)
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
    own = builds_own_units(fn)
    if own and "units" in kwargs:
        raise ConfigError("model.kwargs", dict(kwargs), f"no 'units': paci-tune passes it to {spec['entry']}")
    wanted = None if whole is None or indices is None or not own else _check_indices(indices, whole.n_units)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # explicit list: no multi-GPU warning, CUDA RNG restored too
        torch.manual_seed(seed)
        built = fn(**kwargs, **({"units": wanted} if own else {}))
    if whole is not None and wanted is not None:  # this rank's units; the model's facts are ``whole``'s
        units = _own_units(spec["entry"], built, wanted)
        if spec.get("untie") is True:  # as the whole build was (the copies among the units built here)
            from .untie import untie_units

            untie_units(units)
        return dataclasses.replace(whole, units=units)
    if not isinstance(built, list | tuple):
        raise ConfigError("model.entry", spec["entry"], f"{_RETURNS} (got {type(built).__name__})")
    if not built or not all(isinstance(m, nn.Module) for m in built):
        got = [type(m).__name__ for m in built]
        raise ConfigError("model.entry", spec["entry"], f"{_RETURNS} (got {got})")
    n = len(built)
    _check_indices(indices, n)
    units = dict(enumerate(built))
    untied = None
    if spec.get("untie", False) is not False:
        from .untie import untie_units

        if spec["untie"] is not True:
            raise ConfigError("model.untie", spec["untie"], "true or false")
        untied = untie_units(units)
    return LoadedModel(
        units=units,
        n_units=n,
        names=[f"unit{i}" for i in range(n)],
        flops=None,
        block_size=block_size,
        gpt=None,
        trainable=[trains(u) for u in units.values()],
        matrices=[trains_a_matrix(u) for u in units.values()],
        untied=untied,
    )
