"""A search space tunes PACI's ``pipeline.backward_weights``: parsed, suggested, run, recorded, read back.

Oracles, written out here rather than taken from the code under test: the two values
``forward``/``current`` and the space key's contract (two choices: a categorical dimension of the
PACI study; one: fixed for every PACI trial, no dimension; absent: the run's own value; flush never
has it); the Cartesian product of a small space's choices, which a grid must visit exactly; the run
key a trial's overrides must set; and hand-built Optuna studies whose best trial is known, for
``best.yaml``. No training anywhere.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from click.testing import CliRunner
from helpers.configs import make_config
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from paci_tune.config import derive_doc, derive_run
from paci_tune.config.tune import load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.tune.apply import apply_run
from paci_tune.tune.bestfile import read_best, write_best
from paci_tune.tune.objective import Progress
from paci_tune.tune.runner import TrialJob, TrialResult
from paci_tune.tune.search import Search
from paci_tune.tune.setup import enqueue_start_points
from paci_tune.tune.space import SearchSpace, TrialParams, load_space
from paci_tune.tune.study import enqueue_grid, open_studies
from paci_tune.verdict.best import build_best, params_of

BOTH = {"forward", "current"}
KEY = "space.backward_weights"
BASE_SPACE = {"schedules": ["paci", "1f1b"], "stages": [2], "microbatch_size": [4, 8]}


def _space(tmp_path: Path, **keys: Any) -> SearchSpace:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({**BASE_SPACE, **keys}))
    return load_space(str(path), global_batch=32, n_units=6, max_stages=None)


# ------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("given", "choices"),
    [
        (["forward", "current"], BOTH),
        (["current", "forward"], BOTH),
        (["current"], {"current"}),
        (["forward"], {"forward"}),
        (["current", "current"], {"current"}),
    ],
)
def test_the_space_reads_two_choices_or_one(tmp_path: Path, given: list[str], choices: set[str]) -> None:
    space = _space(tmp_path, backward_weights=given)
    assert set(space.backward_weights) == choices and len(space.backward_weights) == len(choices)
    assert set(space.describe()["backward_weights"]) == choices  # the fingerprint and best.yaml's provenance


@pytest.mark.parametrize("absent", [{}, {"backward_weights": None}], ids=["left-out", "null"])
def test_a_space_without_the_key_leaves_the_run_its_own_value(tmp_path: Path, absent: dict[str, Any]) -> None:
    space = _space(tmp_path, **absent)
    assert space.backward_weights == ()
    assert "backward_weights" not in space.describe()
    assert {q.backward_weights for q in space.grid()} == {None}  # no override: the run's pipeline.backward_weights
    assert all("pipeline.backward_weights" not in q.overrides() for q in space.grid())


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "forward",
        "current",
        ["stale"],
        ["forward", "stale"],
        [True],
        [1],
        ["forward", None],
        [["forward"]],
        {"forward": 1},
        0,
    ],
    ids=repr,
)
def test_bad_values_are_refused_naming_the_key_the_value_and_the_choices(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError) as e:
        _space(tmp_path, backward_weights=bad)
    assert e.value.key == KEY
    assert e.value.value == bad
    assert "forward" in e.value.allowed and "current" in e.value.allowed


def test_a_bad_value_ends_paci_tune_search_with_exit_2_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import paci_tune.tune.search as search
    import paci_tune.tune.session as session
    from paci_tune.cli import main

    def no_work(*a: Any, **k: Any) -> None:
        raise AssertionError("the search went past its space")

    monkeypatch.setattr(search.Search, "run", no_work)  # tripwires: nothing may be measured or trained
    monkeypatch.setattr(session, "profile_for", no_work)
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump({**BASE_SPACE, "microbatch_size": [2], "backward_weights": ["forward", "stale"]})
    )
    doc = {
        **make_config(),
        "target": {"value": 2.0},
        "budget": {"clock": "sim", "seconds": 1.0, "grid": 2},
        "hardware": {"devices": 2},
        "search": {"space": str(tmp_path / "s.yaml"), "trials": 1},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(main, ["search", str(tmp_path / "c.yaml"), "--no-live", "--workdir", str(tmp_path / "w")])
    assert r.exit_code == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {KEY}: got "), r.stderr
    assert "stale" in lines[0] and "forward" in lines[0].split("allowed:")[1]


# --------------------------------------------------------------------------- the studies' dimensions
def _run_grid(space: SearchSpace, schedule: str) -> list[tuple[optuna.trial.FrozenTrial, TrialParams]]:
    """Every point of ``schedule``'s study as Optuna's own GridSampler walks it, through the space's suggest."""
    seen: list[TrialParams] = []
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space.grid_params(schedule), seed=0))

    def objective(trial: optuna.Trial) -> float:
        seen.append(space.suggest(trial, schedule))
        return 0.0

    study.optimize(objective, n_trials=50)  # GridSampler stops the study once the grid is exhausted
    return list(zip(study.trials, seen, strict=True))


def test_the_paci_study_suggests_both_values_and_the_flush_study_never_the_dimension(tmp_path: Path) -> None:
    space = _space(tmp_path, backward_weights=["forward", "current"])
    paci = _run_grid(space, "paci")
    want = set(itertools.product([2], [4, 8], ["forward", "current"]))  # P x b x backward_weights
    got = [(q.stages, q.microbatch_size, q.backward_weights) for _, q in paci]
    assert sorted(got) == sorted(want)  # each point exactly once
    for t, q in paci:
        assert t.params["backward_weights"] == q.backward_weights  # a categorical of the PACI study
        assert isinstance(t.distributions["backward_weights"], CategoricalDistribution)
        assert q.overrides()["pipeline.backward_weights"] == q.backward_weights
        assert q.window * q.microbatch_size == 32
    assert {q.label().endswith("w=current") for _, q in paci} == {True, False}  # only the non-default is named

    flush = _run_grid(space, "1f1b")
    assert sorted((q.stages, q.microbatch_size) for _, q in flush) == [(2, 4), (2, 8)]
    for t, q in flush:
        assert "backward_weights" not in t.params and q.backward_weights is None
        assert "pipeline.backward_weights" not in q.overrides() and "w=" not in q.label()
    assert {(q.microbatch_size, q.backward_weights) for q in space.grid("paci")} == {
        (b, w) for b in (4, 8) for w in ("forward", "current")
    }
    assert {q.backward_weights for q in space.grid("1f1b")} == {None}


def test_a_grid_search_queues_both_values_for_paci_only(tmp_path: Path) -> None:
    space = _space(tmp_path, backward_weights=["forward", "current"])
    for schedule, want in (
        ("paci", {(b, w) for b in (4, 8) for w in ("forward", "current")}),
        ("1f1b", {(4, None), (8, None)}),
    ):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        enqueue_grid(study, space, schedule, seed=3)
        got = set()
        for _ in range(len(want)):
            trial = study.ask()
            q = space.suggest(trial, schedule)
            got.add((q.microbatch_size, q.backward_weights))
            study.tell(trial, 0.0)
        assert got == want
        assert not any(t.state == TrialState.WAITING for t in study.trials)  # the whole queue, nothing more


@pytest.mark.parametrize("value", ["forward", "current"])
def test_one_choice_fixes_every_paci_trial_without_a_dimension(tmp_path: Path, value: str) -> None:
    space = _space(tmp_path, backward_weights=[value])
    assert "backward_weights" not in space.grid_params("paci")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(6):
        trial = study.ask()
        q = space.suggest(trial, "paci")
        study.tell(trial, 0.0)
        assert q.backward_weights == value and "backward_weights" not in trial.params
        assert q.overrides()["pipeline.backward_weights"] == value
        assert ("w=current" in q.label()) == (value == "current")
        flush = space.suggest(study.ask(), "1f1b")
        assert flush.backward_weights is None


# ------------------------------------------------------------------------------ the trial's run
SEARCH_DOC = {
    **make_config(),
    "target": {"value": 2.0},
    "budget": {"clock": "sim", "seconds": 1.0, "grid": 2},
    "hardware": {"devices": 2},
    "search": {"trials": 1},
}
"""A search over the test GPT: global batch 8, P=2 a=4 b=2 as written, two devices."""


@pytest.mark.parametrize("written", [None, "forward", "current"])
def test_a_trial_run_has_the_points_value_or_the_files_own(written: str | None) -> None:
    doc = copy.deepcopy(SEARCH_DOC)
    if written is not None:
        doc["pipeline"]["backward_weights"] = written
    tune = load_tune_config(doc, "c.yaml")
    search = Search(tune, None, {}, None, Path("."), None)  # type: ignore[arg-type]
    for value in ("forward", "current"):
        point = TrialParams("paci", 2, 4, 2, 1.0, 1, value)
        assert derive_run(tune.run_doc, point.overrides()).pipeline.backward_weights == value
        assert derive_run(search.trial_doc(point)).pipeline.backward_weights == value
    own = TrialParams("paci", 2, 4, 2)  # a space without the key: the file's value, else the schema's default
    assert derive_run(search.trial_doc(own)).pipeline.backward_weights == (written or "forward")


def test_the_start_point_is_the_files_value_in_a_study_that_tunes_it(tmp_path: Path) -> None:
    doc = copy.deepcopy(SEARCH_DOC)
    doc["pipeline"]["backward_weights"] = "current"
    tune = load_tune_config(doc, "c.yaml")
    path = tmp_path / "s.yaml"
    for given, paci_param in ((["forward", "current"], {"backward_weights": "current"}), (["forward"], {})):
        path.write_text(yaml.safe_dump({**BASE_SPACE, "microbatch_size": [2, 4], "backward_weights": given}))
        space = load_space(str(path), global_batch=8, n_units=4, max_stages=None, devices=2)
        studies = {s: optuna.create_study(study_name=s) for s in space.schedules}
        enqueue_start_points(tune, space, studies)
        queued = {s: [t.system_attrs.get("fixed_params") for t in st.trials] for s, st in studies.items()}
        assert queued == {
            "paci": [{"stages": 2, "microbatch_size": 2, **paci_param}],
            "1f1b": [{"stages": 2, "microbatch_size": 2}],
        }


class _StubRunner:
    """A trial runner that trains nothing: it keeps each job and scores PACI with the current weights faster."""

    def __init__(self) -> None:
        self.jobs: list[TrialJob] = []

    def run(self, job: TrialJob, on_eval: Any, on_record: Any = None) -> TrialResult:
        self.jobs.append(job)
        progress = Progress(job.target, job.budget)
        bw = job.run_doc["pipeline"].get("backward_weights")
        clock = 0.2 if bw == "current" else 0.4 if job.params.schedule == "paci" else 0.6
        progress.add_eval(clock, job.target / 2)  # reached at ``clock``
        return TrialResult("complete", progress, evals=[(clock, job.target / 2)])


@pytest.mark.parametrize("given", [["forward", "current"], ["current"]], ids=["tuned", "fixed"])
def test_a_search_runs_stores_and_recommends_the_value(tmp_path: Path, given: list[str]) -> None:
    doc = copy.deepcopy(SEARCH_DOC)
    doc["search"] = {"trials": 4, "sampler": "grid", "pruner": "none", "confirm": {"top": 0}}
    tune = load_tune_config(doc, "c.yaml")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE_SPACE, "microbatch_size": [2, 4], "backward_weights": given}))
    space = load_space(str(path), global_batch=8, n_units=4, max_stages=None, devices=2)
    studies = open_studies(optuna.storages.InMemoryStorage(), "t", space.schedules, tune.search, space, 2, {})
    enqueue_start_points(tune, space, studies)
    runner = _StubRunner()
    search = Search(tune, space, studies, runner, tmp_path, None)  # type: ignore[arg-type]
    search.run()
    ran = {
        (j.params.schedule, j.params.microbatch_size, j.run_doc["pipeline"].get("backward_weights"))
        for j in runner.jobs
    }
    want = {("paci", b, w) for b in (2, 4) for w in given} | {("1f1b", b, None) for b in (2, 4)}
    assert ran == want  # every PACI run has the point's value; no flush run sets it
    for t in studies["paci"].trials:
        stored = t.params.get("backward_weights", t.user_attrs.get("backward_weights"))
        assert stored in given and ("backward_weights" in t.params) == (len(given) == 2)
    assert all(
        "backward_weights" not in t.params and "backward_weights" not in t.user_attrs for t in studies["1f1b"].trials
    )
    best = build_best(
        studies,
        run_doc_for=search.trial_doc,
        base_lr=float(tune.run.optimizer.lr),
        fixed_batch=8,
        target={},
        budget={},
        provenance={},
    )
    assert best["recommended"]["schedule"] == "paci" and best["recommended"]["backward_weights"] == "current"
    assert derive_run(best["run"]).pipeline.backward_weights == "current"


# --------------------------------------------------------------------------------- best.yaml
RUN = make_config(training={"steps": 4}, optimizer={"lr": 6.0e-4}, pipeline={"window": 2})
DISTS = {"stages": CategoricalDistribution([2]), "microbatch_size": CategoricalDistribution([2, 4])}


def _trial(value: float, b: int, backward_weights: str | None = None, *, as_attr: bool = False) -> FrozenTrial:
    """A finished trial at P=2, micro-batch ``b``; its backward_weights a parameter (tuned) or an attribute (fixed)."""
    params: dict[str, Any] = {"stages": 2, "microbatch_size": b}
    dists: dict[str, Any] = dict(DISTS)
    attrs: dict[str, Any] = {"time_to_target": value, "best_val_loss": 1.0, "partition": [2, 2], "steps": 4}
    if backward_weights is not None and as_attr:
        attrs["backward_weights"] = backward_weights
    elif backward_weights is not None:
        params["backward_weights"] = backward_weights
        dists["backward_weights"] = CategoricalDistribution(["forward", "current"])
    return create_trial(state=TrialState.COMPLETE, value=value, params=params, distributions=dists, user_attrs=attrs)


def _studies(paci: list[FrozenTrial], flush: list[FrozenTrial]) -> dict[str, optuna.Study]:
    out = {}
    for schedule, trials in (("paci", paci), ("1f1b", flush)):
        out[schedule] = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
        for t in trials:
            out[schedule].add_trial(t)
    return out


def _best_file(tmp_path: Path, studies: dict[str, optuna.Study], run: dict[str, Any] = RUN) -> Path:
    doc = build_best(
        studies,
        run_doc_for=lambda p: derive_doc(copy.deepcopy(run), p.overrides()),
        base_lr=6.0e-4,
        fixed_batch=8,
        target={"metric": "val_loss", "value": 3.0},
        budget={"clock": "sim", "seconds": 5.0, "grid": 4},
        provenance={"study_name": "t"},
    )
    path = tmp_path / "best.yaml"
    write_best(path, doc)
    return path


@pytest.mark.parametrize("as_attr", [False, True], ids=["tuned", "fixed"])
def test_best_yaml_round_trip_keeps_the_recommended_value(tmp_path: Path, as_attr: bool) -> None:
    # PACI at b=4 with the current weights is the fastest (2.0 s), ahead of its forward twin and of flush.
    paci = [_trial(3.0, 4, "forward", as_attr=as_attr), _trial(2.0, 4, "current", as_attr=as_attr)]
    path = _best_file(tmp_path, _studies(paci, [_trial(4.0, 2)]))
    best = read_best(path)
    assert best.recommended.schedule == "paci" and best.recommended.backward_weights == "current"
    assert best.run["pipeline"]["backward_weights"] == "current"
    assert best.run_config is not None and best.run_config.pipeline.backward_weights == "current"
    assert apply_run(path, {}).pipeline.backward_weights == "current"
    base = best.verdict_record.baseline  # type: ignore[union-attr]
    assert base["schedule"] == "1f1b" and "w=" not in base["point"]  # flush: no effect, nothing stated

    written = yaml.safe_load(path.read_text())
    for wrong in ("forward", "stale", 1):  # recommended contradicting run, or not a value at all
        edited = copy.deepcopy(written)
        edited["recommended"]["backward_weights"] = wrong
        path.write_text(yaml.safe_dump(edited))
        with pytest.raises(ConfigError) as e:
            read_best(path)
        assert e.value.key == "best.yaml.recommended.backward_weights" and e.value.value == wrong


def test_a_flush_recommendation_states_null(tmp_path: Path) -> None:
    path = _best_file(tmp_path, _studies([_trial(3.0, 4, "current")], [_trial(2.0, 2)]))
    best = read_best(path)
    assert best.recommended.schedule == "1f1b" and best.recommended.backward_weights is None
    assert "backward_weights" not in best.run["pipeline"]  # the point sets nothing: the run's own (no effect)
    run = best.run_config
    assert run is not None and run.pipeline.schedule == "1f1b" and run.pipeline.backward_weights == "forward"


@pytest.mark.parametrize("written", [None, "current"])
def test_a_space_without_the_key_recommends_the_runs_own_value(tmp_path: Path, written: str | None) -> None:
    run = copy.deepcopy(RUN)
    if written:
        run["pipeline"]["backward_weights"] = written
    path = _best_file(tmp_path, _studies([_trial(2.0, 4)], [_trial(4.0, 2)]), run)  # a trial without the key
    best = read_best(path)
    assert best.run_config is not None
    assert best.recommended.backward_weights == (written or "forward") == best.run_config.pipeline.backward_weights


def test_an_old_best_yaml_without_the_key_loads_and_trains_its_run_as_written(tmp_path: Path) -> None:
    path = _best_file(tmp_path, _studies([_trial(2.0, 4, "current")], [_trial(4.0, 2)]))
    old = yaml.safe_load(path.read_text())
    del old["recommended"]["backward_weights"]
    del old["run"]["pipeline"]["backward_weights"]
    path.write_text(yaml.safe_dump(old))
    best = read_best(path)
    assert "backward_weights" not in best.recommended.keys and best.recommended.backward_weights is None
    # the schema's default: nothing in the file says otherwise
    assert best.run_config is not None and best.run_config.pipeline.backward_weights == "forward"
    assert apply_run(path, {"pipeline.backward_weights": "current"}).pipeline.backward_weights == "current"


def test_trials_read_back_with_their_value_and_old_trials_without_one() -> None:
    assert params_of(_trial(1.0, 4, "current"), "paci", 8).backward_weights == "current"  # a parameter
    assert params_of(_trial(1.0, 4, "current", as_attr=True), "paci", 8).backward_weights == "current"  # fixed
    old = params_of(_trial(1.0, 4), "paci", 8)  # stored before the key existed, or a space without it
    assert old == TrialParams("paci", 2, 2, 4, 1.0, 1, None) and old.label() == "paci P=2 a=2 b=4"
    assert "pipeline.backward_weights" not in old.overrides()
    assert params_of(_trial(1.0, 2, "current", as_attr=True), "1f1b", 8).backward_weights is None
