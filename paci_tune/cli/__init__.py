"""The command line: click commands and rich output, nothing else (``paci-tune``, ``python -m paci_tune.cli``).

Each command parses its options, calls one function of the layer that does the work and shows the
result. May import: click, rich and, this being the top floor, any layer of the package; today:
:mod:`paci_tune.base`, :mod:`paci_tune.calibrate`, :mod:`paci_tune.config`,
:mod:`paci_tune.errors`, :mod:`paci_tune.model`, :mod:`paci_tune.pipeline`, :mod:`paci_tune.report`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.sim`, :mod:`paci_tune.train`, :mod:`paci_tune.tune`,
:mod:`paci_tune.verdict`.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from typing import Any

__all__ = ["main", "run"]


def run() -> None:
    """The ``paci-tune`` entry point. The commands are imported here, not when the package is, so that
    a Ctrl-C while the program is still loading (torch takes seconds) ends like one during the work
    (:mod:`.failures`): one line, exit 130, no traceback."""
    # A run that stops answering can be asked where it is: ``kill -USR1 PID`` prints every thread's
    # Python stack on stderr and the run goes on (the standard library's faulthandler, no cost until then).
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        from .app import main as commands
    except KeyboardInterrupt:
        from .failures import INTERRUPTED

        sys.stderr.write(f"error: {INTERRUPTED}\n")
        raise SystemExit(130) from None
    commands()


def __getattr__(name: str) -> Any:
    """``main``, the click group (for ``CliRunner`` and embedding), loaded on first use."""
    if name == "main":
        from .app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
