"""PACI's statistical-cost model (:mod:`paci_tune.tune.predict`) and the planner's choice (:func:`paci_tune.tune.
planner.choose`).

Oracles: a step-by-step replay of one stage's 1F1B order under PACI (which backward each forward waits
for, and which updates fall between), numpy's least squares, the normal distribution's own coverage
(scipy), and hand-computed choices.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy import stats

from paci_tune.tune.planner import Candidate, choose, steps_to_target
from paci_tune.tune.point import TrialParams
from paci_tune.tune.predict import DelayModel, Observation, leave_one_out, stage_delays


def _crossed(stages: int, stage: int, window: int, micro: int) -> int:
    """Updates stage ``stage`` applies between micro-batch ``micro``'s forward and its backward, replayed in
    1F1B order: P-s-1 warm-up forwards, then forward/backward pairs; an update after every ``window``-th
    backward."""
    order: list[tuple[str, int]] = [("F", j) for j in range(stages - stage - 1)]
    f = b = 0
    f = len(order)
    while b <= micro:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    backwards = updates = 0
    at_forward = None
    for kind, j in order:
        if kind == "F" and j == micro:
            at_forward = updates
        if kind == "B":
            backwards += 1
            if j == micro:
                assert at_forward is not None
                return updates - at_forward
            if backwards % window == 0:
                updates += 1
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("stages", "window"), [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 3), (8, 8)])
def test_stage_delays_are_the_mean_and_most_updates_a_gradient_crosses(stages: int, window: int) -> None:
    per_stage = []
    for s in range(stages):
        seen = [_crossed(stages, s, window, j) for j in range(4 * stages * window, 4 * stages * window + window)]
        per_stage.append((sum(seen) / window, max(seen)))
    mean, most = stage_delays(stages, window)
    assert mean == pytest.approx(sum(m for m, _ in per_stage) / stages)
    assert most == max(m for _, m in per_stage)


def test_the_fit_recovers_the_slope_numpy_finds_and_a_prior_pulls_a_lone_point() -> None:
    rng = random.Random(0)
    points = [(p, a, lr) for p in (2, 4, 8) for a in (1, 2, 4, 8) for lr in (1.0, 2.0)]
    model = DelayModel(form="sqrt", prior_sd=1e6, sigma_floor=0.0)
    xs = np.array([model.x(*q) for q in points])
    ys = 0.4 * xs + np.array([rng.gauss(0, 0.05) for _ in points])
    obs = [Observation(p, a, lr, math.exp(y)) for (p, a, lr), y in zip(points, ys, strict=True)]
    fitted = model.fit(obs)
    c_np = np.linalg.lstsq(xs[:, None], ys, rcond=None)[0][0]
    assert fitted.c == pytest.approx(c_np, rel=1e-6)
    resid = ys - c_np * xs
    assert fitted.sigma == pytest.approx(math.sqrt(float(resid @ resid) / (len(ys) - 1)), rel=1e-6)
    lone = DelayModel(form="mean", prior_c=0.3, prior_sd=0.1).fit([Observation(4, 1, 1.0, math.exp(3.0))])
    assert 0.3 < lone.c < 3.0 / 1.5, "one point moves the slope from the prior toward it, not all the way"
    assert DelayModel().fit([]).c == 0.3  # no PACI run yet: the prior


def test_the_interval_holds_its_level_on_data_the_model_describes() -> None:
    """Held-out points drawn from the model's own law (log ratio = c x + N(0, 0.2)): the 95% interval
    covers about 95% of them (binomial test at the 1% level)."""
    rng = random.Random(1)
    points = [(p, a, lr) for p in (2, 4, 8) for a in (1, 2, 4, 8) for lr in (0.5, 1.0, 2.0)]
    model = DelayModel(form="mean", sigma_floor=0.0)
    inside = total = 0
    for _ in range(40):
        obs = [Observation(p, a, lr, math.exp(0.5 * model.x(p, a, lr) + rng.gauss(0, 0.2))) for p, a, lr in points]
        for o, pred in leave_one_out(model, obs):
            low, high = pred.bounds(stats.norm.ppf(0.975))
            inside += low <= o.ratio <= high
            total += 1
    assert stats.binomtest(inside, total, 0.95).pvalue > 0.01, inside / total


def _candidate(stages: int, window: int, step_s: float, sync: float | None, budget: int = 1000) -> Candidate:
    q = TrialParams("paci", stages, window, 32 // window)
    return Candidate(q, f"P{stages}a{window}", step_s, budget, sync)


def test_choose_trains_the_best_prediction_that_could_beat_the_best_and_stops_when_none_could() -> None:
    fitted = DelayModel(form="mean", prior_c=0.5, prior_sd=1e-9, prior_sigma=0.2).fit([])
    near = _candidate(2, 4, 0.010, 100.0)  # mean delay 1/8: ratio exp(0.0625), 1.06 s predicted
    far = _candidate(8, 1, 0.008, 100.0)  # mean delay 3.5: ratio exp(1.75), 4.6 s predicted
    assert choose([far, near], {None: fitted}, math.inf, 1.0) is near
    # The best trained so far at 0.9 s: the near one's optimistic time exp(0.0625 - 0.2) * 1.0 = 0.87 s beats it.
    assert choose([far, near], {None: fitted}, 0.9, 1.0) is near
    assert choose([far, near], {None: fitted}, 0.85, 1.0) is None
    blind = _candidate(4, 2, 0.010, None)  # its synchronous curve failed: it cannot be predicted, so it trains
    assert choose([far, blind], {None: fitted}, 0.5, 1.0) is blind
    assert choose([_candidate(2, 4, 0.010, 100.0, budget=50)], {None: fitted}, math.inf, 1.0) is None


def test_steps_to_target_counts_from_the_warm_start_and_bounds_a_miss() -> None:
    curve = {110: 3.1, 120: 2.9, 130: 2.7}
    assert steps_to_target(curve, 2.95, 100) == (20.0, True)
    assert steps_to_target(curve, 2.5, 100) == (30.0, False)


def test_a_miss_is_a_lower_bound_not_a_value() -> None:
    """A run pruned at its first validation (a bound far below the law) leaves the fit as it was; a run
    capped past the law's prediction (a bound above it) raises the slope until the fit reaches the bound."""
    model = DelayModel(form="mean", prior_sd=1e6, sigma_floor=0.0)
    law = [Observation(p, a, 1.0, math.exp(0.5 * model.x(p, a, 1.0) + e)) for p, a, e in [(2, 1, 0.02), (4, 2, -0.02)]]
    base = model.fit(law)
    early = model.fit([*law, Observation(8, 1, 1.0, 0.05, reached=False)])
    assert early.c == pytest.approx(base.c, rel=1e-9)
    x = model.x(8, 1, 1.0)
    late = model.fit([*law, Observation(8, 1, 1.0, math.exp(1.5 * x), reached=False)])
    assert late.c > base.c * 1.5, "a miss bounded well above the prediction must raise the slope"
    assert late.predict(8, 1, 1.0).ratio <= math.exp(1.5 * x) * 1.0001
