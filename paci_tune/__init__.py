"""paci-tune: auto-tune and run PACI asynchronous pipeline-parallel training.

The public API -- what a user imports -- is listed in ``__all__`` and loaded on first use, so
``import paci_tune`` (and ``paci-tune --help``) stays fast; everything else is internal. Layers,
bottom to top: ``errors``, ``base`` (files, processes); ``config``; ``schedule`` (action lists,
torch-free); ``model``, ``data``; ``sim`` (profiles, simulator; torch-free); ``pipeline``
(stages, runtimes); ``calibrate``; ``train``; ``tune``; then the entry points ``cli``, ``worker``
and the drop-in ``pipelining``. A module imports only from its own layer and the ones below.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "SchedulePACI": "paci_tune.pipelining",
    "ConfigError": "paci_tune.errors",
    "RunConfig": "paci_tune.config",
    "load_config": "paci_tune.config",
    "derive_run": "paci_tune.config",
    "run_training": "paci_tune.train",
    "resolve_run": "paci_tune.train",
    "calibrate": "paci_tune.calibrate",
    "Profile": "paci_tune.sim",
    "simulate": "paci_tune.sim",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'paci_tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
