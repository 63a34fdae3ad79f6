"""The same answer on every machine: a search on the rst clock (No Train No Gain's Reference System
Time) times every trial from the profile it is given, never from this machine, so two runs of one
search -- each its own process, work folder and storage -- give the same studies and the same
recommendation, verdict, speedup and interval (issue 26: the example searches on the rst clock).

The search is ``bench/search_seeds.py``'s quick one (QUICK, QUICK_SPACE, QUICK_PROFILE): a tiny
synthetic model on a hand-written reference profile, a few seconds per search.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.cli import check_ok
from helpers.searches import quick_search, run, search_cmd, studies

pytestmark = pytest.mark.slow


def _config(tmp: Path) -> Path:
    """QUICK on its reference profile, over a budget long enough that runs reach the target at different
    times and some miss it (so the scores differ from trial to trial), confirmed on 2 seeds."""
    q = quick_search()
    (tmp / "space.yaml").write_text(yaml.safe_dump(q.QUICK_SPACE))
    (tmp / "profile.yaml").write_text(yaml.safe_dump(q.QUICK_PROFILE))
    doc = {
        **q.QUICK,
        "target": {"value": 3.2},
        "budget": {**q.QUICK["budget"], "seconds": 0.3, "grid": 6, "profile": str(tmp / "profile.yaml")},
        "search": {
            **q.QUICK["search"],
            "space": str(tmp / "space.yaml"),
            "trials": 2,
            "sampler": "tpe",
            "pruner": "hyperband",
            "seed": 0,
        },
    }
    assert doc["budget"]["clock"] == "rst"
    path = tmp / "model.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _trials(storage: str) -> dict[str, list[tuple[Any, ...]]]:
    """Per schedule, each trial's number, state, params, value and intermediate values."""
    return {
        schedule: [(t.number, t.state.name, t.params, t.values, dict(t.intermediate_values)) for t in study.trials]
        for schedule, study in studies(storage).items()
    }


def _on_the_clock(evidence: dict[str, Any]) -> dict[str, Any]:
    """The evidence a profile clock decides (not the runtime's wall-clock throughput or measured memory)."""
    keep = ("trial", "time_to_target", "reached_target", "best_val_loss", "score", "steps")
    return {k: v for k, v in evidence.items() if k in keep or k.startswith("clock_")}


def test_two_searches_on_the_rst_clock_answer_the_same(tmp_path: Path) -> None:
    config = _config(tmp_path)
    folders = [tmp_path / "first", tmp_path / "second"]
    for tmp in folders:
        tmp.mkdir()
    with ThreadPoolExecutor(2) as pool:  # side by side: each slows the other, which must not matter
        for proc in pool.map(lambda tmp: run(search_cmd(config, tmp)), folders):
            check_ok(proc)
    a, b = (yaml.safe_load((tmp / "best.yaml").read_text()) for tmp in folders)
    trials = [_trials(f"sqlite:///{tmp / 'work' / 'study.db'}") for tmp in folders]
    assert a["verdict"] in ("paci", "flush", "tie", "undecided")
    for key in ("verdict", "recommended", "baseline_schedule", "comparison"):
        assert a.get(key) == b.get(key), f"{key}: {a.get(key)!r} != {b.get(key)!r}"
    assert _on_the_clock(a["evidence"]) == _on_the_clock(b["evidence"])
    assert a["comparison"]["n"] == 2 and len(a["comparison"]["ratios"]) == 2  # confirmed: every seed's ratio too
    assert a["confirmation"] == b["confirmation"]  # every confirmed seed's score
    assert trials[0] == trials[1]
    assert all(len(ts) == 4 for ts in trials[0].values())  # 2 search trials and 2 confirmation seeds each
    scores = {t[3][0] for ts in trials[0].values() for t in ts if t[3]}
    assert len(scores) > 1, scores  # the runs differ from one another, so agreeing says something
