"""Tied parameters in a cost profile: which units share a trainable parameter, and what summing it costs.

A profile's optional top-level ``tied`` list names, per set of units sharing trainable parameters
(an output head reusing the embedding's matrix), the units and the fp32 gradient bytes they share::

    tied:
      - {units: [0, 5], bytes: 131072}

``paci-tune calibrate`` records it from the loaded model (:func:`paci_tune.pipeline.tied.tied_groups`,
the same detection the runtimes use); **a profile without it** (every profile written before it
existed) ties nothing. Frozen shared parameters are not listed: they are never stepped, so nothing is
summed.

What it costs (:func:`tied_steps`): where a stage cut puts a group's units on more than one stage,
those stages (the *holders*) sum the parameter's gradient at every optimizer step, as the runtimes do
(:mod:`paci_tune.pipeline.tied`): one ring all-reduce of the group's bytes among the holders,
``AllReduceCost.ring_s(bytes, holders)``, after the data-parallel all-reduce (Megatron's order),
and being collective it makes the holders' steps wait for each other. Groups held by the same set
of stages go in one all-reduce (the runtime flattens them together); a group kept on one stage costs
nothing. May import: :mod:`paci_tune.errors` and the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

KEYS = ("units", "bytes")


@dataclass(frozen=True)
class TiedGroup:
    """Units sharing trainable parameters, and those parameters' fp32 gradient bytes (4 per parameter)."""

    units: tuple[int, ...]
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"units": list(self.units), "bytes": int(self.bytes)}


def parse_tied(key: str, raw: Any, n_units: int) -> list[TiedGroup]:
    """A profile's ``tied`` list, validated; ``None`` (the key absent) is nothing tied."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(key, raw, "a list of {units: [i, j, ...], bytes: N}, one per set of units sharing parameters")
    out = []
    for i, item in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(item, Mapping) or set(item) != set(KEYS):
            raise ConfigError(where, item, "a mapping with exactly the keys: " + ", ".join(KEYS))
        units, nbytes = item["units"], item["bytes"]
        if (
            not isinstance(units, list)
            or any(isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < n_units for u in units)
            or len(units) < 2
            or len(set(units)) != len(units)
        ):
            raise ConfigError(f"{where}.units", units, f"two or more distinct unit indices in 0..{n_units - 1}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes < 2**63:
            raise ConfigError(f"{where}.bytes", nbytes, "a positive integer: 4 bytes per shared trainable parameter")
        out.append(TiedGroup(tuple(sorted(units)), nbytes))
    return out


def tied_steps(groups: Sequence[TiedGroup], stage_units: Sequence[Sequence[int]]) -> dict[tuple[int, ...], int]:
    """The all-reduces a cut adds at each step: holder stages (sorted) -> the bytes they sum together.

    ``stage_units[s]``: every unit stage ``s`` holds (all its chunks). Only groups split across stages
    appear; groups with the same holders are merged, as the runtime's one flattened all-reduce per set.
    """
    stage_of = {u: s for s, units in enumerate(stage_units) for u in units}
    out: dict[tuple[int, ...], int] = {}
    for g in groups:
        holders = tuple(sorted({stage_of[u] for u in g.units}))
        if len(holders) > 1:
            out[holders] = out.get(holders, 0) + g.bytes
    return out
