"""The verdict: one comparison of PACI's best pipelined point with the strongest synchronous point.

Oracles: scipy's paired t-test (``scipy.stats.ttest_1samp`` on the log time ratios) recomputed here from
the per-seed scores the studies hold; hand-built studies whose best points and misses are known; the
issue's figures (the README's three ratios 1.0029, 1.0883, 1.2247 give the t-interval [0.86, 1.41]).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers.verdict_studies import best_of, confirmed_study, search_study
from scipy import stats

from paci_tune.config.tune import ConfirmConfig
from paci_tune.errors import ConfigError
from paci_tune.tune.bestfile import read_best, write_best
from paci_tune.tune.comparison import METHOD, UNCONFIRMED, Comparison, Design
from paci_tune.tune.point import TrialParams
from paci_tune.tune.rounds import Round, current_round
from paci_tune.verdict.edges import lr_edges


def _t_interval(base: dict[int, float], paci: dict[int, float], level: float = 0.95) -> tuple[float, float]:
    logs = np.log([base[s] / paci[s] for s in sorted(base)])
    ci = stats.ttest_1samp(logs, 0.0).confidence_interval(confidence_level=level)
    return math.exp(ci.low), math.exp(ci.high)


# ------------------------------------------------------------------------------------ the test itself
def test_the_readmes_three_ratios_are_a_tie_under_the_paired_t_test() -> None:
    """The bootstrap this replaced called them `paci (95% interval 1.0029-1.2247)`: [min, max] at n = 3."""
    look = Design(3, 3).look([1.0029, 1.0883, 1.2247])
    assert (look.low, look.high) == pytest.approx((0.8583, 1.4138), abs=1e-4)
    assert look.verdict == "tie" and look.stopped_by == "max_seeds" and look.confidence == pytest.approx(0.95)
    assert look.speedup == pytest.approx(math.exp(np.mean(np.log([1.0029, 1.0883, 1.2247]))))


def test_the_looks_spend_alpha_and_no_more() -> None:
    """O'Brien-Fleming-type spending: the looks' alphas sum to 0.05 and grow toward the last."""
    d = Design(3, 8)
    spent = [d.alpha_at(n) for n in range(3, 9)]
    assert sum(spent) == pytest.approx(0.05) and all(a > 0 for a in spent)
    assert spent[0] < spent[-1] and d.alpha_at(2) == 0.0 and d.alpha_at(9) == 0.0
    assert Design(1, 4).first == 2 and Design(3, 3).alpha_at(3) == pytest.approx(0.05)  # one look: the plain test


def test_identical_arms_are_a_tie_with_an_interval_of_no_width() -> None:
    look = Design(3, 8).look([1.0, 1.0, 1.0])
    assert (look.low, look.high, look.verdict, look.stopped_by) == (1.0, 1.0, "tie", "narrow")


# ------------------------------------------------------------------------------------ best.yaml
def test_the_confirmed_verdict_is_scipys_paired_t_on_its_own_confirmation_scores(tmp_path: Path) -> None:
    paci = {1: 3.0, 2: 3.3, 3: 2.8}
    flush = {1: 6.0, 2: 5.5, 3: 6.4}
    best = best_of(
        {"paci": confirmed_study("paci", {8: paci}), "1f1b": confirmed_study("1f1b", {8: flush})},
        confirm_seeds=[1, 2, 3],
    )
    c = best["comparison"]
    assert c["interval"] == pytest.approx(_t_interval(flush, paci), abs=1e-4)
    assert c["ratios"] == pytest.approx({s: flush[s] / paci[s] for s in paci}, abs=1e-6)
    assert c["method"] == METHOD and c["n"] == 3 and c["seeds"] == [1, 2, 3] and c["stopped_by"] == "decided"
    assert best["verdict"] == c["verdict"] == "paci" and best["baseline_schedule"] == "1f1b"
    assert best["recommended"]["schedule"] == "paci"
    # what the acceptance check does: the first confirmed row of each schedule, held to the t-test
    rows = {s: {k: v["score"] for k, v in best["confirmation"][s][0]["seeds"].items()} for s in ("paci", "1f1b")}
    low, _ = _t_interval(rows["1f1b"], rows["paci"])
    assert low > 1.0
    write_best(tmp_path / "best.yaml", best)
    typed = read_best(tmp_path / "best.yaml", trainable=False)
    assert typed.verdict_record == Comparison.from_doc(c) and typed.verdict_record.verdict == "paci"


def test_the_compared_points_are_chosen_on_the_search_draws_not_the_confirmation() -> None:
    """PACI's b=4 had the best search draw; on the fresh seeds b=8 looks better, but picking it there would
    pick on the seeds that report it: the comparison keeps b=4, and with its spread that is a tie, so the
    synchronous point is recommended."""
    paci = confirmed_study("paci", {4: {1: 2.0, 2: 8.0, 3: 5.0}, 8: {1: 3.0, 2: 3.1, 3: 2.9}}, search={4: 1.0, 8: 2.0})
    best = best_of(
        {"paci": paci, "1f1b": confirmed_study("1f1b", {8: {1: 6.0, 2: 6.2, 3: 5.8}})}, confirm_seeds=[1, 2, 3]
    )
    c = best["comparison"]
    assert c["paci"]["point"] == "paci P=2 a=8 b=4" and c["paci"]["trial"] == "t.paci#0"
    assert c["verdict"] == "tie" and best["recommended"]["schedule"] == "1f1b"
    rows = {r["point"]: r for r in best["confirmation"]["paci"]}
    assert rows["paci P=2 a=4 b=8"]["mean"] == pytest.approx(3.0)  # confirmed and shown, not compared


def test_a_tie_recommends_the_synchronous_point_and_flush_wins_say_so() -> None:
    paci, flush = {1: 3.0, 2: 7.0, 3: 5.0}, {1: 4.0, 2: 6.0, 3: 5.5}
    tie = best_of(
        {"paci": confirmed_study("paci", {8: paci}), "1f1b": confirmed_study("1f1b", {8: flush})},
        confirm_seeds=[1, 2, 3],
    )
    low, high = tie["comparison"]["interval"]
    assert low < 1.0 < high and tie["verdict"] == "tie" and tie["recommended"]["schedule"] == "1f1b"
    slow = {1: 9.0, 2: 9.5, 3: 8.6}
    lost = best_of(
        {"paci": confirmed_study("paci", {8: slow}), "1f1b": confirmed_study("1f1b", {8: flush})},
        confirm_seeds=[1, 2, 3],
    )
    assert lost["verdict"] == "flush" and lost["comparison"]["interval"][1] < 1.0
    assert Comparison.from_doc(lost["comparison"]).sentence().startswith("flush -- flush wins")


def test_no_pipeline_is_said_when_the_whole_model_on_each_device_wins() -> None:
    flush = confirmed_study("1f1b", {8: {1: 3.0, 2: 3.1, 3: 2.9}}, stages=1)
    best = best_of(
        {"paci": confirmed_study("paci", {8: {1: 6.0, 2: 6.3, 3: 5.9}}), "1f1b": flush}, confirm_seeds=[1, 2, 3]
    )
    c = Comparison.from_doc(best["comparison"])
    assert c.verdict == "flush" and c.no_pipeline and "no pipeline" in c.sentence()
    assert best["recommended"]["schedule"] == "1f1b" and best["recommended"]["stages"] == 1


@pytest.mark.parametrize("who", ["1f1b", "paci"])
def test_a_confirmed_miss_leaves_the_verdict_undecided(who: str) -> None:
    """PACI is 2x faster on every seed, but one run of one side missed the target: its score is a penalty
    (a censored time), so there is no ratio of times to test."""
    miss = frozenset({(8, 2)})
    paci = confirmed_study("paci", {8: {1: 3.0, 2: 3.1, 3: 2.9}}, miss if who == "paci" else frozenset())
    flush = confirmed_study("1f1b", {8: {1: 6.0, 2: 6.2, 3: 5.8}}, miss if who == "1f1b" else frozenset())
    best = best_of({"paci": paci, "1f1b": flush}, confirm_seeds=[1, 2, 3], warm_started=True)
    c = best["comparison"]
    assert best["verdict"] == c["verdict"] == "undecided" and c["interval"] is None and c["stopped_by"] == "missed"
    side = "PACI" if who == "paci" else "the baseline"
    assert f"{side} on 1 of 3 compared run(s) missed the target" in c["reason"]
    assert "longer budget" in c["reason"] and "warm-up" in c["reason"]
    # the side that reached the target on every run is recommended
    assert best["recommended"]["schedule"] == ("1f1b" if who == "paci" else "paci")


def test_single_draws_are_an_anecdote_judged_at_the_validation_spacing() -> None:
    """Without a confirmation: no interval; within one validation interval (10 s / 5) a tie."""
    studies = {
        "paci": search_study("paci", [(8, 6.0, 6.0), (4, 3.0, 3.0)]),
        "1f1b": search_study("1f1b", [(16, 5.5, 5.5)]),
    }
    best = best_of(studies)
    c = best["comparison"]
    assert c["method"] == UNCONFIRMED and c["interval"] is None and c["n"] == 1
    assert best["verdict"] == "paci" and best["recommended"]["microbatch_size"] == 4
    assert c["speedup"] == pytest.approx(5.5 / 3.0, abs=1e-4)
    close = best_of({"paci": search_study("paci", [(8, 4.0, 4.0)]), "1f1b": search_study("1f1b", [(8, 5.0, 5.0)])})
    assert close["verdict"] == "tie" and close["recommended"]["schedule"] == "1f1b"
    never = best_of({"paci": search_study("paci", [(8, 6.0, 6.0)]), "1f1b": search_study("1f1b", [(8, None, 12.0)])})
    assert never["verdict"] == "undecided" and "missed the target" in never["comparison"]["reason"]


def test_an_interval_of_no_width_below_the_validation_spacing_is_a_tie() -> None:
    """Every seed reached the target at the same validation: the interval excludes 1, but the means differ by
    less than one validation interval (2 s), the resolution of time to target; 2.5 s apart it stands."""
    flush = confirmed_study("1f1b", {8: {1: 3.0, 2: 3.0, 3: 3.0}})
    close = best_of(
        {"paci": confirmed_study("paci", {8: {1: 3.5, 2: 3.5, 3: 3.5}}), "1f1b": flush}, confirm_seeds=[1, 2, 3]
    )
    assert close["comparison"]["interval"][1] < 1.0 and close["verdict"] == "tie"
    assert any("less than one validation interval" in n for n in close["comparison"]["notes"])
    apart = best_of(
        {"paci": confirmed_study("paci", {8: {1: 5.5, 2: 5.5, 3: 5.5}}), "1f1b": flush}, confirm_seeds=[1, 2, 3]
    )
    assert apart["verdict"] == "flush"


def test_a_single_stage_pacis_comparison_is_noted() -> None:
    """A space with only P = 1 (the A/A construction): PACI there trains flush's numbers."""
    best = best_of(
        {
            "paci": search_study("paci", [(8, 5.0, 5.0)], stages=1),
            "1f1b": search_study("1f1b", [(8, 5.0, 5.0)], stages=1),
        }
    )
    assert best["verdict"] == "tie" and any("single stage" in n for n in best["comparison"]["notes"])


def test_a_file_from_before_the_comparison_record_still_reads(tmp_path: Path) -> None:
    best = best_of({"paci": search_study("paci", [(8, 3.0, 3.0)]), "1f1b": search_study("1f1b", [(8, 6.0, 6.0)])})
    old = {k: v for k, v in best.items() if k not in ("comparison", "baseline_schedule")}
    old |= {"paci_speedup_vs_flush": 2.0, "paci_speedup_interval": [1.5, 2.5], "paci_won": True, "speedup_note": "x"}
    path = tmp_path / "best.yaml"
    path.write_text(__import__("yaml").safe_dump(old))
    typed = read_best(path, trainable=False)
    assert typed.verdict == "paci" and typed.verdict_record is None
    bad = {**old, "paci_won": "yes"}
    path.write_text(__import__("yaml").safe_dump(bad))
    with pytest.raises(ConfigError) as e:
        read_best(path, trainable=False)
    assert e.value.key == "best.yaml.paci_won"


# ------------------------------------------------------------------------------------ rounds
def _round(
    paci: dict[int, float],
    flush: dict[int, float],
    minimum: int = 3,
    cap: int = 5,
    missed: frozenset[tuple[int, int]] = frozenset(),
) -> Round:
    studies = {"paci": confirmed_study("paci", {8: paci}, missed), "1f1b": confirmed_study("1f1b", {8: flush})}
    return current_round(studies, 0, Design(minimum, cap))  # base seed 0: the fresh seeds are 1, 2, ...


def test_confirmation_stops_at_the_minimum_when_the_test_decides() -> None:
    assert _round({1: 3.0, 2: 3.1, 3: 2.9}, {1: 6.0, 2: 6.2, 3: 5.8}) == Round(3, "decided")


def test_confirmation_adds_a_paired_seed_while_undecided_and_stops_at_the_cap() -> None:
    paci = {1: 3.0, 2: 6.0, 3: 3.0, 4: 6.0, 5: 3.0}  # the ratio swings around 1 seed by seed: never decided
    flush = {1: 6.0, 2: 3.0, 3: 6.0, 4: 3.0, 5: 6.0}
    assert _round({s: paci[s] for s in (1, 2, 3)}, {s: flush[s] for s in (1, 2, 3)}) == Round(4, None)
    assert _round({s: paci[s] for s in (1, 2, 3)}, {s: flush[s] for s in (1, 2)}) == Round(3, None)  # still running
    assert _round(paci, flush) == Round(5, "max_seeds")


def test_a_miss_stops_the_confirmation() -> None:
    assert _round({1: 3.0, 2: 3.1, 3: 2.9}, {1: 6.0, 2: 6.2, 3: 5.8}, missed=frozenset({(8, 2)})) == Round(3, "missed")


def test_one_seed_decides_nothing_and_bad_rounds_are_refused() -> None:
    assert _round({1: 3.0}, {1: 6.0}, minimum=1, cap=3) == Round(2, None)  # 2x on one seed: no spread, no test
    for bad, key in (
        (ConfirmConfig(seeds=3, max_seeds=2), "max_seeds"),
        (ConfirmConfig(seeds=1, max_seeds=1), "max_seeds"),
        (ConfirmConfig(tolerance=0), "tolerance"),
    ):
        with pytest.raises(ConfigError) as e:
            bad.check("search.confirm")
        assert e.value.key == f"search.confirm.{key}"
    assert ConfirmConfig().cap == 8 and ConfirmConfig(seeds=10).cap == 10 and ConfirmConfig(max_seeds=3).cap == 3
    assert ConfirmConfig().top == 1


def test_an_interval_narrower_than_the_tolerance_is_a_tie_decided_around_one() -> None:
    assert _round({1: 3.0, 2: 3.01, 3: 2.99}, {1: 3.0, 2: 2.99, 3: 3.01}) == Round(3, "narrow")


# ------------------------------------------------------------------------------------ the LR edge rule
def test_a_compared_point_at_the_edge_of_its_lr_grid_is_named() -> None:
    top = TrialParams("1f1b", 1, 4, 8, 2.0, 4)
    mid = TrialParams("paci", 2, 4, 4, 1.0, 2)
    edges = lr_edges({"paci": mid, "1f1b": top}, [0.5, 1.0, 2.0])
    assert [(e["schedule"], e["edge"], e["lr_scale"]) for e in edges] == [("1f1b", "high", 2.0)]
    assert "widen lr_scale past x2" in edges[0]["note"]
    low = lr_edges({"paci": TrialParams("paci", 2, 4, 4, 0.52, 2)}, {"low": 0.5, "high": 2.0})  # a range: within 5%
    assert [e["edge"] for e in low] == ["low"]
    assert lr_edges({"paci": mid}, [1.0])[0]["edge"] == "both"  # the LR fixed: nothing tuned
    assert lr_edges({"paci": mid}, [0.5, 1.0, 2.0]) == []


def test_best_yaml_names_the_edge_and_the_verdict_notes_it() -> None:
    studies = {"paci": search_study("paci", [(8, 3.0, 3.0)]), "1f1b": search_study("1f1b", [(8, 6.0, 6.0)])}
    best = best_of(studies, lr_grid=[1.0, 2.0])  # every trial ran at x1: the low edge
    assert {e["schedule"] for e in best["lr_edges"]} == {"paci", "1f1b"}
    assert sum("edge of the LR grid" in n for n in best["comparison"]["notes"]) == 2
    assert "lr_edges" not in best_of(studies, lr_grid=[0.5, 1.0, 2.0])
