"""``model.untie: true``: every parameter several units share gets a separate copy per unit.

A tied parameter (GPT-2's output head reusing the embedding matrix) is one parameter of the model;
PACI's stages step at their own cadence and cannot keep copies of it equal, so PACI refuses a cut
that splits it (:func:`paci_tune.pipeline.checks.check_shared_parameters`). Untying it at build time
-- the first holder keeps the parameter, every later holder starts from a clone of it -- makes a
different model, the same for every schedule and depth, that every schedule can train; its cost is
the copies' parameters, stated as :func:`untie_note` words it. Applied where the units are built
(the entry loader, :mod:`.hf_build`), so every rank of every runtime trains the same untied model.
May import: torch, :mod:`.loader`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .loader import Tie, shared_parameters


def _owner(unit: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter ``name`` of ``unit`` directly, and its attribute name there."""
    path, _, attr = name.rpartition(".")
    return (unit.get_submodule(path) if path else unit), attr


def untie_units(units: dict[int, nn.Module], ties: Sequence[Tie] | None = None) -> str | None:
    """Give every later holder of a shared parameter its own copy, in place; the note of what it cost, or None.

    ``units`` holds the units built here (all of them for an entry model; a rank's own for a model built
    per rank, whose ``ties`` say what is shared). A later holder's copy is a clone of the parameter's
    current value, swapped into the module that holds it -- unless that module is also reachable
    from an earlier holder (a whole module shared), where the unit is deep-copied instead.
    """
    if ties is None:
        index = sorted(units)
        ordered = [units[i] for i in index]
        ties = []
        for us, ns in shared_parameters(ordered):
            p = ordered[us[0]].get_parameter(ns[0])
            ties.append(Tie([index[u] for u in us], ns, p.requires_grad, p.numel()))
    extra, copied = 0, []
    for tie in ties:
        first = tie.units[0]
        for u, name in zip(tie.units, tie.names, strict=True):
            if u == first:
                continue
            extra += tie.numel
            copied.append(f"unit {first}'s {tie.names[0]!r} into unit {u}")
            if u not in units:
                continue
            module, attr = _owner(units[u], name)
            earlier = [units[v] for v in tie.units if v < u and v in units]
            if any(module is m for e in earlier for m in e.modules()):
                units[u] = copy.deepcopy(units[u])
                continue
            old = module._parameters[attr]
            assert old is not None
            with torch.no_grad():
                module._parameters[attr] = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    if not copied:
        return None
    return untie_note(extra, copied)


def untie_note(extra: int, copied: Sequence[str]) -> str:
    """``untie: +N parameters (...)``: what untying added, as a run's opening line and best.yaml state it."""
    more = f" and {len(copied) - 1} more" if len(copied) > 1 else ""
    return f"untie: +{extra:,} parameters (tied parameter copied: {copied[0]}{more})"
