"""Adaptive capping: a search trial stops once it can no longer rank among the points the search keeps.

The objective is time to target (:mod:`.objective`): a trial that reaches the target scores the clock
of its first validation at or below it, and one that does not scores more than the whole budget. So a
trial whose validation clock has passed the ``k``-th best score of its study, without reaching the
target, will score more than that: it cannot be among the study's ``k`` best, whatever it does next.
Training it on only refines the score of a point nobody reads. This is SMAC's adaptive capping
(Hutter et al., 2011), made for exactly this kind of objective, the run time of a solver.

``k`` is the most ranks the search reads afterwards: ``search.confirm.top`` (the points confirmed on
fresh seeds) and ``search.transfer_check.top``, at least 1 (the best point). Those ranks and their
scores are exactly what an uncapped search gives; best.yaml's candidate table (up to five rows) lists
finished trials, so a runner-up past rank ``k`` that was capped shows there as a pruned trial.

The cap is read when a trial starts, from the study's finished trials (another worker's included). It
only falls as trials finish, so a cap read earlier is never below the true one: capping never stops a
trial that would have ranked. A shared curve replayed for a trial (:mod:`.sharing`) is capped the same
way, so a trial answered from a curve scores what it would have scored had it trained. Confirmation
and transfer-check runs are never capped (their whole run is the evidence), nor is the training of a
curve shared by several layouts (a slower layout's cap says nothing of a faster one's): the trial it
answers is. ``search.adaptive_capping: false`` runs every trial to its end. May import: optuna,
:mod:`paci_tune.config` and the tune layer's :mod:`.extra` and :mod:`.objective`.
"""

from __future__ import annotations

import optuna

from ..config.tune import SearchConfig
from .extra import best_distinct_trials
from .objective import Progress


def ranks_read(search: SearchConfig) -> int:
    """How many of a study's best points the search reads: confirmed, trained longer, or just the best."""
    confirm = search.confirm.top if search.confirm.enabled else 0
    transfer = search.transfer_check.top if search.transfer_check.enabled else 0
    return max(1, confirm, transfer)


def cap_of(study: optuna.Study, search: SearchConfig, budget: float) -> float | None:
    """The clock past which a search trial of ``study`` stops (None: none yet, or capping is off): the score of
    its ``k``-th best distinct finished point, when that point reached the target within the budget."""
    if not search.adaptive_capping:
        return None
    k = ranks_read(search)
    best = best_distinct_trials(study, k)
    value = best[-1].value if len(best) == k else None
    return float(value) if value is not None and value <= budget else None


def capped(progress: Progress, cap: float | None) -> bool:
    """Whether a trial that has shown ``progress`` is past ``cap`` without reaching the target (module docstring)."""
    return cap is not None and progress.reached_at is None and progress.clock > cap
