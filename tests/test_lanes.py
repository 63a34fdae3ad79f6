"""``search.jobs``: one worker's trials side by side (paci_tune.tune.lanes).

Oracles: the same search run with one job (each study's trials, confirmations and verdict must be
the same), the trials' own clocks in the storage (some must have overlapped), the thread count each
trial's run recorded, and the operating system (a cancelled trial's process group is gone).
"""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers.cli import check_ok, cli_env, read_metrics
from helpers.searches import SEARCH_DOC, quick_search, run, search_cmd, studies
from optuna.trial import TrialState

from paci_tune.base.processes import threads_per_process
from paci_tune.config.tune import load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.tune.lanes import Lanes
from paci_tune.tune.point import TrialParams
from paci_tune.tune.runner import SubprocessRunner, TrialCancelled, TrialJob


def _search(tmp: Path, jobs: int) -> tuple[dict, dict]:
    """bench/search_seeds.py's QUICK search (rst clock on a hand-written profile: nothing measured) with
    2 trials per schedule and 2 confirmation seeds, at ``jobs``; its studies and best.yaml."""
    seeds = quick_search()
    tmp.mkdir()
    (tmp / "profile.yaml").write_text(yaml.safe_dump(seeds.QUICK_PROFILE))
    space = {**seeds.QUICK_SPACE, "lr_scale": [1.0, 2.0]}
    (tmp / "space.yaml").write_text(yaml.safe_dump(space))
    doc = copy.deepcopy(seeds.QUICK)
    doc["budget"]["profile"] = str(tmp / "profile.yaml")
    doc["search"] = {
        **doc["search"],
        "trials": 2,
        "jobs": jobs,
        "space": str(tmp / "space.yaml"),
        "confirm": {"top": 1, "seeds": 2, "max_seeds": 2},
    }
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)  # the worker splits the cores itself
    check_ok(run(search_cmd(config, tmp), env=env))
    return studies(f"sqlite:///{tmp / 'work' / 'study.db'}"), yaml.safe_load((tmp / "best.yaml").read_text())


def _threads(tmp: Path, schedule: str, number: int) -> int | None:
    metrics = tmp / "work" / "trials" / f"model.{schedule}" / f"trial-{number:04d}" / "metrics.jsonl"
    if not metrics.is_file():
        return None  # answered from another trial's curve or result: nothing trained
    return next(r["threads"] for r in read_metrics(metrics) if r["event"] == "start")


@pytest.mark.slow
def test_two_jobs_run_trials_side_by_side_and_find_what_one_job_finds(tmp_path: Path) -> None:
    one, best_one = _search(tmp_path / "one", 1)
    two, best_two = _search(tmp_path / "two", 2)
    for schedule in one:
        a, b = one[schedule].trials, two[schedule].trials
        search = [(t.params, t.state) for t in a if "confirm" not in t.user_attrs]
        assert [(t.params, t.state) for t in b if "confirm" not in t.user_attrs] == search, schedule
        conf = {(t.user_attrs["confirm"]["seed"], str(t.params)): t.value for t in a if "confirm" in t.user_attrs}
        got = {(t.user_attrs["confirm"]["seed"], str(t.params)): t.value for t in b if "confirm" in t.user_attrs}
        assert got.keys() == conf.keys() and len(conf) == 2, schedule
        assert [got[k] for k in conf] == pytest.approx(list(conf.values()), rel=1e-6), schedule
        assert [t.value for t in b] == pytest.approx([t.value for t in a], rel=1e-6, nan_ok=True), schedule
    for key in ("verdict", "recommended", "comparison"):
        assert best_two[key] == best_one[key], key

    # Side by side: trained trials whose clocks overlap, each on its share of the cores.
    trained = [
        (s, t)
        for s, st in two.items()
        for t in st.trials
        if t.state != TrialState.WAITING and _threads(tmp_path / "two", s, t.number) is not None
    ]
    pairs = [
        ((s, x), (r, y))
        for i, (s, x) in enumerate(trained)
        for r, y in trained[i + 1 :]
        if x.datetime_start < y.datetime_complete and y.datetime_start < x.datetime_complete
    ]
    assert pairs, "no two trials ran at once"
    share = threads_per_process(2)
    for pair in pairs:
        for s, t in pair:
            assert _threads(tmp_path / "two", s, t.number) == share, (s, t.number)
    assert all(
        _threads(tmp_path / "one", s, t.number) in (None, os.cpu_count(), torch_default())
        for s, st in one.items()
        for t in st.trials
    )


def torch_default() -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.parametrize(
    ("jobs", "clock"), [(0, "sim"), (-1, "sim"), ("many", "sim"), (257, "sim"), (2, "wall"), (True, "sim")]
)
def test_bad_jobs_are_refused_naming_the_key(jobs: object, clock: str) -> None:
    with pytest.raises(ConfigError, match=r"search\.jobs"):
        load_tune_config(_doc(jobs, clock))


def _doc(jobs: object, clock: str) -> dict:
    """The tests' search file with ``search.jobs`` and ``budget.clock`` set (parsed, never run)."""
    doc = copy.deepcopy(SEARCH_DOC)
    doc["search"]["jobs"], doc["budget"]["clock"] = jobs, clock
    return doc


def test_jobs_auto_and_one_on_the_wall_clock_are_accepted() -> None:
    from paci_tune.tune.setup import side_by_side

    for jobs, clock in (("auto", "sim"), ("auto", "wall"), (1, "wall"), (3, "sim")):
        n = side_by_side(load_tune_config(_doc(jobs, clock)))
        assert n == (1 if clock == "wall" else 3 if jobs == 3 else min(os.cpu_count() or 1, 4)) or (
            jobs == "auto" and n == 1  # GPUs visible: trials would share them
        ), (jobs, clock, n)


def test_a_cancelled_trial_kills_its_process_group_and_is_left_untold(tmp_path: Path) -> None:
    """What a worker stopping on an exception does to the trials beside it (:class:`Lanes`)."""
    doc = {k: copy.deepcopy(v) for k, v in SEARCH_DOC.items() if k not in ("target", "budget", "hardware", "search")}
    doc["training"]["steps"] = 10_000  # runs until stopped
    job = TrialJob(TrialParams("paci", 2, 4, 2), doc, tmp_path / "trial", 1.0, 2, 1.0)
    runner = SubprocessRunner(stall_seconds=120)
    told: list[int] = []

    def trial() -> None:
        runner.run(job, lambda step, progress: False)
        told.append(1)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), Lanes(2) as lanes:
        job.cancel = lanes.cancel  # as the search gives each trial's job its worker's
        lanes.start("paci", True, 1, 2, trial)
        deadline = time.monotonic() + 60
        while runner.last_pid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt  # Ctrl-C in the worker's thread: every trial beside it must stop
    assert lanes.cancel.is_set() and not told and lanes.running == 0
    assert time.monotonic() - t0 < 60
    assert runner.last_pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(runner.last_pid, 0)
    with pytest.raises(TrialCancelled):
        runner.run(job, lambda step, progress: False)  # a stopping worker starts nothing


def test_the_view_shows_every_running_trial_and_names_each_validation() -> None:
    """Events of two trials from two threads: a bar each while they run, plain lines that say whose."""
    import io

    from rich.console import Console

    from paci_tune.cli.search_view import SearchView
    from paci_tune.tune.events import SearchEvent
    from paci_tune.tune.objective import Progress

    def events(schedule: str, number: int) -> list[SearchEvent]:
        params, progress = TrialParams(schedule, 2, 4, 2, data_parallel=2), Progress(2.75, 4.0)
        out = [SearchEvent("start", schedule, number, params)]
        for step, val in enumerate((2.9, 2.8, 2.7), start=1):
            progress.add_eval(step * 1.0, val)
            out.append(SearchEvent("eval", schedule, number, params, step, Progress(**vars(progress))))
        return out

    for live in (True, False):
        out = io.StringIO()
        view = SearchView(4.0, "rst", 2.75, console=Console(file=out, force_terminal=live, width=160), live=live)
        with view:
            threads = [
                threading.Thread(target=lambda v=view, s=s, n=n: [v.on_event(e) for e in events(s, n)])
                for s, n in (("paci", 3), ("1f1b", 5))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            bars = {view.progress.tasks[i].description for i in range(len(view.progress.tasks))}
            assert len(view.running) == 2 and any("paci#3" in d for d in bars) and any("1f1b#5" in d for d in bars)
            view.on_event(SearchEvent("end", "paci", 3, None, state="complete", value=3.0))
            assert list(view.running) == [("1f1b", 5)]
        text = out.getvalue()
        if not live:
            for who in ("paci#3", "1f1b#5"):
                assert [ln for ln in text.splitlines() if ln.strip().startswith(f"{who} step ")] and (
                    f"{who} step 3: clock 3s val 2.7" in text
                ), text


@pytest.mark.parametrize("fits", [1, 2, 3])
def test_auto_runs_no_more_trials_than_the_free_memory_holds(fits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: each trial's own memory check (``check_memory``, all stages of all replicas in one
    process). With the free RAM set to hold the example space's largest trial ``fits`` times and a
    little more, ``auto`` runs that many side by side (the core cap aside): at that share of the RAM
    every point passes the check, at one more some point is refused."""
    import torch

    from paci_tune.base.shipped import resolve_path
    from paci_tune.config import derive_run
    from paci_tune.pipeline import planning
    from paci_tune.sim.profile import Profile
    from paci_tune.tune import setup
    from paci_tune.tune.setup import bind_space, side_by_side

    tune = load_tune_config(yaml.safe_load(resolve_path("examples/tiny-gpt.yaml").read_text()))
    space = bind_space(tune)
    path = str(resolve_path(tune.budget.profile))
    profile = Profile.load(path, "budget.profile")

    def refused(have: float) -> bool:
        for schedule in space.schedules:
            for p, a, b in space.points:
                q = TrialParams(
                    schedule,
                    p,
                    a,
                    b,
                    1.0,
                    space.data_parallel(p),
                    space.backward_weights_of(schedule)[0],
                    space.chunks_of(schedule)[0],
                )
                if space.why_not(q) is not None:
                    continue  # a point its study never runs
                cfg = derive_run(
                    tune.run_doc,
                    {
                        **q.overrides(),
                        "pipeline.partition": "auto",
                        "training.clock": "sim",
                        "pipeline.runtime": "emulated",
                        "pipeline.inflight": None,
                    },
                )
                sizes = planning.plan_partition(cfg, [1.0] * profile.n_units, profile)
                monkeypatch.setattr(planning, "memory_available", lambda device, n: have)
                try:
                    planning.check_memory(cfg, profile, sizes, torch.device("cpu"), False)
                except ConfigError:
                    return True
        return False

    lo, hi = 1.0, 64 * 2**30  # the largest trial's need, by bisection on the trial's own check
    while hi - lo > 1024:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refused(mid) else (lo, mid)
    monkeypatch.setattr(planning, "memory_available", lambda device, n: hi * fits + hi / 2)
    monkeypatch.setattr(setup, "cpu_count", lambda: 8)
    monkeypatch.setattr(setup, "_uses_gpus", lambda tune: False)
    n = side_by_side(tune, space, path)
    assert n == fits  # the RAM shared out n ways passes every point's own check, n + 1 ways it does not
