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
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.errors import ConfigError
from paci_tune.tune.bestfile import write_best
from paci_tune.tune.objective import Progress, grid_step, score
from paci_tune.tune.space import TrialParams, load_space
from paci_tune.tune.study import counted, exhausted
from paci_tune.verdict.best import build_best


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
    s = _space(tmp_path, {"global_batch": "free", "stages": [2], "window": {"low": 2, "high": 16, "log": True},
                          "microbatch_size": {"low": 3, "high": 9, "log": True}})  # fmt: skip
    assert s.window == (2, 4, 8, 16) and s.microbatch_size == (4, 8)
    assert len(s.grid()) == 2 * 4 * 2  # both schedules
    assert {p.global_batch for p in s.grid()} == {a * b for a in (2, 4, 8, 16) for b in (4, 8)}


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"stages": [2], "microbatch_size": [5, 7]}, "space.microbatch_size"),  # no divisor of 32
        ({"stages": [8, 16], "microbatch_size": [4]}, "space.stages"),  # more stages than units
        ({"stages": [2], "microbatch_size": [4], "windw": [2]}, "space.windw"),
        ({"stages": [2], "microbatch_size": [4], "schedules": ["gpipe"]}, "space.schedules"),
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


def test_shipped_spaces_load() -> None:
    for name in ("default", "cpu-small", "free-batch", "optimizers"):
        s = load_space(name, global_batch=512, n_units=26, max_stages=None)
        assert s.schedules == ("paci", "1f1b")


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
        state=state, value=value, params={"microbatch_size": 4}, user_attrs=dict(attrs),
        distributions={"microbatch_size": CategoricalDistribution([4, 8])},
    )  # fmt: skip


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
    trials = [_trial(TrialState.COMPLETE, 1.0), _trial(TrialState.COMPLETE, 2.0, sibling_of=0),
              _trial(TrialState.PRUNED, sibling_of=0)]  # fmt: skip
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
def _study(schedule: str, results: list[tuple[int, float | None, float]], stages: int = 2) -> optuna.Study:
    """A study whose trials are (micro-batch size, time to target or None, score), all at depth ``stages``."""
    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    dists = {"stages": CategoricalDistribution([1, 2, 4]), "microbatch_size": CategoricalDistribution([4, 8, 16])}
    for b, ttt, value in results:
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=value, params={"stages": stages, "microbatch_size": b},
            distributions=dists, user_attrs={"time_to_target": ttt, "best_val_loss": 1.0, "partition": [1, 1]},
        ))  # fmt: skip
    study.add_trial(create_trial(state=TrialState.PRUNED, params={"stages": 4, "microbatch_size": 4},
                                 distributions=dists, intermediate_values={1: 0.1}))  # fmt: skip
    return study


def _best(studies: dict[str, optuna.Study]) -> dict:
    return build_best(
        studies, run_doc_for=lambda p: {"pipeline": {"schedule": p.schedule}}, base_lr=1e-3, fixed_batch=32,
        target={"metric": "val_loss", "value": 2.0}, budget={"clock": "sim", "seconds": 10.0, "grid": 5},
        provenance={"study_name": "t"},
    )  # fmt: skip


def test_best_recommends_the_fastest_and_states_the_speedup_over_flush(tmp_path: Path) -> None:
    studies = {"paci": _study("paci", [(8, 6.0, 6.0), (4, 3.0, 3.0)]), "1f1b": _study("1f1b", [(16, 5.5, 5.5)])}
    best = _best(studies)
    rec = best["recommended"]
    assert (rec["schedule"], rec["microbatch_size"], rec["window"]) == ("paci", 4, 8)
    assert best["baseline"]["microbatch_size"] == 16 and best["baseline"]["window"] == 2
    assert best["speedup_vs_flush"] == pytest.approx(5.5 / 3.0, abs=1e-4)
    assert best["paci_won"] is True and best["verdict"] == "paci"  # 2.5 s apart: more than one 2 s grid step
    assert "not confirmed" in best["speedup_note"]
    counts = {"complete": 2, "pruned": 1, "failed": 0, "repeats_reused": 0, "confirmation": 0}
    assert best["provenance"]["trials"]["paci"] == counts
    assert best["run"] == {"pipeline": {"schedule": "paci"}}
    out = tmp_path / "best.yaml"
    write_best(out, best)
    assert yaml.safe_load(out.read_text())["speedup_vs_flush"] == best["speedup_vs_flush"]


def test_best_says_when_flush_wins_and_when_it_never_reached() -> None:
    flush_wins = _best({"paci": _study("paci", [(8, 6.0, 6.0)]), "1f1b": _study("1f1b", [(8, 5.0, 5.0)])})
    assert flush_wins["recommended"]["schedule"] == "1f1b"
    assert flush_wins["speedup_vs_flush"] == 1.0
    assert flush_wins["paci_won"] is False
    assert flush_wins["paci_speedup_vs_flush"] == pytest.approx(5.0 / 6.0, abs=1e-4)
    never = _best({"paci": _study("paci", [(8, 6.0, 6.0)]), "1f1b": _study("1f1b", [(8, None, 12.0)])})
    assert never["speedup_vs_flush"] == pytest.approx(2.0) and "missed the target" in never["speedup_note"]
    close = _best({"paci": _study("paci", [(8, 4.0, 4.0)]), "1f1b": _study("1f1b", [(8, 5.0, 5.0)])})
    assert close["verdict"] == "tie" and close["paci_won"] is False  # within one validation interval
    assert "single stage" not in (close["speedup_note"] or "")


def test_best_says_when_pacis_best_is_a_single_stage() -> None:
    """At P = 1 PACI has no pipeline and nothing stale: its win over flush is the flush study's miss."""
    one = _best({"paci": _study("paci", [(8, 2.0, 2.0)], stages=1), "1f1b": _study("1f1b", [(8, 5.0, 5.0)])})
    assert one["verdict"] == "paci"  # the verdict stands (it is what was measured); the note says what it means
    assert "single stage (P=1" in one["speedup_note"] and "flush study did not find" in one["speedup_note"]


def test_no_finished_trial_is_a_clear_error() -> None:
    empty = optuna.create_study(direction="minimize")
    with pytest.raises(ConfigError):
        _best({"paci": empty})


def test_trial_params_overrides_keep_the_batch_identity() -> None:
    p = TrialParams("paci", 4, 8, 4, 0.5)
    o = p.overrides()
    assert o["training.global_batch"] == 32 and o["pipeline.window"] * o["pipeline.microbatch_size"] == 32


# ----------------------------------------------------------------------------- confirmation
def _confirmed_study(
    schedule: str, points: dict[int, dict[int, float]], missed: frozenset[tuple[int, int]] = frozenset()
) -> optuna.Study:
    """Search trials (micro-batch size -> its search score) plus confirmation trials per seed; the
    (micro-batch size, seed) runs in ``missed`` did not reach the target (no time to target)."""
    from paci_tune.tune.extra import confirm_plan as plan
    from paci_tune.tune.record import CONFIRM as CONFIRM_ATTR

    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    dists = {"stages": CategoricalDistribution([2, 4]), "microbatch_size": CategoricalDistribution([4, 8, 16])}
    numbers = {}
    for b, seeds in points.items():
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=min(seeds.values()) - 1.0,  # the lucky draw
                                     params={"stages": 2, "microbatch_size": b}, distributions=dists,
                                     user_attrs={"time_to_target": 1.0}))  # fmt: skip
        numbers[b] = study.trials[-1].number
    assert plan(study, top=len(points)) == sorted(numbers.values(), key=lambda n: study.trials[n].value)
    for b, seeds in points.items():
        for seed, value in seeds.items():
            attrs = {CONFIRM_ATTR: {"of": numbers[b], "seed": seed},
                     "time_to_target": None if (b, seed) in missed else value}  # fmt: skip
            study.add_trial(create_trial(state=TrialState.COMPLETE, value=value, distributions=dists,
                                         params={"stages": 2, "microbatch_size": b}, user_attrs=attrs))  # fmt: skip
    return study


def _best_confirmed(studies: dict[str, optuna.Study]) -> dict:
    return build_best(
        studies, run_doc_for=lambda p: {"b": p.microbatch_size}, base_lr=1e-3, fixed_batch=32,
        target={"metric": "val_loss", "value": 2.0}, budget={"clock": "sim", "seconds": 10.0, "grid": 5},
        provenance={"study_name": "t"}, confirm_seeds=[1, 2, 3],
    )  # fmt: skip


def test_confirmation_ranks_by_the_mean_over_fresh_seeds_not_the_lucky_draw() -> None:
    # b=4 had the best search draw (1.0) but confirms worse (mean 5) than b=8 (mean 3).
    paci = _confirmed_study("paci", {4: {1: 2.0, 2: 8.0, 3: 5.0}, 8: {1: 3.0, 2: 3.1, 3: 2.9}})
    flush = _confirmed_study("1f1b", {8: {1: 6.0, 2: 6.2, 3: 5.8}})
    best = _best_confirmed({"paci": paci, "1f1b": flush})
    assert best["recommended"]["microbatch_size"] == 8 and best["run"] == {"b": 8}
    rows = {r["point"]: r for r in best["confirmation"]["paci"]}
    assert rows["paci P=2 a=4 b=8"]["mean"] == pytest.approx(3.0) and len(rows["paci P=2 a=4 b=8"]["seeds"]) == 3
    assert best["paci_speedup_vs_flush"] == pytest.approx(6.0 / 3.0, abs=1e-3)
    low, high = best["paci_speedup_interval"]
    assert 1.0 < low <= 2.0 <= high  # paired seeds, every resample favours PACI: the interval excludes 1
    assert best["verdict"] == "paci" and best["paci_won"] is True
    assert best["provenance"]["trials"]["paci"]["confirmation"] == 6


def test_an_interval_of_no_width_below_the_validation_spacing_is_a_tie() -> None:
    """Every seed reached the target at the same validation (the warm-start check: [0.9606, 0.9606]): the
    interval excludes 1, but the means differ by less than one validation interval (10 s / 5 = 2 s here),
    the resolution of time to target, so the verdict is a tie; 2.5 s apart it stands."""
    flush = _confirmed_study("1f1b", {8: {1: 3.0, 2: 3.0, 3: 3.0}})
    close = _best_confirmed({"paci": _confirmed_study("paci", {8: {1: 3.5, 2: 3.5, 3: 3.5}}), "1f1b": flush})
    _, high = close["paci_speedup_interval"]
    assert high < 1.0 and close["verdict"] == "tie" and "less than one validation interval" in close["speedup_note"]
    apart = _best_confirmed({"paci": _confirmed_study("paci", {8: {1: 5.5, 2: 5.5, 3: 5.5}}), "1f1b": flush})
    assert apart["verdict"] == "flush"


def test_an_interval_that_contains_one_is_a_tie() -> None:
    paci = _confirmed_study("paci", {8: {1: 3.0, 2: 7.0, 3: 5.0}})
    flush = _confirmed_study("1f1b", {8: {1: 4.0, 2: 6.0, 3: 5.5}})
    best = _best_confirmed({"paci": paci, "1f1b": flush})
    low, high = best["paci_speedup_interval"]
    assert low < 1.0 < high and best["verdict"] == "tie" and best["paci_won"] is False


@pytest.mark.parametrize("who", ["1f1b", "paci"])
def test_a_confirmed_run_that_missed_the_target_leaves_the_verdict_undecided(who: str) -> None:
    """The interval excludes 1 (PACI 2x faster on every seed), but one seed of one schedule scored the
    not-reached penalty: the ratio is then not a ratio of times to accuracy, so there is no verdict."""
    miss = frozenset({(8, 2)})
    paci = _confirmed_study("paci", {8: {1: 3.0, 2: 3.1, 3: 2.9}}, miss if who == "paci" else frozenset())
    flush = _confirmed_study("1f1b", {8: {1: 6.0, 2: 6.2, 3: 5.8}}, miss if who == "1f1b" else frozenset())
    best = _best_confirmed({"paci": paci, "1f1b": flush})
    low, _ = best["paci_speedup_interval"]
    assert low > 1.0  # the comparison is still shown
    assert best["verdict"] == "undecided" and best["paci_won"] is False
    reason = best["verdict_reason"]
    name = "PACI's best" if who == "paci" else "flush's best"
    assert f"{name} on 1 of 3 confirmed runs" in reason
    assert "longer budget" in reason and "looser target" in reason and "warm start" in reason


def test_undecided_survives_the_best_yaml_round_trip_and_the_report_sentence(tmp_path: Path) -> None:
    from paci_tune.report.summary import verdict_sentence
    from paci_tune.tune.bestfile import read_best

    paci = _confirmed_study("paci", {8: {1: 3.0, 2: 3.1, 3: 2.9}})
    flush = _confirmed_study("1f1b", {8: {1: 6.0, 2: 6.2, 3: 5.8}}, frozenset({(8, 1), (8, 3)}))
    best = _best_confirmed({"paci": paci, "1f1b": flush})
    write_best(tmp_path / "best.yaml", best)
    typed = read_best(tmp_path / "best.yaml", trainable=False)
    assert typed.verdict == "undecided" and typed.verdict_reason == best["verdict_reason"]

    class _Ev:  # what verdict_sentence reads of the report's evidence
        name, clock = "t", "sim"

    _Ev.best = typed  # type: ignore[attr-defined]
    sentence = verdict_sentence(_Ev())  # type: ignore[arg-type]
    assert sentence.startswith("Verdict: undecided") and "flush's best on 2 of 3 confirmed runs" in sentence


# ------------------------------------------------------------------ confirmation until decided
def _round(paci: dict[int, float], flush: dict[int, float], minimum: int = 3, cap: int = 5) -> object:
    from paci_tune.tune.rounds import current_round

    studies = {"paci": _confirmed_study("paci", {8: paci}), "1f1b": _confirmed_study("1f1b", {8: flush})}
    return current_round(studies, 0, minimum, cap, 0.1)  # base seed 0: the fresh seeds are 1, 2, ...


def test_confirmation_stops_at_the_minimum_when_the_interval_already_excludes_one() -> None:
    from paci_tune.tune.rounds import Round

    assert _round({1: 3.0, 2: 3.1, 3: 2.9}, {1: 6.0, 2: 6.2, 3: 5.8}) == Round(3, "excludes_1")


def test_confirmation_adds_a_paired_seed_while_undecided_and_stops_at_the_cap() -> None:
    from paci_tune.tune.rounds import Round

    paci = {1: 3.0, 2: 6.0, 3: 3.0, 4: 6.0, 5: 3.0}  # the ratio swings around 1 seed by seed: never decided
    flush = {1: 6.0, 2: 3.0, 3: 6.0, 4: 3.0, 5: 6.0}
    assert _round({s: paci[s] for s in (1, 2, 3)}, {s: flush[s] for s in (1, 2, 3)}) == Round(4, None)
    assert _round({s: paci[s] for s in (1, 2, 3)}, {s: flush[s] for s in (1, 2)}) == Round(3, None)  # still running
    assert _round(paci, flush) == Round(5, "max_seeds")


def test_one_seed_decides_nothing_and_bad_rounds_are_refused() -> None:
    from paci_tune.config.tune import ConfirmConfig
    from paci_tune.tune.rounds import Round

    assert _round({1: 3.0}, {1: 6.0}, minimum=1, cap=3) == Round(2, None)  # 2x on one seed: no interval yet
    with pytest.raises(ConfigError) as e:
        ConfirmConfig(seeds=3, max_seeds=2).check("search.confirm")
    assert e.value.key == "search.confirm.max_seeds"
    with pytest.raises(ConfigError) as e:
        ConfirmConfig(tolerance=0).check("search.confirm")
    assert e.value.key == "search.confirm.tolerance"
    assert ConfirmConfig(seeds=3).cap == 6 and ConfirmConfig(seeds=3, max_seeds=3).cap == 3


def test_an_interval_narrower_than_the_tolerance_is_decided_even_around_one() -> None:
    from paci_tune.tune.rounds import Round, decided

    assert _round({1: 3.0, 2: 3.01, 3: 2.99}, {1: 3.0, 2: 2.99, 3: 3.01}) == Round(3, "narrow")
    assert decided(1.0, 0.96, 1.05, 0.1) == "narrow" and decided(1.0, 0.9, 1.1, 0.1) is None
    assert decided(1.2, 1.01, 1.5, 0.1) == "excludes_1" and decided(0.8, 0.5, 0.99, 0.1) == "excludes_1"


def test_the_bootstrap_interval_against_its_definition() -> None:
    """Oracle: the ratio of means, and an interval that shrinks to the point when every seed agrees."""
    from paci_tune.verdict.confirm import Confirmed, paired_speedup

    p = TrialParams("paci", 2, 4, 8)
    same = paired_speedup(Confirmed(0, p, {1: 4.0, 2: 4.0, 3: 4.0}), Confirmed(1, p, {1: 2.0, 2: 2.0, 3: 2.0}))
    assert same == pytest.approx((2.0, 2.0, 2.0))
    point, low, high = paired_speedup(Confirmed(0, p, {1: 4.0, 2: 6.0}), Confirmed(1, p, {1: 2.0, 2: 2.0, 3: 9.0}))
    assert point == pytest.approx(5.0 / 2.0)  # only the seeds both ran count
    assert low == pytest.approx(2.0) and high == pytest.approx(3.0)
