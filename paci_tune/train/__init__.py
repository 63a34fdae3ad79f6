"""The train layer: running one training -- its loop, clocks, checkpoints, metrics and launcher.

The loop knows nothing of how the pipeline runs; :func:`run_training` is how every command trains.
May import: :mod:`paci_tune.calibrate`, :mod:`paci_tune.pipeline`, :mod:`paci_tune.sim`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.data` (the default draw, for checkpoints),
:mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from .run import WorkersFailed, resolve_run, run_training

__all__ = ["WorkersFailed", "resolve_run", "run_training"]
