"""``python -m paci_tune``: the ``paci-tune`` command line."""

from .cli import run

run()
