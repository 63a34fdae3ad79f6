"""Hand-built Optuna studies whose best points and confirmation runs are known, and best.yaml built from them.

A search trial is a point (micro-batch size b at depth P) with a score; a confirmation trial is the same
point on a fresh seed, with its score and its time to target (None: it missed the target). The studies
go through the real :func:`paci_tune.verdict.best.build_best` and :func:`paci_tune.tune.rounds.current_round`.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.tune.extra import confirm_plan
from paci_tune.tune.record import CONFIRM
from paci_tune.verdict.best import build_best

DISTS = {"stages": CategoricalDistribution([1, 2, 4]), "microbatch_size": CategoricalDistribution([4, 8, 16])}
BUDGET = {"clock": "sim", "seconds": 10.0, "grid": 5}  # a validation every 2 s: time to target's resolution


def search_study(schedule: str, results: list[tuple[int, float | None, float]], stages: int = 2) -> optuna.Study:
    """Search trials (b, time to target or None, score), all at depth ``stages``, and one pruned trial."""
    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    for b, ttt, value in results:
        study.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                value=value,
                params={"stages": stages, "microbatch_size": b},
                distributions=DISTS,
                user_attrs={"time_to_target": ttt, "best_val_loss": 1.0, "partition": [1, 1]},
            )
        )
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"stages": 4, "microbatch_size": 4},
            distributions=DISTS,
            intermediate_values={1: 0.1},
        )
    )
    return study


def confirmed_study(
    schedule: str,
    points: dict[int, dict[int, float]],
    missed: frozenset[tuple[int, int]] = frozenset(),
    search: dict[int, float] | None = None,
    stages: int = 2,
) -> optuna.Study:
    """Search trials (b -> its search score, default its best confirmed score less 1: the lucky draw) planned for
    confirmation in search order, plus a confirmation trial per (b, seed); those in ``missed`` did not reach
    the target."""
    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    numbers = {}
    for b, seeds in points.items():
        value = (search or {}).get(b, min(seeds.values()) - 1.0)
        study.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                value=value,
                distributions=DISTS,
                params={"stages": stages, "microbatch_size": b},
                user_attrs={"time_to_target": value},
            )
        )
        numbers[b] = study.trials[-1].number
    confirm_plan(study, top=len(points))
    for b, seeds in points.items():
        for seed, value in seeds.items():
            attrs = {
                CONFIRM: {"of": numbers[b], "seed": seed},
                "time_to_target": None if (b, seed) in missed else value,
            }
            params = {"stages": stages, "microbatch_size": b}
            study.add_trial(
                create_trial(
                    state=TrialState.COMPLETE, value=value, distributions=DISTS, params=params, user_attrs=attrs
                )
            )
    return study


def best_of(studies: dict[str, optuna.Study], **kw: Any) -> dict[str, Any]:
    """best.yaml's document for the studies (its run document: the point's schedule and b)."""
    kw = {"budget": BUDGET, **kw}
    return build_best(
        studies,
        run_doc_for=lambda p: {"pipeline": {"schedule": p.schedule}, "b": p.microbatch_size},
        base_lr=1e-3,
        fixed_batch=32,
        target={"metric": "val_loss", "value": 2.0},
        provenance={"study_name": "t"},
        **kw,
    )
