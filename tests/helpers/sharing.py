"""The shared-curve oracle: a trial answered from a stored curve must score what its own training scores.

Shared by the sharing and sibling-layout tests.
"""

from __future__ import annotations

from typing import Any

import optuna

from helpers.cli import run_in_process
from paci_tune.tune.record import TrialRecord

TOL = 1e-5


def scores_as_trained(search: Any, target: float, schedule: str, t: optuna.trial.FrozenTrial) -> bool:
    """Train ``t``'s own run (its layout, budget and step grid) in process: its scored validations must fall
    at the clocks ``t`` stored (to 1e-6 s) with losses within :data:`TOL`, up to the first at or below the
    target. True when the run validated far apart somewhere (``training.eval_far_every``, train.nearness)."""
    params = search.space.suggest(optuna.trial.FixedTrial(t.params), schedule)
    doc = search.trial_doc(params)
    every, far = int(doc["training"]["eval_every"]), doc["training"].get("eval_far_every")
    records = run_in_process(doc)
    trained = any(r.get("event") == "train" for r in records)
    # Scored: the validations on the step grid, not the closing one of a run that trained (tune.runner).
    evals = [r for r in records if r.get("event") == "eval" and not (r.get("drained") and trained)]
    fresh = [(r["clock"], r["val_loss"]) for r in evals if r["step"] % every == 0]
    steps = {r["step"] for r in evals if not r.get("drained")}
    skipped = set(range(every, max(steps, default=0), every)) - steps
    read = TrialRecord.read(t).curve
    assert read, (schedule, t.number)
    first_hit = next((i for i, (_, v) in enumerate(fresh) if v <= target), len(fresh) - 1)
    assert len(read) == first_hit + 1, (schedule, t.params, read, fresh)
    for (c, v), (c2, v2) in zip(read, fresh, strict=False):
        assert abs(c - c2) <= 1e-6 and abs(v - v2) <= TOL, (schedule, t.params, read, fresh)
    return far is not None and bool(skipped) and any(s % far for s in steps)
