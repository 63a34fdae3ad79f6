"""One trial's run document: the search's base run with the trial's point, budget, clock and seed.

Kept apart from the search loop (:mod:`.search`) because it is a pure function of the search's
configuration and the point: the loop, the shared-curve horizons and the transfer check's long runs
all build their runs here. May import: :mod:`paci_tune.config` and the tune layer's :mod:`.point`,
:mod:`.setup` and :mod:`.warm`.
"""

from __future__ import annotations

import copy
from typing import Any

from ..config import derive_doc
from ..config.tune import TuneConfig
from .point import TrialParams
from .setup import trial_runtime
from .warm import WarmStart, trial_overrides


def plain_doc(
    tune: TuneConfig,
    profile: str | None,
    warm: WarmStart | None,
    params: TrialParams,
    seed: int | None = None,
    factor: float = 1.0,
) -> dict[str, Any]:
    """The run document of one trial without curve sharing: the base run, the point, the budget (and a seed).

    ``factor``: a transfer check's long run, on ``factor`` x the budget with the same validation
    spacing (:func:`.extra.long_budget`); the LR schedule decays over ``training.seconds``, the longer budget.
    A warm-started search's trials start from its checkpoint (:func:`.warm.trial_overrides`).
    """
    t, b, hw = tune, tune.budget, tune.hardware
    over: dict[str, Any] = dict(params.overrides())
    over.update(
        {
            "training.seconds": b.seconds * factor if b.seconds is not None and factor != 1.0 else b.seconds,
            "training.clock": b.clock,
            "training.profile": profile,
            "training.eval_every_seconds": (b.seconds or 0.0) / b.grid,
            "training.target_val_loss": t.target.value,
            "training.checkpoint_every": 0,
            "training.checkpoint_dir": None,  # the run file's folder is the user's run's: trials write none there
            "pipeline.partition": "auto",
            "pipeline.runtime": trial_runtime(tune),
            "pipeline.inflight": None,
            "optimizer.lr": float(t.run.optimizer.lr) * params.lr_scale,
        }
    )
    over.update({k: v for k, v in (("pipeline.device", hw.device), ("pipeline.backend", hw.backend)) if v})
    over.update(trial_overrides(warm))
    if params.chunks == 1 and "chunks" in (t.run_doc.get("pipeline") or {}):
        over["pipeline.chunks"] = None  # the run file's v belongs to its own schedule, not this point's
    if seed is not None:
        over["training.seed"] = seed
    if b.clock != "wall":
        over["training.eval_every"] = 10**9  # segments end on the clock grid only (no extra fills)
    return derive_doc(copy.deepcopy(t.run_doc), over)
