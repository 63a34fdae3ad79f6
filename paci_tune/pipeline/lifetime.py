"""Tie a child process's life to its parent's, so a killed launcher leaves no worker training.

Without this, SIGKILL of ``paci-tune train`` (an OOM kill, a CI timeout) orphans torchrun and its
workers, which keep training, checkpointing and writing metrics for a run the user thinks is dead,
and race a later ``--resume`` on the same checkpoint folder. Linux's parent-death signal closes
that gap; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only).

    ``parent``: the pid the parent had when it started us; if we are already orphaned, die now.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


if __name__ == "__main__":
    # ``python -m paci_tune.pipeline.lifetime PARENT_PID`` + torchrun's arguments: torchrun that
    # dies with its launcher (set here, in the child, rather than in a pre-exec hook, which is
    # unsafe in a launcher that runs threads such as the live view's).
    import runpy

    die_with_parent(parent=int(sys.argv[1]))
    sys.argv = ["torchrun", *sys.argv[2:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
