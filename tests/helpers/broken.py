"""Broken inputs, for the tests that must refuse them or survive them.

- Broken variants of a YAML document, generated from the document itself (tests/test_mutations.py):
  every scalar leaf becomes negative, non-numeric and absurdly large (numbers), another type and an
  unknown value (strings); every mapping gets an unknown key and is replaced by a list and by a
  string; and the file itself becomes empty, null, a scalar, a list, invalid YAML and binary noise.
  Each variant carries the key its error line must name. ``allowed_huge`` lists the leaves where a
  huge value is a legitimate (if long) setting; ``free_text`` those whose any string is accepted.
- The unbroken carriers of those variants, :data:`SMALL` (a search config) and :data:`BEST` (a
  best.yaml), which tests/test_failures.py breaks in other ways (the file system, the storage).
- :func:`misbehaving_model`: the source of a user model that crashes, hangs, goes NaN or dies by
  micro-batch size (tests/test_search.py, tests/test_stage_death.py).
"""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from helpers.configs import BASE_CONFIG

GARBAGE: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("only-whitespace", b"\n  \n"),
    ("null", b"~\n"),
    ("scalar", b"42\n"),
    ("list", b"- a\n- b\n"),
    ("invalid-yaml", b"model: [unclosed\n  : :\n"),
    ("binary", bytes(range(256)) * 4),
    ("tab-indented", b"model:\n\tpreset: tiny\n"),
]


@dataclass(frozen=True)
class Variant:
    id: str
    text: bytes
    key: str  # what the error line must name (a fragment of the dotted key)


def _dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def leaves(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from leaves(v, (*path, i))
    else:
        yield path, doc


def mappings(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(doc, dict):
        yield path
        for k, v in doc.items():
            yield from mappings(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from mappings(v, (*path, i))


def set_at(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def _name_of(path: tuple[Any, ...]) -> str:
    """The last named part of a path (``betas`` for ``optimizer.betas[0]``): what the error must mention."""
    named = [p for p in path if not isinstance(p, int)]
    return str(named[-1]) if named else "config"


def variants(
    doc: dict[str, Any],
    *,
    prefix: str = "",
    allowed_huge: frozenset[str] = frozenset(),
    free_text: frozenset[str] = frozenset(),
    skip: frozenset[str] = frozenset(),
    huge_int: int = 10**12,
    huge_float: float = 1e300,
    root_key: str = "config",
) -> list[Variant]:
    """Every broken variant of ``doc`` (module docstring)."""
    out: list[Variant] = []

    def add(tag: str, path: tuple[Any, ...], value: Any, key: str | None = None) -> None:
        dotted = _dotted(path)
        if dotted in skip:
            return
        text = yaml.safe_dump(set_at(doc, path, value), sort_keys=False).encode()
        out.append(Variant(f"{prefix}{dotted}={tag}", text, key or _name_of(path)))

    for path, v in leaves(doc):
        dotted = _dotted(path)
        if isinstance(v, bool):
            add("not-bool", path, "maybe")
        elif isinstance(v, (int, float)):
            add("negative", path, -3 if isinstance(v, int) else -3.0)
            add("non-numeric", path, "lots")
            if dotted not in allowed_huge:
                add("huge", path, huge_int if isinstance(v, int) else huge_float)
            if isinstance(v, float):
                add("nan", path, float("nan"))
        elif isinstance(v, str):
            add("wrong-type", path, [1, 2])
            if dotted not in free_text:
                add("unknown-value", path, "no-such-value")
    for path in mappings(doc):
        if not path:
            text = yaml.safe_dump({**doc, "bogus_key": 1}, sort_keys=False).encode()
            out.append(Variant(f"{prefix}<root>=unknown-key", text, "bogus_key"))
            continue
        add("unknown-key", (*path, "bogus_key"), 1, "bogus_key")
        add("list-for-mapping", path, [1, 2])
        add("string-for-mapping", path, "oops")
    for tag, text in GARBAGE:
        out.append(Variant(f"{prefix}<file>={tag}", text, root_key))
    return out


SMALL: dict[str, Any] = {
    **copy.deepcopy(BASE_CONFIG),
    "target": {"value": 1.85},
    "budget": {"clock": "sim", "seconds": 0.3, "grid": 3},
    "hardware": {"devices": 2},
    "search": {"trials": 2, "seed": 0, "confirm": {"top": 0}},
}
"""A quick carrier (synthetic data) for the space, best.yaml and profile variants."""

BEST: dict[str, Any] = {
    "recommended": {
        "schedule": "paci",
        "window": 4,
        "microbatch_size": 2,
        "stages": 2,
        "partition": [2, 2],
        "global_batch": 8,
        "lr": 1.0e-3,
        "lr_scale": 1.0,
    },
    "evidence": {
        "trial": "run.paci#0",
        "time_to_target": None,
        "reached_target": False,
        "best_val_loss": 3.9,
        "score": 0.5,
        "tokens_per_s": 1000.0,
        "steps": 6,
    },
    "target": {"metric": "val_loss", "value": 1.85},
    "budget": {"clock": "sim", "seconds": 0.3, "grid": 3},
    "provenance": {"study_name": "run"},
    "run": copy.deepcopy(BASE_CONFIG),
}
"""A valid best.yaml of BASE_CONFIG's run."""


_MODEL = '''
"""{doc}"""
import os, signal, time
from pathlib import Path
import torch
from torch import nn

HERE = Path(__file__).parent

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
    def forward(self, x):
        return self.emb(x)

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 64)
        self.calls = 0
    def forward(self, h):
{misbehaviour}
        return self.lin(h)

def build():
    return [Embed(), Head()]
'''


def misbehaving_model(doc: str, misbehaviour: str) -> str:
    """The source of a two-unit model (``build()``: an embedding, a linear head over 64 tokens) whose head
    runs ``misbehaviour`` (the body of its ``forward(self, h)``, which may use ``os``, ``signal``,
    ``time``, ``torch`` and ``HERE``, the model's folder) before its output."""
    return _MODEL.format(doc=doc, misbehaviour=textwrap.indent(textwrap.dedent(misbehaviour).strip("\n"), " " * 8))
