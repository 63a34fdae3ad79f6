"""Broken variants of a YAML document, generated from the document itself (for tests/test_mutations.py).

Every scalar leaf becomes negative, non-numeric and absurdly large (numbers), another type and an
unknown value (strings); every mapping gets an unknown key and is replaced by a list and by a
string; and the file itself becomes empty, null, a scalar, a list, invalid YAML and binary noise.
Each variant carries the key its error line must name. ``allowed_huge`` lists the leaves where a
huge value is a legitimate (if long) setting; ``free_text`` those whose any string is accepted.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

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
