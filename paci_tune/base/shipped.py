"""The files that ship inside the package: the search spaces, the built-in example config and its
reference cost profile (the ``rst`` clock's reference system).

They live under ``paci_tune/base/share/`` as package data, found with :mod:`importlib.resources`,
so a plain (non-editable) ``pip install`` has them; the repository's ``search_spaces/`` and
``examples/tiny-gpt.yaml`` are links to the same files. The names users know keep working from
any folder: a space by its name (``cpu-small``), and the relative paths the README spells
(``examples/tiny-gpt.yaml``, ``search_spaces/cpu-small.yaml``, ``profiles/tiny-gpt.yaml``) when
no such file exists where the command runs. A file that exists always wins over a shipped one.
May import: the standard library.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

KINDS = ("search_spaces", "examples", "profiles")


def shipped_dir(kind: str) -> Path:
    """The folder of one kind of shipped file (a real folder: the package is installed unzipped)."""
    assert kind in KINDS, kind
    return Path(str(resources.files("paci_tune.base") / "share" / kind))


def shipped_names(kind: str) -> list[str]:
    return sorted(p.stem for p in shipped_dir(kind).glob("*.yaml"))


def shipped(kind: str, name: str) -> Path | None:
    """The shipped file ``name`` (with or without ``.yaml``) of ``kind``, or None."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if not stem or "/" in stem or stem.startswith("."):
        return None
    p = shipped_dir(kind) / f"{stem}.yaml"
    return p if p.is_file() else None


def resolve_path(path: str | Path) -> Path:
    """``path`` itself, or, when it does not exist and reads ``examples/NAME.yaml`` or
    ``search_spaces/NAME.yaml`` or ``profiles/NAME.yaml``, the shipped file of that name."""
    p = Path(path)
    if p.exists() or p.parent.name not in KINDS or len(p.parts) != 2:
        return p
    return shipped(p.parent.name, p.name) or p
