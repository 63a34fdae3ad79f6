"""``python -m paci_tune.cli``: the ``paci-tune`` command line."""

from .app import main

main()
