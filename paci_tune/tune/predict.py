"""PACI's statistical cost predicted from the synchronous curve: steps to target at (P, a, LR).

Synchronous schedules at one LR and optimizer share one curve (:mod:`.curves`), so their steps to target
are known once that curve is trained; PACI's curve differs by its staleness. A micro-batch's gradient at
stage ``s`` crosses ``floor((j + P-s-1) / a)`` updates for its phase ``j`` in the window: on average
``(P-s-1)/a``, at most ``ceil((P-s-1)/a)``. The model is multiplicative in log space:

    log(steps_paci / steps_sync(LR)) = c * x(P, a, LR) + noise,   noise ~ N(0, sigma^2)

with ``x`` one of the :data:`FORMS` (delayed SGD's extra term grows like sqrt(tau_max * tau_avg),
Koloskova et al. 2022; the stable LR falls like 1/tau, Giladi et al. 2019, hence the forms scaled by
the LR) and ``c`` fitted per optimizer by least squares through the origin (no delay: the synchronous
curve). The uncertainty is the residual spread plus the fit's own, floored by the noise of replicate
runs (:attr:`DelayModel.sigma_floor`): which form holds on this project's curves is measured in
docs/benchmarks.md, not assumed here. May import: nothing of paci_tune.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def stage_delays(stages: int, window: int) -> tuple[float, int]:
    """The mean over stages of a gradient's updates crossed, and the most any crosses (stage 0's bound)."""
    if stages < 1 or window < 1:
        raise ValueError(f"stages and window must be >= 1, got P={stages} a={window}")
    mean = sum((stages - s - 1) / window for s in range(stages)) / stages
    return mean, math.ceil((stages - 1) / window)


def _mean(p: int, a: int, lr: float) -> float:
    return stage_delays(p, a)[0]


def _max(p: int, a: int, lr: float) -> float:
    return float(stage_delays(p, a)[1])


def _sqrt(p: int, a: int, lr: float) -> float:
    mean, most = stage_delays(p, a)
    return math.sqrt(most * mean)


FORMS: dict[str, Callable[[int, int, float], float]] = {
    "mean": _mean,
    "max": _max,
    "sqrt": _sqrt,
    "mean*lr": lambda p, a, lr: _mean(p, a, lr) * lr,
    "sqrt*lr": lambda p, a, lr: _sqrt(p, a, lr) * lr,
}
"""The delay measures a model may use: ``x(P, a, lr_scale)``; each is 0 at P = 1 (PACI is then flush)."""


CENSORED_ROUNDS = 20
"""Refits with the misses imputed at max(bound, prediction): the slope only rises, and settles well within this."""


@dataclass(frozen=True)
class Observation:
    """One trained PACI point: its (P, a, LR scale) and its steps to target over the synchronous curve's at
    the same LR and optimizer (``ratio``); ``reached`` False: it missed, and ``ratio`` is a lower bound."""

    stages: int
    window: int
    lr_scale: float
    ratio: float
    reached: bool = True


@dataclass(frozen=True)
class Prediction:
    """Predicted steps to target over the synchronous curve's, with its log-space sd."""

    ratio: float
    log_sd: float

    def bounds(self, z: float) -> tuple[float, float]:
        """The ratio's interval at ``z`` standard deviations."""
        return self.ratio * math.exp(-z * self.log_sd), self.ratio * math.exp(z * self.log_sd)


@dataclass(frozen=True)
class DelayModel:
    """``log ratio = c * x`` for one form, fitted on observations (a miss as a lower bound).

    ``prior_c``, ``prior_sd``: the slope before any PACI run (a weak prior the observations outweigh);
    ``prior_sigma``: the residual sd until two runs give one; ``sigma_floor``: no prediction is surer than
    replicate runs of one point agree.
    """

    form: str = "mean"
    prior_c: float = 0.3
    prior_sd: float = 1.0
    prior_sigma: float = 0.3
    sigma_floor: float = 0.1

    def x(self, stages: int, window: int, lr_scale: float) -> float:
        return FORMS[self.form](stages, window, lr_scale)

    def fit(self, observed: Sequence[Observation]) -> Fitted:
        """The posterior of ``c`` (conjugate normal, the residual variance plugged in) and the residual sd.

        A miss (pruned, capped, out of budget) bounds its ratio from below only: it enters at the larger of
        its bound and the fit's own prediction, refitted until that settles (a censored fit by imputation),
        so a run capped late says "at least this slow" and one pruned at its first validation says nothing.
        """
        fitted = self._fit([(self.x(o.stages, o.window, o.lr_scale), math.log(o.ratio)) for o in observed if o.reached])
        censored = [(self.x(o.stages, o.window, o.lr_scale), math.log(o.ratio)) for o in observed if not o.reached]
        for _ in range(CENSORED_ROUNDS if censored else 0):
            reached = [(self.x(o.stages, o.window, o.lr_scale), math.log(o.ratio)) for o in observed if o.reached]
            fitted = self._fit(reached + [(x, max(y, fitted.c * x)) for x, y in censored])
        return fitted

    def _fit(self, points: list[tuple[float, float]]) -> Fitted:
        """The fit on (x, log ratio) points taken at their values."""
        sxx = sum(x * x for x, _ in points)
        if not points or sxx == 0.0:
            return Fitted(self, self.prior_c, self.prior_sd, max(self.sigma_floor, self.prior_sigma))
        c_ls = sum(x * y for x, y in points) / sxx
        resid = [y - c_ls * x for x, y in points]
        spread = math.sqrt(sum(r * r for r in resid) / (len(points) - 1)) if len(points) > 1 else self.prior_sigma
        sigma = max(self.sigma_floor, spread)
        precision = 1 / self.prior_sd**2 + sxx / sigma**2
        c = (self.prior_c / self.prior_sd**2 + c_ls * sxx / sigma**2) / precision
        return Fitted(self, c, math.sqrt(1 / precision), sigma)


@dataclass(frozen=True)
class Fitted:
    """A fitted :class:`DelayModel`: slope ``c`` with its sd, and the residual sd ``sigma``."""

    model: DelayModel
    c: float
    c_sd: float
    sigma: float

    def predict(self, stages: int, window: int, lr_scale: float) -> Prediction:
        x = self.model.x(stages, window, lr_scale)
        return Prediction(math.exp(self.c * x), math.sqrt(self.sigma**2 + (self.c_sd * x) ** 2))


def leave_one_out(model: DelayModel, observed: Sequence[Observation]) -> list[tuple[Observation, Prediction]]:
    """Each reached observation predicted by the model fitted on all the others."""
    out = []
    for i, o in enumerate(observed):
        if o.reached:
            rest = [r for j, r in enumerate(observed) if j != i]
            out.append((o, model.fit(rest).predict(o.stages, o.window, o.lr_scale)))
    return out
