"""``python -m paci_tune.base.tether PARENT_PID MODULE ARGS...``: run MODULE, dying with PARENT_PID.

How the launcher starts torchrun (a module we do not own) so that it cannot outlive
``paci-tune``: the parent-death signal is set here, in the child, then MODULE runs as
``__main__`` with ``ARGS`` (see :func:`paci_tune.base.processes.tethered`). May import: the
standard library and :mod:`paci_tune.base.processes`.
"""

from __future__ import annotations

import runpy
import sys

from .processes import die_with_parent

if __name__ == "__main__":
    die_with_parent(parent=int(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [{"torch.distributed.run": "torchrun"}.get(module, module), *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
