"""The tuner's pure parts: search-space constraints, the objective's order, quota counting, best.yaml.

Oracles: divisor arithmetic and the model's unit count for spaces, the documented formula for
the objective, and hand-built Optuna studies whose best trials are known for ``best.yaml``.
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import yaml
from helpers.verdict_studies import best_of
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.errors import ConfigError
from paci_tune.tune.objective import Progress, grid_step, score
from paci_tune.tune.space import TrialParams, load_space
from paci_tune.tune.study import counted, exhausted


def _space(tmp_path: Path, doc: dict, **kw: int | None) -> object:
    p = tmp_path / "space.yaml"
    p.write_text(yaml.safe_dump(doc))
    args = {"global_batch": 32, "n_units": 6, "max_stages": None, **kw}
    return load_space(str(p), **args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- spaces
def test_fixed_batch_keeps_divisors_and_derives_the_window(tmp_path: Path) -> None:
    s = _space(tmp_path, {"stages": [2, 4], "microbatch_size": [3, 4, 8, 12, 16]})
    assert s.microbatch_size == (4, 8, 16)  # 3 and 12 do not divide 32
    points = s.grid("paci")
    assert len(points) == 2 * 3
    assert all(p.window * p.microbatch_size == 32 for p in points)


def test_stages_capped_by_units_and_by_devices_on_the_wall_clock(tmp_path: Path) -> None:
    doc = {"stages": [2, 4, 8], "microbatch_size": [8]}
    assert _space(tmp_path, doc).stages == (2, 4)  # 6 units
    assert _space(tmp_path, doc, n_units=10).stages == (2, 4, 8)
    assert _space(tmp_path, doc, n_units=10, max_stages=4).stages == (2, 4)


def test_log_range_is_powers_of_two_and_free_batch_multiplies_out(tmp_path: Path) -> None:
    s = _space(
        tmp_path,
        {
            "global_batch": "free",
            "stages": [2],
            "window": {"low": 2, "high": 16, "log": True},
            "microbatch_size": {"low": 3, "high": 9, "log": True},
        },
    )
    assert s.window == (2, 4, 8, 16) and s.microbatch_size == (4, 8)
    assert len(s.grid()) == 2 * 4 * 2  # both schedules
    assert {p.global_batch for p in s.grid()} == {a * b for a in (2, 4, 8, 16) for b in (4, 8)}


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"stages": [2], "microbatch_size": [5, 7]}, "space.microbatch_size"),  # no divisor of 32
        ({"stages": [8, 16], "microbatch_size": [4]}, "space.stages"),  # more stages than units
        ({"stages": [2], "microbatch_size": [4], "windw": [2]}, "space.windw"),
        ({"stages": [2], "microbatch_size": [4], "schedules": ["zb-h2"]}, "space.schedules"),
        ({"stages": [0, 2], "microbatch_size": [4]}, "space.stages"),
        ({"stages": [2], "microbatch_size": {"low": 8, "high": 4}}, "space.microbatch_size"),
        ({"stages": [2], "microbatch_size": [4], "lr_scale": {"low": 2, "high": 1}}, "space.lr_scale"),
    ],
)
def test_bad_spaces_name_the_key(tmp_path: Path, doc: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        _space(tmp_path, doc)
    assert e.value.key == key


def test_a_continuous_lr_has_no_grid(tmp_path: Path) -> None:
    s = _space(tmp_path, {"stages": [2], "microbatch_size": [4], "lr_scale": {"low": 0.5, "high": 2}})
    with pytest.raises(ConfigError):
        s.grid_params()


def test_shipped_spaces_give_every_schedule_the_same_full_space() -> None:
    """Every synchronous schedule, micro-batches down to 1, at least three LR scales (x0.5, x1, x2)."""
    for name in ("default", "cpu-small", "free-batch", "optimizers"):
        s = load_space(name, global_batch=512, n_units=26, max_stages=None)
        assert s.schedules == ("paci", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev", "gpipe"), name
        assert min(s.microbatch_size) == 1 and 1 in s.stages, name
        grid = s.lr_scale if not s.lr_is_range else (s.lr_scale[0], s.lr_scale[1])  # type: ignore[index]
        assert min(grid) <= 0.5 and max(grid) >= 2.0 and (s.lr_is_range or len(grid) >= 3), name
        pipelined = {p for p in s.stages if p >= 2}
        assert all(set(s.stages_of(x)) == pipelined for x in s.schedules if x != "1f1b"), name
        assert s.stages_of("1f1b") == list(s.stages), name  # P = 1 (no pipeline) is flush's


# ------------------------------------------------------------------------------- objective
def test_reached_beats_every_miss_and_closer_misses_rank_first() -> None:
    budget, target = 10.0, 2.0
    reached_late = score(9.99, 1.9, target, budget)
    miss_close = score(None, 2.1, target, budget)
    miss_far = score(None, 3.0, target, budget)
    assert reached_late == 9.99
    assert miss_close == pytest.approx(10.0 * (1 + 0.1 / 2.0))
    assert reached_late < budget < miss_close < miss_far
    assert score(None, None, target, budget) == math.inf


def test_progress_records_the_first_reaching_validation() -> None:
    p = Progress(target=2.0, budget=10.0)
    for clock, val in [(2.0, 2.5), (4.0, 1.9), (6.0, 1.8)]:
        p.add_eval(clock, val)
    assert p.reached_at == 4.0 and p.best_val == 1.8 and p.value == 4.0


def test_grid_step_maps_clock_to_rungs() -> None:
    assert [grid_step(c, 10.0, 5) for c in (2.0, 2.05, 3.99, 4.0, 9.9, 10.0, 11.0)] == [1, 1, 1, 2, 4, 5, 5]


# ------------------------------------------------------------------------ quota counting
def _trial(state: TrialState, value: float | None = None, **attrs: object) -> optuna.trial.FrozenTrial:
    return create_trial(
        state=state,
        value=value,
        params={"microbatch_size": 4},
        user_attrs=dict(attrs),
        distributions={"microbatch_size": CategoricalDistribution([4, 8])},
    )


def test_counted_skips_retried_failures_and_free_repeats() -> None:
    trials = [_trial(TrialState.COMPLETE, 1.0), _trial(TrialState.FAIL), _trial(TrialState.COMPLETE, 2.0)]
    for i, t in enumerate(trials):
        t.number = i
    trials.append(_trial(TrialState.COMPLETE, 1.0, repeat_of=0))
    trials[-1].number = 3
    assert counted(trials, quota=5) == 3  # the repeat is free
    trials.append(_trial(TrialState.RUNNING, retry_of=1))
    trials[-1].number = 4
    assert counted(trials, quota=5) == 3  # the failure was retried: its retry counts instead
    many = trials + [_trial(TrialState.COMPLETE, 1.0, repeat_of=0) for _ in range(12)]
    assert counted(many, quota=5) == 3 + (13 - 10)  # repeats beyond 2x the quota count


def test_counted_skips_queued_layouts_of_a_curve() -> None:
    trials = [
        _trial(TrialState.COMPLETE, 1.0),
        _trial(TrialState.COMPLETE, 2.0, sibling_of=0),
        _trial(TrialState.PRUNED, sibling_of=0),
    ]
    assert counted(trials, quota=5) == 1  # siblings.py: the simulator's cost, not a trial's


def test_a_space_is_exhausted_once_each_point_has_a_finished_search_trial() -> None:
    points = [{"microbatch_size": 4}, {"microbatch_size": 8}]
    eight = _trial(TrialState.PRUNED)
    eight.params = {"microbatch_size": 8}
    assert not exhausted([_trial(TrialState.COMPLETE, 1.0)], points)
    assert exhausted([_trial(TrialState.COMPLETE, 1.0), eight], points)
    assert not exhausted([_trial(TrialState.RUNNING), eight], points)  # running is not run
    assert not exhausted([_trial(TrialState.COMPLETE, 1.0, confirm={"of": 0, "seed": 1}), eight], points)
    assert not exhausted([], [])  # no points to enumerate (a continuous LR): never exhausted


# ----------------------------------------------------------------------------- best.yaml
# (the verdict and the confirmation's rounds: tests/test_verdict.py)
def test_no_finished_trial_is_a_clear_error() -> None:
    empty = optuna.create_study(direction="minimize")
    with pytest.raises(ConfigError):
        best_of({"paci": empty})


def test_trial_params_overrides_keep_the_batch_identity() -> None:
    p = TrialParams("paci", 4, 8, 4, 0.5)
    o = p.overrides()
    assert o["training.global_batch"] == 32 and o["pipeline.window"] * o["pipeline.microbatch_size"] == 32
