"""``python -m paci_tune.tune.child PARENT_PID train ...``: one trial's process.

Runs the ``paci-tune`` command line, after asking the kernel to stop this process when the
search that started it dies (SIGKILL included), so a killed search leaves no trial training.
"""

from __future__ import annotations

import sys

from ..pipeline.lifetime import die_with_parent

if __name__ == "__main__":
    die_with_parent(parent=int(sys.argv[1]))
    from ..cli import main

    sys.argv = ["paci-tune", *sys.argv[2:]]
    main()
