"""``search.strategy: predict`` through the real CLI (:mod:`paci_tune.tune.planner`): the grid's answer for
fewer trainings, in a real Optuna study that resumes after a kill (on a journal file) and takes two workers.

Oracles: a grid search of the same config, space and profile (``--sampler grid``: every point trained or
read), and the uninterrupted single-worker predicted search for the killed and two-worker ones. The config
is helpers.faults' tiny search (the sim clock: the same numbers on every run) over P {1, 2} x b {1, 2, 4} x
LR {x1, x2} on 2 devices: PACI's study has 6 classes (P = 2 at each b and LR), flush's 2 curves.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.cli import check_ok
from helpers.faults import run_twice_at_once, search_outcome, sqlite_url, start, tiny_search, wait_until
from helpers.processes import kill_tree
from helpers.searches import run, search_cmd, studies
from optuna.trial import TrialState

from paci_tune.config.tune import load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.tune.record import PLAN_CLASS, PREDICTED

SEARCH_S = 240
SPACE = {"schedules": ["paci", "1f1b"], "stages": [1, 2], "microbatch_size": [1, 2, 4], "lr_scale": [1.0, 2.0]}


def _config(tmp: Path, **search: Any) -> Path:
    config = tiny_search(tmp, **search)
    (tmp / "space.yaml").write_text(yaml.safe_dump(SPACE))
    return config


def _answer(outcome: dict[str, Any]) -> dict[str, Any]:
    """A search's outcome (helpers.faults.search_outcome) without the clock where a stopped trial stopped: a
    capped trial stops at its study's best of the moment, which the order trials finished in decides."""
    out = dict(outcome)
    for schedule in ("paci", "1f1b"):
        points = outcome[schedule]["points"]
        out[schedule] = {p: (state, v if state == "COMPLETE" else None) for p, (state, v) in points.items()}
    return out


def _trained(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials that trained a curve (a numerics record of their own, not read from another's)."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if "numerics" in t.user_attrs and not {"shared_from", "repeat_of"} & set(t.user_attrs)
    ]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted single-worker predicted search: its folder and outcome."""
    tmp = tmp_path_factory.mktemp("predicted")
    check_ok(run(search_cmd(_config(tmp, strategy="predict", trials=20), tmp), timeout=SEARCH_S))
    return tmp, search_outcome(tmp / "best.yaml", sqlite_url(tmp))


def test_a_predicted_search_gives_the_grids_answer_and_trains_fewer_paci_classes(
    tmp_path: Path, predicted: tuple[Path, dict[str, Any]]
) -> None:
    tmp, outcome = predicted
    check_ok(run(search_cmd(_config(tmp_path, sampler="grid", trials=100), tmp_path), timeout=SEARCH_S))
    grid = search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path))
    assert (outcome["verdict"], outcome["baseline_schedule"]) == (grid["verdict"], grid["baseline_schedule"])
    for schedule in ("paci", "1f1b"):  # each schedule's best score, at one of the grid's best points
        scores = {p: v for p, (_, v) in grid[schedule]["points"].items() if v is not None}
        ours = {p: v for p, (_, v) in outcome[schedule]["points"].items() if v is not None}
        assert min(ours.values()) == min(scores.values()), schedule
        assert all(scores[p] == v for p, v in ours.items() if v == min(ours.values())), schedule
    # Every flush layout read off its curve: flush's study holds the grid's every point, with the grid's scores.
    assert outcome["1f1b"]["points"] == grid["1f1b"]["points"]
    ours, theirs = studies(sqlite_url(tmp)), studies(sqlite_url(tmp_path))
    paci = _trained(ours["paci"])
    assert len(paci) < len(_trained(theirs["paci"])) == 6, "the planner trained every PACI class"
    assert all(PLAN_CLASS in t.user_attrs and PREDICTED in t.user_attrs for t in paci), "a PACI point was sampled"
    assert len({t.user_attrs[PLAN_CLASS] for t in paci}) == len(paci), "a PACI class trained twice"
    assert len(_trained(ours["1f1b"])) == 2, "flush trains one curve per LR"


def test_a_killed_predicted_search_resumes_on_a_journal_to_the_same_answer(
    tmp_path: Path, predicted: tuple[Path, dict[str, Any]]
) -> None:
    journal = tmp_path / "study.log"
    storage = f"journal://{journal}"
    cmd = search_cmd(_config(tmp_path, strategy="predict", trials=20), tmp_path, "--storage", storage)
    log = tmp_path / "first.log"
    proc = start(cmd, log)

    def a_paci_trial_done() -> bool | None:
        if not journal.exists():
            return None
        store = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
        names = {s.study_name for s in store.get_all_studies()}
        if "model.paci" not in names:
            return None
        done = optuna.load_study(study_name="model.paci", storage=store).get_trials(states=(TrialState.COMPLETE,))
        return True if done else None

    try:
        wait_until(a_paci_trial_done, "a finished PACI trial", SEARCH_S, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_tree(proc)
    assert not (tmp_path / "best.yaml").exists()
    check_ok(run(cmd, timeout=SEARCH_S))
    store = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    assert _answer(search_outcome(tmp_path / "best.yaml", store)) == _answer(predicted[1])


def test_two_workers_on_one_predicted_search_train_each_class_once(
    tmp_path: Path, predicted: tuple[Path, dict[str, Any]]
) -> None:
    cmd = search_cmd(_config(tmp_path, strategy="predict", trials=20), tmp_path)
    run_twice_at_once(cmd, tmp_path, SEARCH_S)
    # Two workers verify two candidates at once, so PACI may train more classes than one worker; the answer holds.
    ours, single = search_outcome(tmp_path / "best.yaml", sqlite_url(tmp_path)), predicted[1]
    assert ours["verdict"] == single["verdict"]
    for schedule in ("paci", "1f1b"):
        best = min(v for _, v in single[schedule]["points"].values() if v is not None)
        assert min(v for _, v in ours[schedule]["points"].values() if v is not None) == best, schedule
    for schedule, study in studies(sqlite_url(tmp_path)).items():
        keys = [t.user_attrs.get(PLAN_CLASS) or t.user_attrs["numerics"]["key"] for t in _trained(study)]
        assert len(set(keys)) == len(keys), f"{schedule}: a class trained twice"


@pytest.mark.parametrize(
    ("search", "budget", "why"),
    [
        ({"strategy": "predict"}, {"clock": "wall"}, "wall clock"),
        ({"strategy": "predict", "share_curves": False}, {}, "share_curves"),
        ({"strategy": "predict", "sampler": "grid"}, {}, "grid"),
        ({"strategy": "guess"}, {}, "predict"),
        ({"strategy": "predict", "verify_z": 9}, {}, "[0, 5]"),
    ],
)
def test_a_strategy_that_cannot_run_is_refused(
    tmp_path: Path, search: dict[str, Any], budget: dict[str, Any], why: str
) -> None:
    doc = yaml.safe_load(_config(tmp_path, **search).read_text())
    doc["budget"].update(budget)
    with pytest.raises(ConfigError) as refused:
        load_tune_config(doc)
    key = "search.verify_z" if "verify_z" in search else "search.strategy"
    assert str(refused.value).startswith(key) and why in str(refused.value), str(refused.value)


def test_the_cli_refuses_a_strategy_before_any_work(tmp_path: Path) -> None:
    config = _config(tmp_path, strategy="predict")
    doc = yaml.safe_load(config.read_text())
    doc["budget"]["clock"] = "wall"
    config.write_text(yaml.safe_dump(doc))
    proc = run(search_cmd(config, tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: search.strategy: got 'predict'"), proc.stderr
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())
