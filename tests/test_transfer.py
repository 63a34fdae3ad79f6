"""``search.transfer_check``: the best short-budget points trained again at ``factor`` x the budget,
and Spearman's rank correlation between the two budgets' scores.

Oracles: hand-worked rank correlations; hand-built Optuna studies whose best distinct points are
known; a stand-in trial runner whose score is a known function of the point and the budget it is
given (the search loop's own planning, queueing and resumption, in process); and, end to end, a
real ``paci-tune search`` read back from its storage with Optuna, the correlation recomputed from the
stored scores with the textbook no-ties formula 1 - 6 sum(d^2) / (n (n^2 - 1)).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers import REPO
from helpers.cli import check_ok, cli_env
from helpers.searches import search_cmd, studies, write_search
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.errors import ConfigError
from paci_tune.sim.profile import P2PCost, Profile, UnitCost, UnitProfile
from paci_tune.tune import extra
from paci_tune.tune.objective import Progress, grid_step
from paci_tune.tune.record import CONFIRM as CONFIRM_ATTR
from paci_tune.tune.record import TRANSFER as TRANSFER_ATTR
from paci_tune.tune.record import TRANSFER_PLAN
from paci_tune.tune.runner import TrialJob, TrialResult
from paci_tune.tune.study import counted, reap_dead
from paci_tune.verdict import transfer
from paci_tune.verdict.best import best_trial, build_best, params_of, trial_counts

optuna.logging.set_verbosity(optuna.logging.WARNING)
DISTS = {"stages": CategoricalDistribution([2, 4]), "microbatch_size": CategoricalDistribution([1, 2, 4, 8])}


# ---------------------------------------------------------------------------------- Spearman
def test_spearman_against_hand_worked_values() -> None:
    assert transfer.spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]) == pytest.approx(1.0)
    assert transfer.spearman([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # Monotone but not linear: ranks only.
    assert transfer.spearman([1.0, 2.0, 3.0], [1.0, 100.0, 101.0]) == pytest.approx(1.0)
    # Ties share their average rank: x ranks (1, 2.5, 2.5, 4), y ranks (1, 3, 2, 4); deviations from 2.5:
    # dx = (-1.5, 0, 0, 1.5), dy = (-1.5, 0.5, -0.5, 1.5); sum dx dy = 4.5, sum dx^2 = 4.5, sum dy^2 = 5,
    # rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9).
    assert list(transfer.average_ranks([1.0, 2.0, 2.0, 3.0])) == [1.0, 2.5, 2.5, 4.0]
    assert list(transfer.average_ranks([3.0, 1.0, 3.0, 3.0])) == [3.0, 1.0, 3.0, 3.0]  # ranks 2, 3, 4 -> 3
    assert transfer.spearman([1.0, 2.0, 2.0, 3.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(math.sqrt(0.9))
    # Three points, one swap: d = (0, 1, -1), rho = 1 - 6 * 2 / (3 * 8) = 0.5.
    assert transfer.spearman([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5)
    # A failed long run scores inf: it ranks last.
    assert transfer.spearman([1.0, 2.0, 3.0], [5.0, math.inf, 6.0]) == pytest.approx(0.5)
    # Undefined: fewer than 2 points, or one side constant (no ranking to compare).
    assert transfer.spearman([], []) is None and transfer.spearman([1.0], [2.0]) is None
    assert "at least 2" in str(transfer.undefined([1.0], [2.0]))
    assert transfer.spearman([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) is None
    assert "short-budget scores are all equal" in str(transfer.undefined([2.0, 2.0], [1.0, 3.0]))
    assert transfer.spearman([1.0, 2.0], [7.0, 7.0]) is None
    assert "long-budget" in str(transfer.undefined([1.0, 2.0], [7.0, 7.0]))
    assert transfer.undefined([1.0, 2.0], [1.0, 2.0]) is None


# ------------------------------------------------------------------------------------ config
def test_the_option_is_off_by_default_and_its_values_are_checked() -> None:
    from paci_tune.config.tune import SearchConfig, parse_tune_sections

    assert not SearchConfig().transfer_check.enabled and SearchConfig().transfer_check.top == 0
    ok = parse_tune_sections({"search": {"transfer_check": {"top": 5, "factor": 4}}}, require=False)
    assert ok["search"].transfer_check.enabled and ok["search"].transfer_check.factor == 4.0
    for bad, key in [
        ({"top": 51}, "top"),
        ({"top": -1}, "top"),
        ({"top": 2, "factor": 1}, "factor"),
        ({"top": 2, "factor": 0.5}, "factor"),
        ({"top": 2, "factor": 101}, "factor"),
        ({"top": 2, "factor": "four"}, "factor"),
        ({"top": 2.5}, "top"),
        ({"top": 2, "seeds": 3}, "seeds"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_tune_sections({"search": {"transfer_check": bad}}, require=False)
        assert e.value.key == f"search.transfer_check.{key}", bad


# ---------------------------------------------------------------------------------- planning
def _add(
    study: optuna.Study, b: int, value: float | None, state: TrialState = TrialState.COMPLETE, **attrs: Any
) -> None:
    study.add_trial(
        create_trial(
            state=state,
            value=value,
            params={"stages": 2, "microbatch_size": b},
            distributions=DISTS,
            user_attrs={"time_to_target": None, **attrs},
        )
    )


def _searched(schedule: str, scores: list[tuple[int, float | None]]) -> optuna.Study:
    """Search trials (micro-batch size, score; None: pruned), then a confirmation scoring better than all."""
    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    for b, v in scores:
        _add(study, b, v, TrialState.COMPLETE if v is not None else TrialState.PRUNED)
    _add(study, 8, 0.01, **{CONFIRM_ATTR: {"of": 0, "seed": 1}})  # never a point of the plan
    return study


def test_the_plan_takes_the_best_distinct_search_points_and_queues_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # b=4 twice (the repeat with the better score is not a new point), b=8 pruned, a confirmation at 0.01.
    paci = _searched("paci", [(4, 3.0), (2, 2.0), (4, 2.5), (1, 5.0), (8, None)])
    flush = _searched("1f1b", [(1, 1.0), (2, 4.0)])
    assert extra.transfer_plan(paci, 2) == [1, 2]  # b=2 (2.0), b=4's best draw (2.5); not b=4 again, not b=1
    assert extra.transfer_plan(flush, 5) == [0, 1]  # only two distinct finished points
    assert paci.user_attrs[TRANSFER_PLAN] == [1, 2]
    _add(paci, 1, 0.5)  # a later, better search trial: the plan is kept once set (all workers agree on it)
    assert extra.transfer_plan(paci, 2) == [1, 2]

    assert extra.enqueue_transfers(paci, [1, 2], 4.0) == 2
    assert extra.enqueue_transfers(paci, [1, 2], 4.0) == 0  # called again (a resumed search): nothing new
    waiting = paci.get_trials(states=(TrialState.WAITING,))
    assert [(t.user_attrs[TRANSFER_ATTR], t.system_attrs["fixed_params"]["microbatch_size"]) for t in waiting] == [
        ({"of": 1, "factor": 4.0}, 2),
        ({"of": 2, "factor": 4.0}, 4),
    ]
    assert extra.transfer_queued(paci) and not extra.waiting(paci)

    # One of them runs and its worker dies: it is failed, queued again as a transfer trial, not twice.
    trial = paci.ask()
    for name, dist in DISTS.items():  # the point, as the search loop suggests it right after asking
        trial.suggest_categorical(name, dist.choices)
    paci._storage.set_trial_user_attr(trial._trial_id, "worker", {"host": "here", "pid": 2**22 + 7})
    monkeypatch.setattr("paci_tune.tune.study.HOST", "here")  # a worker of this host whose pid is gone
    assert reap_dead(paci, retries=1) == [trial.number]
    assert extra.enqueue_transfers(paci, [1, 2], 4.0) == 0
    retry = [t for t in paci.get_trials(states=(TrialState.WAITING,)) if t.user_attrs.get("retry_of") == trial.number]
    assert len(retry) == 1 and retry[0].user_attrs[TRANSFER_ATTR] == {"of": 1, "factor": 4.0}
    # Another factor on a resumed search is another check: its own runs.
    assert extra.enqueue_transfers(paci, [1, 2], 2.0) == 2


def test_transfer_trials_are_no_search_trials() -> None:
    """Not counted, not ranked, not planned from, not recommended -- though they score best of all."""
    studies_ = {"paci": _searched("paci", [(4, 3.0), (2, 2.0)]), "1f1b": _searched("1f1b", [(4, 4.0), (2, 5.0)])}
    for study in studies_.values():
        extra.transfer_plan(study, 2)
        _add(study, 1, 0.001, **{TRANSFER_ATTR: {"of": 0, "factor": 4.0}, "wall_seconds": 7.0})  # b=1: no search point
        _add(study, 4, 0.002, **{TRANSFER_ATTR: {"of": 0, "factor": 4.0}, "wall_seconds": 7.0})
    paci = studies_["paci"]
    assert counted(paci.get_trials(), quota=3) == 2
    assert best_trial(paci).number == 1
    assert extra.best_distinct(paci, 5) == [1, 0]
    assert [t.number for t in extra.search_trials(paci)] == [0, 1]
    counts = trial_counts(paci)
    assert counts["complete"] == 2 and counts["confirmation"] == 1 and counts["transfer"] == 2
    best = build_best(
        studies_,
        run_doc_for=lambda p: {"pipeline": {"schedule": p.schedule}},
        base_lr=1e-3,
        fixed_batch=8,
        target={"metric": "val_loss", "value": 2.0},
        budget={"clock": "sim", "seconds": 10.0, "grid": 5},
        provenance={"study_name": "t"},
        transfer_factor=4.0,
    )
    assert best["recommended"]["microbatch_size"] == 2 and best["evidence"]["trial"] == "t.paci#1"
    assert best["comparison"]["baseline"]["trial"] == "t.1f1b#0"
    assert best["provenance"]["compute"]["transfer_s"] == 28.0


def test_the_best_yaml_section_and_the_summary_line() -> None:
    study = optuna.create_study(study_name="t.paci", direction="minimize")
    for b, v in [(1, 1.0), (2, 2.0), (4, 3.0)]:
        _add(study, b, v)
    assert extra.transfer_plan(study, 3) == [0, 1, 2]
    _add(study, 1, 10.0, **{TRANSFER_ATTR: {"of": 0, "factor": 2.0}})
    _add(study, 2, None, TrialState.FAIL, fail_reason="crash: boom", **{TRANSFER_ATTR: {"of": 1, "factor": 2.0}})
    _add(study, 4, 20.0, **{TRANSFER_ATTR: {"of": 2, "factor": 2.0}})
    _add(study, 4, 1.0, **{TRANSFER_ATTR: {"of": 2, "factor": 3.0}})  # another factor's run: not this check's
    flush = optuna.create_study(study_name="t.1f1b", direction="minimize")
    _add(flush, 2, 4.0)
    extra.transfer_plan(flush, 3)
    _add(flush, 2, 9.0, **{TRANSFER_ATTR: {"of": 0, "factor": 2.0}})

    doc = transfer.section({"paci": study, "1f1b": flush}, 2.0, 10.0, lambda t, s: params_of(t, s, 8))
    assert doc["factor"] == 2.0 and doc["seconds"] == 20.0
    rows = doc["paci"]["points"]
    assert [(r["trial"], r["short"], r["long"]) for r in rows] == [(0, 1.0, 10.0), (1, 2.0, math.inf), (2, 3.0, 20.0)]
    assert rows[1]["long_failed"] == "crash: boom" and rows[0]["point"] == "paci P=2 a=8 b=1"
    assert doc["paci"]["spearman"] == pytest.approx(0.5) and doc["paci"]["n"] == 3  # the failed run ranks last
    assert doc["1f1b"]["spearman"] is None and "at least 2" in doc["1f1b"]["note"]
    # Pooled: short (1, 2, 3, 4) vs long (10, inf, 20, 9): ranks (2, 4, 3, 1); d = (1, 2, 0, -3); 1 - 6*14/60.
    assert doc["pooled"] == {"spearman": pytest.approx(1 - 6 * 14 / 60), "n": 4}
    line = transfer.summary_line(doc)
    assert line is not None and line.startswith("transfer check (2x the trial budget)")
    assert "paci 0.5 (3 points)" in line and "1f1b n/a (1 point(s)" in line and "pooled -0.4 (4 points)" in line
    assert transfer.summary_line(None) is None


# ----------------------------------------------------------------------- the loop, in process
class ScoreRunner:
    """A stand-in for the trial process: validation loss a known function of the point and the clock.

    Validations come at the spacing the run document asks for, up to the job's budget; the loss falls
    with the clock, more slowly for a larger micro-batch, and never reaches the target.
    """

    def __init__(self) -> None:
        self.jobs: list[TrialJob] = []

    def run(self, job: TrialJob, on_eval: Any, on_record: Any = None) -> TrialResult:
        self.jobs.append(job)
        every = float(job.run_doc["training"]["eval_every_seconds"])
        b = int(job.run_doc["pipeline"]["microbatch_size"])
        progress, evals = Progress(job.target, job.budget), []
        k = 1
        while k * every <= job.budget + 1e-9:
            clock = k * every
            val = 3.0 + b / 4.0 - clock
            progress.add_eval(clock, val)
            evals.append((clock, val))
            if on_eval(grid_step(clock, job.budget, job.grid), progress):
                return TrialResult("pruned", progress, "pruned", k, None, 0.1, evals)
            k += 1
        return TrialResult("complete", progress, None, None, {"steps": k}, 0.1, evals)


@pytest.mark.slow
def test_the_loop_trains_each_long_run_once_after_the_quota(tmp_path: Path) -> None:
    from paci_tune.base.files import read_yaml
    from paci_tune.config.tune import load_tune_config
    from paci_tune.tune.search import Search
    from paci_tune.tune.space import load_space
    from paci_tune.tune.study import open_studies

    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump({"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [1, 2, 4]})
    )
    config = write_search(
        tmp_path,
        target={"value": 0.5},
        budget={"seconds": 1.0, "grid": 4},
        hardware={"devices": 2},
        search={
            "trials": 3,
            "sampler": "grid",
            "pruner": "none",
            "confirm": {"top": 1, "seeds": 2, "max_seeds": 2},
            "transfer_check": {"top": 2, "factor": 2.5},
        },
    )
    tune = load_tune_config(read_yaml(config))
    space = load_space(str(tmp_path / "space.yaml"), global_batch=8, n_units=4, max_stages=None, devices=2)
    storage = optuna.storages.InMemoryStorage()

    def search() -> tuple[Search, ScoreRunner]:
        st = open_studies(storage, "m", ("paci", "1f1b"), tune.search, space, 4, {"x": 1})
        from paci_tune.tune.setup import enqueue_start_points

        enqueue_start_points(tune, space, st)
        runner = ScoreRunner()
        return Search(tune, space, st, runner, tmp_path / "work", None, poll_s=0.01), runner

    s, runner = search()
    s.run()
    assert len(runner.jobs) == 2 * (3 + 2 + 2)  # per schedule: 3 search trials, 2 confirmations, 2 long runs
    long_jobs = [j for j in runner.jobs if j.budget != 1.0]
    assert len(long_jobs) == 4 and runner.jobs[-4:] == long_jobs  # after the quota and the confirmation
    for j in long_jobs:
        tr = j.run_doc["training"]
        assert j.budget == tr["seconds"] == 2.5 and j.grid == 10 and j.timeout_factor == 2.5
        assert tr["eval_every_seconds"] == 0.25 and tr["seed"] == 0  # the validation spacing and seed kept
    for schedule, study in s.studies.items():
        search_done = sorted(extra.search_trials(study, (TrialState.COMPLETE,)), key=lambda t: (t.value, t.number))
        long = [t for t in study.trials if TRANSFER_ATTR in t.user_attrs]
        assert [t.user_attrs[TRANSFER_ATTR]["of"] for t in long] == [t.number for t in search_done[:2]]
        for t in long:
            of = study.trials[t.user_attrs[TRANSFER_ATTR]["of"]]
            assert t.params == of.params and t.state == TrialState.COMPLETE and not t.intermediate_values
            assert t.user_attrs["curve"][-1][0] == pytest.approx(2.5) and "x2.5 budget" in t.user_attrs["label"]
            b = t.params["microbatch_size"]
            assert t.value == pytest.approx(2.5 * (1 + (3.0 + b / 4.0 - 2.5 - 0.5) / 0.5))  # the long budget's miss
        assert counted(study.trials, quota=3) == 3, schedule
    # Resumed (a new worker on the same storage): nothing is trained again.
    again, runner2 = search()
    again.run()
    assert runner2.jobs == []


# ------------------------------------------------------------------------------- end to end
def _rho_no_ties(x: list[float], y: list[float]) -> float:
    """Spearman by the textbook formula for distinct values: 1 - 6 sum(d^2) / (n (n^2 - 1))."""
    assert len(set(x)) == len(x) and len(set(y)) == len(y), "the oracle needs distinct scores"
    rank = lambda v: {val: i + 1 for i, val in enumerate(sorted(v))}  # noqa: E731
    rx, ry = rank(x), rank(y)
    n = len(x)
    return 1 - 6 * sum((rx[a] - ry[b]) ** 2 for a, b in zip(x, y, strict=True)) / (n * (n * n - 1))


@pytest.mark.slow
def test_search_runs_the_transfer_check_and_resumes_without_rerunning(tmp_path: Path) -> None:
    # Two stages on two devices, three micro-batch sizes: three distinct points per schedule, of which the
    # check trains the best two at twice the budget. A target no run reaches: every run spends its budget.
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump({"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [1, 2, 4]})
    )
    # A hand profile of the model's 4 units (no calibration): a step of (8/b + 1) micro-batch slots of
    # 6 ms x b on the sim clock is about 60 ms, so a trial is ~5 steps, a long run ~10.
    units = [
        UnitProfile(f"u{i}", 40_000, 1e-4, {b: UnitCost(1e-3 * b, 2e-3 * b, 2048 * b, 8192 * b) for b in (1, 2, 4)})
        for i in range(4)
    ]
    Profile(units, P2PCost(1e-5, 1e9), seq_len=32).save(tmp_path / "profile.yaml")
    seconds, grid = 0.3, 2
    config = write_search(
        tmp_path,
        target={"value": 0.5},
        budget={"seconds": seconds, "grid": grid, "profile": str(tmp_path / "profile.yaml")},
        hardware={"devices": 2},
        search={
            "trials": 3,
            "sampler": "grid",
            "pruner": "none",
            "confirm": {"top": 0},
            "transfer_check": {"top": 2, "factor": 2},
            # Misses ranked by their best validation at every grid point: distinct scores
            # for the oracle (far apart, 2 a budget here, two layouts' bests tie).
            "validate_near_target": False,
        },
    )

    def run() -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            search_cmd(config, tmp_path), capture_output=True, text=True, timeout=900, cwd=REPO, env=cli_env()
        )
        check_ok(proc)
        return proc

    proc = run()
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    check = best["transfer_check"]
    assert check["factor"] == 2 and check["seconds"] == pytest.approx(2 * seconds)
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    pooled_x, pooled_y = [], []
    for s, st in studies(storage).items():
        trials = st.trials
        search = [t for t in trials if TRANSFER_ATTR not in t.user_attrs and CONFIRM_ATTR not in t.user_attrs]
        done = sorted(
            (t for t in search if t.state == TrialState.COMPLETE and "repeat_of" not in t.user_attrs),
            key=lambda t: (t.value, t.number),
        )
        assert len({tuple(sorted(t.params.items())) for t in done}) == 3, s
        long = [t for t in trials if TRANSFER_ATTR in t.user_attrs]
        assert len(long) == 2, s
        assert sorted(t.user_attrs[TRANSFER_ATTR]["of"] for t in long) == sorted(t.number for t in done[:2])
        by_of = {t.user_attrs[TRANSFER_ATTR]["of"]: t for t in long}
        xs, ys = [], []
        for short in done[:2]:
            t = by_of[short.number]
            assert t.params == short.params and t.state == TrialState.COMPLETE and "pruned_step" not in t.user_attrs
            curve = t.user_attrs["curve"]
            assert curve[-1][0] > seconds and len(curve) == 2 * grid  # the longer budget, the same spacing
            trial_doc = yaml.safe_load(
                (tmp_path / "work" / "trials" / f"model.{s}" / f"trial-{t.number:04d}" / "trial.yaml").read_text()
            )
            assert trial_doc["training"]["seconds"] == pytest.approx(2 * seconds)
            assert trial_doc["training"]["eval_every_seconds"] == pytest.approx(seconds / grid)
            assert trial_doc["training"]["seed"] == 0
            xs.append(short.value)
            ys.append(t.value)
        rows = check[s]["points"]
        assert [(r["trial"], r["long_trial"]) for r in rows] == [(x.number, by_of[x.number].number) for x in done[:2]]
        assert [r["short"] for r in rows] == pytest.approx(xs) and [r["long"] for r in rows] == pytest.approx(ys)
        assert check[s]["spearman"] == pytest.approx(_rho_no_ties(xs, ys)) and check[s]["n"] == 2
        pooled_x += xs
        pooled_y += ys
        # Not search trials: the quota and the recommendation are the search's own.
        assert counted(trials, quota=3) == 3
        assert best["provenance"]["trials"][s]["transfer"] == 2
    assert check["pooled"]["n"] == 4
    assert check["pooled"]["spearman"] == pytest.approx(_rho_no_ties(pooled_x, pooled_y))
    rec = best["recommended"]["schedule"]
    rec_number = int(best["evidence"]["trial"].rsplit("#", 1)[1])
    assert TRANSFER_ATTR not in studies(storage)[rec].trials[rec_number].user_attrs
    assert "transfer check (2x the trial budget): Spearman" in proc.stderr
    figure = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "transfer_figure.py"),
            str(tmp_path / "best.yaml"),
            "--out",
            str(tmp_path / "transfer.png"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert figure.returncode == 0 and (tmp_path / "transfer.png").stat().st_size > 5_000, figure.stderr[-2000:]

    # The same command again: the study is complete, no trial is added, the section is the same.
    n_before = sum(len(st.trials) for st in studies(storage).values())
    run()
    assert sum(len(st.trials) for st in studies(storage).values()) == n_before
    assert yaml.safe_load((tmp_path / "best.yaml").read_text())["transfer_check"] == check


def test_a_killed_search_resumes_its_transfer_check(tmp_path: Path) -> None:
    """A search stopped with long runs still queued: the next worker runs only those (no subprocess)."""
    study = optuna.create_study(direction="minimize")
    for b, v in [(1, 1.0), (2, 2.0)]:
        _add(study, b, v)
    extra.enqueue_transfers(study, extra.transfer_plan(study, 2), 2.0)
    first = study.ask()  # a worker took the first one and finished it ...
    study.tell(first, 5.0)
    # ... and was killed: one long run is left, and planning again queues nothing more.
    assert extra.enqueue_transfers(study, extra.transfer_plan(study, 2), 2.0) == 0
    left = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs[TRANSFER_ATTR]["of"] for t in left] == [1]
