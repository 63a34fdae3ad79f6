"""The command line: click commands and rich output, nothing else (``paci-tune``, ``python -m paci_tune.cli``).

Each command parses its options, calls one function of the layer that does the work and shows the
result. May import: every layer of the package, click and rich.
"""

from .app import main

__all__ = ["main"]
