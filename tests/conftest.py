"""The suite's pytest set-up: the xdist pinning plugin, and a scratch TMPDIR for subprocesses.

The helpers the tests share live in ``tests/helpers/`` (configs, CLI runs, processes, oracles...),
imported as ``helpers.<module>``; ``tests/`` is on ``sys.path`` by pyproject's ``pythonpath``.
"""

from __future__ import annotations

import pytest
from helpers.cli import set_scratch

pytest_plugins = ["helpers.pinning", "helpers.gloo"]  # gloo: the single_rank fixture


@pytest.fixture(scope="session", autouse=True)
def _scratch_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Subprocesses put their temporary files (the launcher's work folder, torchrun's) under pytest's tmp."""
    set_scratch(tmp_path_factory.mktemp("subprocess-tmp"))
