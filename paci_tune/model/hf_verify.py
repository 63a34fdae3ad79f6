"""The check a transformers model passes before any run: its units, chained, are the model.

The split (:mod:`.hf_split`) is generic, so an architecture it does not fit (a scale after the head, a
projection after the final norm, attention that needs what a block unit does not pass) is found
here rather than trained: the whole model is built as a run builds it (same seed, weights, untie),
and the chained units must give ``model(x).logits`` to :data:`TOLERANCE` in fp32. Anything else is a
:class:`ConfigError` naming ``model.hf``, the architecture and what failed. That they are causal is
every model's check, run on the same units just before this one
(:func:`paci_tune.pipeline.checks.check_units`). May import: torch, the model layer's modules, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .hf_build import build_model
from .untie import untie_units

KEY = "model.hf"
TOLERANCE = 1e-5


def _first_line(exc: Exception) -> str:
    return next(iter(str(exc).splitlines()), "")


@torch.no_grad()
def check_split(model: Any, units: list[torch.nn.Module], vocab_size: int, block: int, where: object) -> None:
    """Refuse unless the chained ``units`` equal ``model``'s logits (module docstring)."""
    arch = type(model).__name__
    model.eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (2, block), generator=gen)
    try:
        want = model(input_ids=x, use_cache=False).logits.float()
        got = chain(units, x)
    except Exception as exc:  # the architecture under our split: say what broke, as configuration
        raise ConfigError(
            KEY, where, f"a model whose units run ({arch}: {type(exc).__name__}: {_first_line(exc)})"
        ) from None
    if got.shape != want.shape or not bool(torch.isfinite(want).all()):
        raise ConfigError(KEY, where, f"units whose logits are the model's ({arch}: shape {tuple(got.shape)})")
    diff = (got - want).abs().max().item()
    if diff > TOLERANCE:
        raise ConfigError(
            KEY,
            where,
            f"an architecture whose split into units equals the model ({arch}: the chained units differ from "
            f"model(x).logits by {diff:.3g} > {TOLERANCE}; the generic split does not fit it)",
        )


def chain(units: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The units run one after the other on token ids ``x``: the pipeline's forward."""
    h = x
    for unit in units:
        h = unit(h)
    return h


def verify_split(
    config: Any, seed: int, folder: Path | None, untie: bool, block: int, vocab_size: int, where: object
) -> None:
    """Build the whole model as a run does and :func:`check_split` it (untied as the run unties it)."""
    model, split, ties = build_model(config, seed, None, folder, where)
    units = dict(enumerate(split.units))
    if untie:
        untie_units(units, ties)
    check_split(model, [units[i] for i in range(len(units))], vocab_size, block, where)
    model.train()
