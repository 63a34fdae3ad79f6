"""Learning-rate schedule against hand-computed values; the partitioner against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from paci_tune.config import LRScheduleConfig, OptimizerConfig
from paci_tune.errors import ConfigError
from paci_tune.schedule.partition import balanced_partition, resolve_partition, stage_units
from paci_tune.train.lr import lr_factor, peak_lr, step_progress

# ---------------------------------------------------------------------------------------- LR


@pytest.mark.parametrize(
    ("progress", "warmup", "floor", "expected"),
    [
        (0.05, 0.1, 0.1, 0.5),  # half-way through warm-up
        (0.01, 0.1, 0.1, 0.1),
        (0.1, 0.1, 0.1, 1.0),  # end of warm-up: the peak
        (0.55, 0.1, 0.1, 0.55),  # half-way through the cosine: 0.1 + 0.9 * 0.5
        (1.0, 0.1, 0.1, 0.1),  # end of the budget: the floor
        (0.4, 0.2, 0.0, 0.5 * (1 + math.cos(math.pi / 4))),  # t = (0.4 - 0.2) / 0.8 = 1/4 of the cosine
        (0.0, 0.0, 0.1, 1.0),  # no warm-up starts at the peak
        (0.5, 0.0, 0.2, 0.6),  # 0.2 + 0.8 * 0.5
        (0.7, 0.0, 1.0, 1.0),  # min_ratio 1: constant
        (1.5, 0.1, 0.1, 0.1),  # progress past the budget is clamped
        (-0.5, 0.1, 0.1, 0.0),
    ],
)
def test_lr_factor_hand_values(progress: float, warmup: float, floor: float, expected: float):
    assert lr_factor(progress, warmup, floor) == pytest.approx(expected, abs=1e-12)


def test_lr_factor_is_continuous_and_monotone_after_warmup():
    xs = [i / 1000 for i in range(1001)]
    ys = [lr_factor(x, 0.05, 0.1) for x in xs]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(ys[:51]))  # warm-up up to progress 0.05
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(ys[50:]))
    assert max(abs(b - a) for a, b in itertools.pairwise(ys)) < 0.03


def test_step_progress_first_step_is_positive_and_last_is_one():
    assert step_progress(0, 10) == pytest.approx(0.1)
    assert step_progress(9, 10) == 1.0
    assert lr_factor(step_progress(0, 100), 0.01, 0.1) == pytest.approx(1.0)  # warm-up of one step


def test_peak_lr_scaling():
    opt = OptimizerConfig(lr=3e-4)
    sqrt = LRScheduleConfig(reference_batch=256, scaling="sqrt")
    assert peak_lr(opt, sqrt, 256) == pytest.approx(3e-4)
    assert peak_lr(opt, sqrt, 128) == pytest.approx(3e-4 * math.sqrt(0.5))
    assert peak_lr(opt, sqrt, 1024) == pytest.approx(6e-4)
    assert peak_lr(opt, LRScheduleConfig(reference_batch=256, scaling="linear"), 128) == pytest.approx(1.5e-4)
    assert peak_lr(opt, LRScheduleConfig(reference_batch=256, scaling="none"), 128) == pytest.approx(3e-4)
    assert peak_lr(opt, LRScheduleConfig(reference_batch=None), 128) == pytest.approx(3e-4)


# --------------------------------------------------------------------------------- partition


def brute_force(costs: list[float], stages: int) -> float:
    """Smallest possible largest-stage cost over every contiguous split."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balanced_partition_is_optimal_against_brute_force():
    rng = random.Random(1234)
    checked = 0
    for _ in range(400):
        n = rng.randint(1, 8)
        p = rng.randint(1, min(4, n))
        costs = [rng.choice([rng.uniform(0.1, 10.0), float(rng.randint(1, 5))]) for _ in range(n)]
        sizes = balanced_partition(costs, p)
        assert len(sizes) == p and sum(sizes) == n and min(sizes) >= 1, (costs, p, sizes)
        got = max(sum(costs[r.start : r.stop]) for r in stage_units(sizes))
        assert got == pytest.approx(brute_force(costs, p), abs=1e-9), (costs, p, sizes)
        checked += 1
    assert checked == 400


def test_balanced_partition_examples():
    assert balanced_partition([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_partition([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert balanced_partition([10, 1, 1, 1, 1], 2) == [1, 4]
    assert balanced_partition([1, 2, 3, 4, 5], 2) == [3, 2]  # 6 | 9
    with pytest.raises(ValueError):
        balanced_partition([1, 1], 3)
    with pytest.raises(ValueError):
        balanced_partition([1, 1], 0)


def test_resolve_partition():
    costs = [1.0] * 6
    assert resolve_partition("auto", costs, 3) == [2, 2, 2]
    assert resolve_partition([1, 4, 1], costs, 3) == [1, 4, 1]
    with pytest.raises(ConfigError) as e:
        resolve_partition("auto", costs, 7)
    assert e.value.key == "pipeline.stages" and e.value.value == 7
    for bad in ([1, 5], [2, 2, 1], [3, 3, 0], [1, 1, 1, 3]):
        with pytest.raises(ConfigError) as e:
            resolve_partition(bad, costs, 3)
        assert e.value.key == "pipeline.partition" and e.value.value == bad


def test_stage_units_are_contiguous_ranges():
    assert stage_units([2, 1, 3]) == [range(0, 2), range(2, 3), range(3, 6)]
