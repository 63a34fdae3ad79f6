"""Helpers the test modules share, so that no test module imports another and no setup is written twice.

``tests/`` is on ``sys.path`` (pyproject's ``pythonpath``), so a test reads ``from helpers.configs import
make_config``. Each module says what it is for; :mod:`helpers.pinning` is the pytest plugin that
pins xdist workers to their CPUs (registered by ``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root: where the CLI subprocesses run, and where examples/ and search_spaces/ are read."""
