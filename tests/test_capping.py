"""Adaptive capping (paci_tune.tune.capping): a search trial stops once it cannot rank, and nothing that ranks changes.

Oracles: a hand-built study for the cap's definition (the k-th best distinct reached score); and for the
search, the same search with ``search.adaptive_capping: false``. Both run the same trials up to the first
capped one, so that trial's uncapped twin shows what it would have scored: more than the cap it was
stopped at, so it could not have ranked; and the capped run is its twin's, scored up to its first
validation past the cap and no further.
"""

from __future__ import annotations

import copy
from pathlib import Path

import optuna
import yaml
from helpers.cli import check_ok
from helpers.searches import quick_search, run, search_cmd, studies
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.config.tune import SearchConfig
from paci_tune.tune.capping import cap_of, capped, ranks_read
from paci_tune.tune.objective import Progress
from paci_tune.tune.record import TrialRecord


def _study(results: list[tuple[int, TrialState, float | None, dict]]) -> optuna.Study:
    study = optuna.create_study(direction="minimize")
    dist = {"microbatch_size": CategoricalDistribution([1, 2, 3, 4, 5])}
    for b, state, value, attrs in results:
        study.add_trial(
            create_trial(state=state, value=value, params={"microbatch_size": b}, distributions=dist, user_attrs=attrs)
        )
    return study


def _search(**kw: object) -> SearchConfig:
    s = SearchConfig()
    for k, v in kw.items():
        if k in ("confirm", "transfer_check"):
            for kk, vv in v.items():  # type: ignore[attr-defined]
                setattr(getattr(s, k), kk, vv)
        else:
            setattr(s, k, v)
    return s


def test_the_cap_is_the_kth_best_distinct_point_that_reached_the_target() -> None:
    C = TrialState.COMPLETE
    study = _study(
        [
            (1, C, 3.0, {}),
            (2, C, 1.0, {}),
            (2, C, 1.0, {"repeat_of": 1}),  # a repeat is the same point
            (3, C, 2.5, {"confirm": {"of": 1, "seed": 1}}),  # a confirmation is not a search trial
            (4, TrialState.PRUNED, None, {}),
            (5, C, 12.0, {}),  # past the 10 s budget: a miss's penalty score
        ]
    )
    one = _search(confirm={"top": 0})
    assert ranks_read(one) == 1 and cap_of(study, one, 10.0) == 1.0
    two = _search(confirm={"top": 2, "seeds": 3})
    assert ranks_read(two) == 2 and cap_of(study, two, 10.0) == 3.0
    three = _search(confirm={"top": 1}, transfer_check={"top": 3})
    assert ranks_read(three) == 3 and cap_of(study, three, 10.0) is None  # the 3rd best missed the target
    assert cap_of(_study([(1, C, 3.0, {})]), two, 10.0) is None  # fewer finished points than ranks read
    assert cap_of(study, _search(confirm={"top": 0}, adaptive_capping=False), 10.0) is None


def test_a_trial_is_capped_only_past_the_cap_and_short_of_the_target() -> None:
    p = Progress(target=2.0, budget=10.0)
    p.add_eval(3.0, 2.5)
    assert not capped(p, None) and not capped(p, 3.0) and capped(p, 2.9)  # strictly past: a tie still ranks
    p.add_eval(4.0, 1.9)
    assert not capped(p, 2.9)  # it reached the target: it scores its time, whatever it is


def _capping_search(tmp: Path, on: bool) -> dict[str, optuna.Study]:
    """bench/search_seeds.py's QUICK search (rst clock, hand-written profile) with five trials per schedule,
    no confirmation and no pruner (an uncapped trial runs to its end: its score is the oracle), capping on or off."""
    seeds = quick_search()
    tmp.mkdir()
    (tmp / "profile.yaml").write_text(yaml.safe_dump(seeds.QUICK_PROFILE))
    (tmp / "space.yaml").write_text(yaml.safe_dump({**seeds.QUICK_SPACE, "lr_scale": [0.5, 1.0, 2.0]}))
    doc = copy.deepcopy(seeds.QUICK)
    doc["budget"].update({"profile": str(tmp / "profile.yaml"), "seconds": 0.4})
    doc["target"]["value"] = 3.25  # reached at different times by different points, missed by some
    doc["search"] = {
        **doc["search"],
        "trials": 5,
        "seed": 3,
        "space": str(tmp / "space.yaml"),
        "pruner": "none",
        "confirm": {"top": 0},
        "adaptive_capping": on,
        "jobs": 1,
    }
    config = tmp / "quick.yaml"
    config.write_text(yaml.safe_dump(doc))
    check_ok(run(search_cmd(config, tmp)))
    return studies(f"sqlite:///{tmp / 'work' / 'study.db'}", "quick")


def test_a_capped_trial_could_not_have_ranked_and_stopped_at_the_cap(tmp_path: Path) -> None:
    on, off = _capping_search(tmp_path / "on", True), _capping_search(tmp_path / "off", False)
    firsts = []
    for schedule, study in on.items():
        trials = study.get_trials(deepcopy=False)
        cut = [t for t in trials if TrialRecord.read(t).capped_at is not None]
        if not cut:
            continue
        first = cut[0]
        twin = off[schedule].get_trials(deepcopy=False)[first.number]
        assert twin.params == first.params  # the same search up to here
        earlier = [t for t in trials if t.number < first.number and t.state == TrialState.COMPLETE]
        cap = min(t.value for t in earlier)  # no confirmation: the best point is the only rank read
        assert TrialRecord.read(first).capped_at == cap
        assert twin.state == TrialState.COMPLETE and twin.value > cap, (schedule, first.number, twin.value, cap)
        mine, whole = TrialRecord.read(first).curve, TrialRecord.read(twin).curve  # [[clock, val_loss], ...]
        past = next(i for i, (clock, _) in enumerate(whole) if clock > cap)
        assert mine == whole[: past + 1]  # the same run, scored up to its first validation past the cap, no further
        firsts.append(first.number)
    assert firsts, "no trial was capped: the test's search must cap one"
