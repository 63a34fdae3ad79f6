"""A real A/A search: two arms identical by construction must end in a tie.

bench/search_seeds.py's QUICK search (a tiny synthetic model on a hand-written reference profile, the rst
clock) over a space of one depth, P = 1 on 2 devices: there PACI has nothing in flight and trains
1F1B-flush's numbers to the bit (tests/test_curves.py), and both take the same simulated step, so every
confirmed seed's ratio is exactly 1. Oracle: that construction -- the per-seed scores read back from the
Optuna storage must be equal pairwise, and the verdict a tie whose interval is [1, 1]; a rule that called
a winner here, or let a zero spread turn into an undecided or NaN verdict, fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.cli import check_ok
from helpers.searches import quick_search, run, search_cmd, studies

pytestmark = pytest.mark.slow


def test_identical_arms_end_in_a_tie(tmp_path: Path) -> None:
    q = quick_search()
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({**q.QUICK_SPACE, "stages": [1]}))
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(q.QUICK_PROFILE))
    doc = {
        **q.QUICK,
        "target": {"value": 3.35},  # reached by every run
        "budget": {**q.QUICK["budget"], "seconds": 0.3, "grid": 6, "profile": str(tmp_path / "profile.yaml")},
        "search": {
            **q.QUICK["search"],
            "space": str(tmp_path / "space.yaml"),
            "trials": 2,
            "seed": 0,
            "confirm": {"top": 1, "seeds": 3},
        },
    }
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    check_ok(run(search_cmd(config, tmp_path)))
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    c = best["comparison"]
    assert c["paci"]["stages"] == c["baseline"]["stages"] == 1
    per_seed = {}
    for schedule, study in studies(f"sqlite:///{tmp_path / 'work' / 'study.db'}").items():
        runs = [t for t in study.trials if "confirm" in t.user_attrs]
        per_seed[schedule] = {t.user_attrs["confirm"]["seed"]: t.value for t in runs}
    assert per_seed["paci"] == per_seed["1f1b"] and len(per_seed["paci"]) == c["n"] >= 3
    assert best["verdict"] == c["verdict"] == "tie" and c["interval"] == [1.0, 1.0]
    assert set(c["ratios"].values()) == {1.0} and c["stopped_by"] == "narrow"
    assert best["recommended"]["schedule"] == "1f1b"  # a tie recommends the synchronous point
