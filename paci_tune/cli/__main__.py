"""``python -m paci_tune.cli``: the ``paci-tune`` command line."""

from . import run

run()
