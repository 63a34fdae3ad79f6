"""Which code a best.yaml may make ``paci-tune apply`` run: none the user did not name.

best.yaml is the file people send each other, and ``apply --dry-run`` is how one looks at it; a user
model (``model.entry: module:function``) is code, imported and called with the file's ``kwargs``. So
apply imports an entry only when the command line names the same one, ``--trust-entry
MODULE:FUNCTION`` (:data:`FLAG`): without it, or naming another, :func:`check_entries` refuses the file
with a ConfigError (exit 2) naming the key, the entry and the flag to pass -- before any import, any
file written, any work. Checked: every run of best.yaml that apply may train, ``run`` and the warm-up
it trains first (``warm_start.run``). A built-in model (``preset``) is no code and needs nothing; a
search's own config is the user's file and is not checked. Trusting a function trusts it with
best.yaml's keyword arguments too: name only a model of your own. May import: :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import shlex
from typing import Any

from ..errors import ConfigError

FLAG = "--trust-entry"
RUNS = ("run", "warm_start.run")
"""Where best.yaml holds a run apply may train: its recommendation, and the warm-up trained before it."""


def entries(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, entry) of every user model a run of best.yaml names (non-strings aside: the loader refuses
    them before any import)."""
    out: list[tuple[str, str]] = []
    for where in RUNS:
        node: Any = doc
        for part in where.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        model = node.get("model") if isinstance(node, dict) else None
        if isinstance(model, dict) and isinstance(model.get("entry"), str):
            out.append((f"best.yaml.{where}.model.entry", model["entry"]))
    return out


def check_entries(doc: dict[str, Any], trusted: str | None) -> None:
    """Refuse a best.yaml whose model entry the command line did not name (module docstring)."""
    for key, entry in entries(doc):
        if entry != trusted:
            named = f" ({FLAG} names {trusted!r})" if trusted is not None else ""
            raise ConfigError(
                key,
                entry,
                f"a model entry you chose: apply imports and runs the code a best.yaml names only when "
                f"the command line names it too{named}; if you trust {entry}, pass {FLAG} {shlex.quote(entry)}",
            )
