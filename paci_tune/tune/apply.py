"""``paci-tune apply``'s run: the recommended trial's configuration, with the user's overrides.

Checkpoints go beside ``best.yaml`` so an interrupted run continues with ``--resume``; on the
trial's own budget the first one comes after the trial's steps, so ``apply`` trains exactly the
numerics of the trial it recommends (a PACI checkpoint drains the pipeline). May import:
:mod:`paci_tune.config` and the tune layer's :mod:`.bestfile`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig, derive_run
from .bestfile import read_best


def apply_run(best: str | Path, overrides: dict[str, Any], *, until: str = "target") -> RunConfig:
    """The run ``apply`` trains: ``best``'s ``run`` plus ``overrides`` (dotted keys of what was given).

    ``until="budget"`` trains through the whole budget instead of stopping at the target.
    """
    best_file = read_best(best)  # the whole file checked first: a bad value never reaches a run
    run_doc = best_file.run
    best_path = Path(best).resolve()
    over = dict(overrides)
    if until == "budget":
        over["training.target_val_loss"] = None
    over.setdefault("training.checkpoint_dir", str(best_path.parent / f"{best_path.stem}-checkpoints"))
    if "training.checkpoint_every" not in over and not run_doc["training"].get("checkpoint_every"):
        # A checkpoint drains the pipeline, which changes PACI's numbers after it. On the trial's own
        # budget, checkpoints go every trial-length, so the steps the trial ran are trained exactly as
        # it trained them; on another budget (the LR schedule changes anyway), about four over the run.
        trial_steps = best_file.trial_steps or 100
        steps = over.get("training.steps")
        over["training.checkpoint_every"] = int(trial_steps) if steps is None else max(1, int(steps) // 4)
    if over.get("training.steps") is not None:
        over["training.eval_every_seconds"] = None
        over["training.eval_every"] = max(1, int(over["training.steps"]) // 8)
    return derive_run(run_doc, over)


def run_file_for(best: str | Path) -> Path:
    """Where ``apply`` writes the resolved run it trains: ``best.run.yaml`` beside ``best.yaml``."""
    p = Path(best).resolve()
    return p.parent / f"{p.stem}.run.yaml"
