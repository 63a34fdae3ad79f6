"""A real search with the stronger synchronous baseline: ``schedules: [paci, 1f1b, zb-h1]``.

bench/search_seeds.py's QUICK search (a tiny synthetic model on a hand-written reference profile,
the rst clock), with a constant LR so that a loss depends only on the point, the seed and the step.
Oracles, independent of the code under test:

- equal effort: every study trains the same number of search trials, counted from the Optuna
  storage (not from the log);
- the strongest baseline: best.yaml's ``baseline_schedule`` is the synchronous schedule whose best
  search draw scored lowest (chosen on the search's draws, reported on fresh seeds), recomputed here
  from the storage, and its comparison mean is that point's mean over its stored confirmation runs;
- same numerics: ZB-H1 computes 1F1B-flush's gradients, so at the same point, seed and step its
  validation losses equal 1f1b's (the runs evaluate at different steps, since their clocks differ:
  the steps both evaluated are compared); and being faster per step on the same numbers, it reaches
  the target no later;
- a space the tool cannot run exits 2 before any trial, with one line naming the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.searches import quick_search, run, search_cmd
from optuna.trial import TrialState

pytestmark = pytest.mark.slow  # searches run trial processes

SCHEDULES = ["paci", "1f1b", "zb-h1"]
TRIALS = 2


def _config(tmp: Path, space: dict[str, Any], **sections: dict[str, Any]) -> Path:
    m = quick_search()
    (tmp / "space.yaml").write_text(yaml.safe_dump(space))
    (tmp / "profile.yaml").write_text(yaml.safe_dump(m.QUICK_PROFILE))
    doc = {
        **m.QUICK,
        "search": {**m.QUICK["search"], "space": str(tmp / "space.yaml")},
        "budget": {**m.QUICK["budget"], "profile": str(tmp / "profile.yaml")},
    }
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    path = tmp / "quick.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _evals(tmp: Path, schedule: str, number: int) -> dict[int, float]:
    """Validation loss by step of one trial, from its metrics file."""
    path = tmp / "work" / "trials" / f"quick.{schedule}" / f"trial-{number:04d}" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["val_loss"]) for r in rows if r.get("event") == "eval"}


def test_zb_h1_is_tuned_like_flush_and_the_strongest_baseline_is_named(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        {"schedules": SCHEDULES, "stages": [2], "microbatch_size": [2, 4]},
        lr_schedule={"min_ratio": 1.0, "warmup_fraction": 0.0},  # constant: a loss is the step's, whatever the clock
        target={"value": 3.3},
        budget={"seconds": 0.3, "grid": 30},
        search={"trials": TRIALS, "pruner": "none", "confirm": {"top": 1, "seeds": 2, "max_seeds": 2}},
    )
    proc = run(search_cmd(config, tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    studies = {s: optuna.load_study(study_name=f"quick.{s}", storage=storage) for s in SCHEDULES}

    # Equal effort: the same number of trained search trials in each study.
    def search_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
        extra = ("confirm", "transfer")  # confirmation and transfer-check runs (tune/record.py's keys)
        return [t for t in study.trials if t.state.is_finished() and not any(k in t.user_attrs for k in extra)]

    trained = {
        s: [t for t in search_trials(st) if "repeat_of" not in t.user_attrs and "infeasible" not in t.user_attrs]
        for s, st in studies.items()
    }
    assert {s: len(t) for s, t in trained.items()} == dict.fromkeys(SCHEDULES, TRIALS), proc.stderr[-2000:]

    # The strongest baseline: the lowest best search draw among the synchronous studies, reported on fresh seeds.
    drawn: dict[str, optuna.trial.FrozenTrial] = {}
    for s in ("1f1b", "zb-h1"):
        done = [t for t in trained[s] if t.state == TrialState.COMPLETE and t.value is not None]
        drawn[s] = min(done, key=lambda t: (t.value, t.number))
    strongest = min(("1f1b", "zb-h1"), key=lambda s: (drawn[s].value, s != "1f1b"))
    conf = [
        t.value if t.value is not None else math.inf
        for t in studies[strongest].trials
        if "confirm" in t.user_attrs and t.user_attrs["confirm"]["of"] == drawn[strongest].number
    ]
    assert conf, f"{strongest} has no confirmation runs"
    c = best["comparison"]
    assert best["baseline_schedule"] == strongest == c["baseline"]["schedule"], (drawn, best)
    assert c["baseline"]["trial"] == f"quick.{strongest}#{drawn[strongest].number}"
    assert c["baseline"]["mean"] == pytest.approx(sum(conf) / len(conf))

    # Same numerics: trial 0 of each study is the run's own point (P=2 a=4 b=2) at the run's seed.
    first = {s: studies[s].trials[0] for s in ("1f1b", "zb-h1")}
    assert first["1f1b"].params == first["zb-h1"].params
    shared = first["zb-h1"].user_attrs.get("shared_from")
    if shared is not None:  # one curve (tune/curves.py's key): the search answered it from flush's run (test_sharing)
        assert shared["study"] == "quick.1f1b", shared
    else:
        flush, zb = _evals(tmp_path, "1f1b", 0), _evals(tmp_path, "zb-h1", 0)
        common = sorted(set(flush) & set(zb) - {0})
        assert len(common) >= 2, (flush, zb)  # steps both evaluated, beyond the initial one
        for step in common:
            assert zb[step] == pytest.approx(flush[step], abs=1e-5), step
    step_s = {s: first[s].user_attrs["clock_step_time_s"] for s in first}
    assert step_s["zb-h1"] < step_s["1f1b"]  # ZB-H1's shorter steps: more of them in the same budget
    reached = {s: first[s].user_attrs.get("time_to_target") for s in first}
    if reached["1f1b"] is not None:
        assert reached["zb-h1"] is not None and reached["zb-h1"] <= reached["1f1b"] + 1e-9


@pytest.mark.whole_machine  # wall-clock trials of 2 stage processes: a core each
def test_a_wall_clock_search_trains_zb_h1_and_interleaved_for_real(tmp_path: Path) -> None:
    """``schedules: [paci, zb-h1, interleaved]`` on the wall clock: every trial runs on the
    distributed runtime (2 stage processes), zb-h1 and interleaved through torch's own classes -- each
    trial's summary names the schedule it ran as its numerics (not 1F1B standing in), interleaved on
    its 4 pieces, 2 per rank -- and each study trains the same number of search trials."""
    schedules = ["paci", "zb-h1", "interleaved"]  # 1f1b: the same runtime as paci, tested elsewhere
    config = _config(
        tmp_path,
        {"schedules": schedules, "stages": [2], "microbatch_size": [2], "chunks": [2]},
        budget={"clock": "wall", "seconds": 0.5},
        target={"value": 3.3},
        search={"trials": 1, "pruner": "none", "confirm": {"top": 0}},
    )
    proc = run(search_cmd(config, tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for s in schedules:
        path = tmp_path / "work" / "trials" / f"quick.{s}" / "trial-0000" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        summary = next(r for r in rows if r.get("event") == "summary")
        assert (summary["runtime"], summary["clock_name"]) == ("distributed", "wall"), s
        assert summary["numerics_schedule"] == summary["schedule"] == s
        assert len(summary["stages"]) == (4 if s == "interleaved" else 2), s
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    counts = {
        s: sum(t.state.is_finished() for t in optuna.load_study(study_name=f"quick.{s}", storage=storage).trials)
        for s in schedules
    }
    assert counts == dict.fromkeys(schedules, 1), counts


@pytest.mark.parametrize(
    ("space", "sections", "key"),
    [
        (
            {"schedules": ["paci", "interleaved"], "stages": [2], "microbatch_size": [2], "chunks": [1]},
            {},
            "space.chunks",
        ),
        (
            {"schedules": ["paci", "zb-h1"], "stages": [2], "microbatch_size": [2]},  # zb-h1 runs for real only
            {"budget": {"clock": "wall"}, "hardware": {"runtime": "emulated"}},  # distributed
            "space.schedules",
        ),
    ],
)
def test_a_space_the_tool_cannot_run_exits_2_naming_the_key(
    tmp_path: Path, space: dict[str, Any], sections: dict[str, Any], key: str
) -> None:
    proc = run(search_cmd(_config(tmp_path, space, **sections), tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {key}:") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "best.yaml").exists()
