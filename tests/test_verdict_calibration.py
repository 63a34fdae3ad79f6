"""The verdict holds its stated level: at most 5% false winners under A/A, and power at a true 1.2x.

Oracle: simulated confirmations whose true times are known (equal, or 1.2x apart), at the noise the shipped
example's own confirmation runs showed (``bench/verdict_calibration.py``: a shared seed effect and each side's
run noise), driven through the real sequential rule with the shipped defaults; and a binomial bound on the
simulation's own error. The rule it replaced is run on the same draws as the negative control: it must
fail the same bound, or this test could not tell a bad rule from a good one. A handful of the simulated
confirmations also go through the whole path -- Optuna studies, ``current_round`` adding seeds round by
round, ``build_best`` -- and must end where :meth:`Design.settle` says.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
from helpers import REPO
from helpers.verdict_studies import best_of, confirmed_study

from paci_tune.tune.extra import confirm_seeds
from paci_tune.tune.rounds import current_round

_spec = importlib.util.spec_from_file_location("verdict_calibration", REPO / "bench" / "verdict_calibration.py")
assert _spec is not None and _spec.loader is not None
calibration = importlib.util.module_from_spec(_spec)
sys.modules["verdict_calibration"] = calibration  # its dataclasses look their module up
_spec.loader.exec_module(calibration)

NULLS = 4000
pytestmark = pytest.mark.slow  # thousands of simulated confirmations: about 40 s in all


def _bound(rate: float, n: int) -> float:
    """``rate`` plus two binomial standard errors of a share estimated from ``n`` draws."""
    return rate + 2 * math.sqrt(rate * (1 - rate) / n)


def test_false_winners_under_aa_stay_under_five_percent_and_the_old_rule_does_not() -> None:
    design = calibration.shipped_design()
    assert (design.min_seeds, design.max_seeds) == (3, 8)  # the defaults under test
    now = calibration.simulate(NULLS, 1.0, design=design)
    assert now.winners <= _bound(0.05, NULLS), now
    assert abs(now.paci - now.flush) < 0.02  # neither side favoured
    before = calibration.simulate(NULLS // 4, 1.0, design=design, legacy=True)  # the same first draws
    assert before.winners > _bound(0.05, NULLS // 4) and before.winners > 0.15, before  # ~1 in 3: it must fail


@pytest.mark.parametrize("sigma_run", [0.05, 0.10])
def test_the_level_holds_at_other_noise_levels(sigma_run: float) -> None:
    rates = calibration.simulate(2000, 1.0, sigma_run=sigma_run)
    assert rates.winners <= _bound(0.05, 2000), rates


def test_power_at_a_true_one_point_two_is_at_least_eighty_percent_within_the_default_seeds() -> None:
    faster = calibration.simulate(2000, 1.2)
    slower = calibration.simulate(2000, 1 / 1.2, seed=7)
    assert faster.correct >= 0.80 and slower.correct >= 0.80, (faster, slower)
    assert faster.flush == 0.0 and slower.paci == 0.0  # never the wrong winner
    assert 3 <= faster.seeds <= 8  # docs/benchmarks.md reports it: about 6 seeds on average


def test_the_whole_path_ends_where_the_rule_says() -> None:
    """Simulated scores written as confirmation trials, one round at a time as a search queues them."""
    design = calibration.shipped_design()
    base, paci = calibration.draws(12, 1.15, calibration.SIGMA_SEED, calibration.SIGMA_RUN, design.max_seeds, seed=3)
    for b, p in zip(base, paci, strict=True):
        want = design.settle(list(b / p), [False] * design.max_seeds)
        n = design.min_seeds
        while True:
            seeds = confirm_seeds(0, n)
            studies = {
                "paci": confirmed_study("paci", {8: {s: float(p[s - 1]) for s in seeds}}),
                "1f1b": confirmed_study("1f1b", {8: {s: float(b[s - 1]) for s in seeds}}),
            }
            now = current_round(studies, 0, design)
            if now.stopped_by is not None:
                break
            assert now.seeds == n + 1
            n = now.seeds
        assert (now.seeds, now.stopped_by) == (want.n, want.stopped_by)
        fine = {"clock": "sim", "seconds": 10.0, "grid": 10_000}  # time to target resolved to 1 ms: no resolution tie
        best = best_of(studies, confirm_seeds=confirm_seeds(0, now.seeds), design=design, budget=fine)
        assert best["verdict"] == want.verdict and best["comparison"]["stopped_by"] == want.stopped_by
        assert best["comparison"]["interval"] == pytest.approx([want.low, want.high], abs=1e-4)
