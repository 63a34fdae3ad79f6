"""Every layout of a curve: once a study has a curve, its other points of the same numerics cost the simulator only.

With shared curves (:mod:`.sharing`) a trial's curve is its numerics' alone, and a schedule's layout
dimensions do not change it: P, D, a and b for a synchronous schedule, D and b for PACI at a fixed
depth, window and cut, and b for PACI on one stage (flush). So when a search trial of a study has
a curve (trained, or read from another's), the study's other feasible points of the same class are
queued in the study (``sibling_of``: the trial's number) and answered from that curve, each on its
own layout's clock, like any shared trial.

Why queue them as trials rather than score them aside: the study stays a real Optuna study. Its
sampler learns from every layout of every curve it has, its pruner reads them, another worker or a
resumed search sees them in the storage, and its best point is chosen among them. The sampler's own
trials go to what changes the numbers -- the LR, the optimizer, PACI's depth and window -- and they
alone count toward ``search.trials`` (:func:`.study.counted`): the flush baseline gets every layout of
its space for the curves it trains.

A point is queued only where the stored curve holds every validation its run would score (a curve
cut short by the pruner may not): it never trains. A search of a continuous LR range has no grid
of points and queues nothing; a grid search runs every point already. May import: optuna,
:mod:`paci_tune.config`, :mod:`paci_tune.sim` (the profile), :mod:`paci_tune.errors` and the tune
layer's :mod:`.sharing`, :mod:`.curves`, :mod:`.space`, :mod:`.point`, :mod:`.record`, :mod:`.extra`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from ..config import derive_run
from ..errors import ConfigError
from ..sim.profile import Profile
from . import extra
from .curves import numerics_key
from .point import TrialParams
from .record import is_sibling, queue_sibling
from .sharing import Horizons, replay_points, stored_curve, walk
from .space import SearchSpace


@dataclass
class Siblings:
    """Queues the other layouts of a search trial's curve in its study (module docstring)."""

    space: SearchSpace
    horizons: Horizons
    trial_doc: Callable[[TrialParams], dict[str, Any]]  # a point's trial run, its curve made its numerics' alone
    profile: Profile
    first_step: int  # the warm start's step (0: a cold search)
    target: float

    def queue(self, study: optuna.Study, studies: Iterable[optuna.Study], of: int, params: TrialParams) -> int:
        """Queue in ``study`` each feasible point of ``params``' class it has not run or queued, whose run
        the stored curve covers; how many were queued."""
        key = self._key(params)
        found = stored_curve(studies, key) if key is not None else None
        if found is None:
            return 0
        try:
            points = self.space.grid(params.schedule)
        except ConfigError:  # a continuous LR range: no points to enumerate
            return 0
        # A queued trial's point is in Optuna's fixed parameters until it starts (another worker's, say).
        taken = [t.params or t.system_attrs.get("fixed_params", {}) for t in extra.search_trials(study)]
        grid, cls = self.horizons.grid(params), self.horizons.key_of(params)
        queued = 0
        for q in points:
            named = self.space.params_of(q)
            if named in taken or self.horizons.key_of(q) != cls:  # one class: one horizon, so one stored key
                continue
            replay = replay_points(derive_run(self.trial_doc(q)), self.profile, self.first_step, grid.every)
            if walk(replay, found[0], self.target, grid) is None:
                continue  # it would train: the stored curve stops short of a validation it scores
            queue_sibling(study, named, of)
            taken.append(named)
            queued += 1
        return queued

    def _key(self, q: TrialParams) -> str | None:
        """The numerics key a point's trial stores its curve under (its class's, at the class horizon)."""
        return numerics_key(derive_run(self.trial_doc(q)))


def waiting(study: optuna.Study) -> bool:
    """A layout queued by :class:`Siblings` waits in ``study`` (its search is not over until it ran)."""
    return any(is_sibling(t) for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
