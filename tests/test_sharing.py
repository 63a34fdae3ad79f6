"""Curve sharing in a search (issue 39): a trial answered from another trial's curve scores what it
would have scored had it trained.

The oracle is a fresh training of every shared trial's own run (its layout, its budget, its step
grid), in process: its scored validations must fall at the same clocks (stored to 1e-6 s), with losses
within 1e-5 of the curve the search read for it. Also checked: the search trains fewer runs than it
has trials; ``search.share_curves: false`` and the wall clock switch sharing off.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from helpers.cli import check_ok, run_in_process
from helpers.searches import run, search_cmd, studies, write_search
from helpers.sharing import scores_as_trained
from optuna.trial import TrialState

from paci_tune.config.tune import load_tune_config
from paci_tune.tune.record import TrialRecord
from paci_tune.tune.session import open_search
from paci_tune.tune.sharing import applies

pytestmark = pytest.mark.slow  # a search with trial processes, then every shared trial trained again

TOL = 1e-5
SPACE = {"schedules": ["paci", "1f1b"], "stages": [1, 2], "microbatch_size": [2]}


def _search(tmp: Path) -> tuple[Path, dict[str, optuna.Study]]:
    (tmp / "space.yaml").write_text(yaml.safe_dump(SPACE))
    # A grid: every point once. Flush's two layouts are one curve, and PACI at P = 1 is flush's too.
    config = write_search(
        tmp,
        search={"trials": 2, "sampler": "grid", "pruner": "none"},
        budget={"seconds": 0.3, "grid": 3},
        training={"eval_sequences": 16},
    )
    check_ok(run(search_cmd(config, tmp), timeout=600))
    return config, studies(f"sqlite:///{tmp / 'work' / 'study.db'}")


def _finished(st: dict[str, optuna.Study]) -> list[tuple[str, optuna.trial.FrozenTrial]]:
    return [(s, t) for s, study in st.items() for t in study.get_trials(states=(TrialState.COMPLETE,))]


def test_shared_trials_score_what_their_own_training_scores(tmp_path: Path) -> None:
    config, st = _search(tmp_path)
    trials = [(s, t) for s, t in _finished(st) if TrialRecord.read(t).repeat_of is None]  # repeats: test_search
    shared = [(s, t) for s, t in trials if TrialRecord.read(t).shared_from is not None]
    trained = [t for _, t in trials if TrialRecord.read(t).numerics is not None]
    assert shared and len(trained) + len(shared) == len(trials)
    # Flush's layouts and PACI at P = 1 are one curve, trained again only by a layout that fits more steps
    # in the budget than the curves stored so far reach; PACI at P = 2 is its own.
    assert len(trained) < len(trials)
    session = open_search(config, workdir=tmp_path / "work", out=tmp_path / "best.yaml")
    search = session.search(lambda e: None)
    target = float(session.tune.target.value or 0.0)
    far_apart = sum(scores_as_trained(search, target, schedule, t) for schedule, t in shared)
    assert far_apart  # some runs validated far apart, then densely near the target (train.nearness)


def test_sharing_is_on_for_profile_clocks_only_and_can_be_switched_off(tmp_path: Path) -> None:
    def tune(**sections: dict) -> object:
        return load_tune_config(yaml.safe_load(write_search(tmp_path, **sections).read_text()), "model.yaml")

    assert applies(tune(budget={"clock": "sim", "seconds": 1.0}), "profile.yaml")
    assert not applies(tune(budget={"clock": "wall", "seconds": 1.0}), "profile.yaml")  # a wall clock measures itself
    assert not applies(tune(search={"share_curves": False}), "profile.yaml")


def test_a_bench_trains_each_curve_once_and_reads_each_layout_as_its_own_run(tmp_path: Path) -> None:
    """``bench/simrun.train_shared`` (the paper-scaled bench's runs): flush at two micro-batch counts and ZB-H1
    are one curve, trained once; each layout's row is what its own run (same horizon, draw and validation
    steps) gives, read at its own clock. PACI is another curve."""
    import sys

    from helpers import REPO
    from helpers.configs import make_config
    from helpers.profiles import make_profile, unit

    sys.path.insert(0, str(REPO / "bench"))
    import simrun

    profile = tmp_path / "profile.yaml"
    make_profile(
        [unit(1e-3, 2e-3, mb=2, opt=5e-4) for _ in range(4)], p2p={"latency_s": 1e-4, "bandwidth_Bps": 1e9}, seq_len=32
    ).save(profile)
    base = make_config(training={"global_batch": 8, "eval_sequences": 16})
    seconds, grid = 0.12, 4
    layouts = [("1f1b", 2, 1, 2, {}), ("1f1b", 2, 1, 4, {}), ("zb-h1", 2, 1, 4, {})]
    keys = {simrun.curve_class(base, str(profile), lay, seconds=seconds, grid=grid) for lay in layouts}
    assert len(keys) == 1 and None not in keys
    assert simrun.curve_class(base, str(profile), ("paci", 2, 1, 2, {}), seconds=seconds, grid=grid) not in keys
    rows = simrun.train_shared(base, str(profile), layouts, seconds=seconds, grid=grid)
    assert sum(r["trained"] for r in rows) == 1 and len({r["steps"] for r in rows}) > 1  # one run, budgets differ
    for (schedule, p, d, a, own), row in zip(layouts, rows, strict=True):
        over = simrun._sim_overrides(base, str(profile), schedule, p, d, a, seconds, grid, own)
        cfg, _ = simrun._planned(base, str(profile), over)
        fresh_doc = yaml.safe_load(yaml.safe_dump(cfg.to_doc()))
        fresh_doc["lr_schedule"]["horizon_steps"] = row["horizon_steps"]
        fresh_doc["training"].update({"eval_every": row["eval_every"], "eval_every_seconds": None})
        fresh_doc["data"]["draw"] = "sequence"
        every = row["eval_every"]
        fresh = [
            (r["clock"], r["val_loss"])
            for r in run_in_process(fresh_doc)
            if r.get("event") == "eval" and r["step"] % every == 0 and not r.get("drained")
        ]
        assert len(fresh) == len(row["curve"]) > 1, (schedule, a)
        for (c, v), (c2, v2) in zip(row["curve"], fresh, strict=True):
            assert abs(c - c2) <= 1e-6 and abs(v - v2) <= TOL, (schedule, a, row["curve"], fresh)
