"""``paci-tune search`` and ``apply`` on transformers models: a tied GPT-2 untied for PACI, and a Llama.

The search is bench/search_seeds.py's QUICK search (a hand-written reference profile on the rst clock,
so nothing is measured) with the model replaced, over the shipped spaces' depths 2, 4 and 8 (8 is
dropped: these models have 4 units). It must finish with a best.yaml whose run is the model it was
given, whose provenance states what untying cost (the tied matrix: data vocabulary x n_embd), and
which ``apply`` then trains.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from helpers.cli import check_ok
from helpers.searches import quick_search, run, search_cmd

pytest.importorskip("transformers")

SPACE = {"schedules": ["paci", "1f1b"], "stages": [2, 4, 8], "microbatch_size": [2]}


def _search(tmp_path: Path, model: dict) -> dict:
    q = quick_search()
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(q.QUICK_PROFILE))
    doc = {
        **q.QUICK,
        "model": model,
        "hardware": {"devices": 4},
        "search": {**q.QUICK["search"], "space": str(tmp_path / "space.yaml"), "confirm": {"top": 0}},
        "budget": {**q.QUICK["budget"], "profile": str(tmp_path / "profile.yaml")},
    }
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run(search_cmd(config, tmp_path), timeout=240)
    check_ok(proc)
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["run"]["model"] == model
    applied = run([sys.executable, "-m", "paci_tune.cli", "apply", str(tmp_path / "best.yaml"), "--no-live"])
    check_ok(applied)
    return {"best": best, "apply": applied}


@pytest.mark.slow
def test_search_and_apply_an_untied_hf_gpt2(tmp_path: Path) -> None:
    out = _search(tmp_path, {"hf": "tiny-gpt2", "untie": True, "block_size": 16})
    cost = 32 * 64  # QUICK's 32-token data x tiny-gpt2's n_embd 64: the head's copy of the embedding
    assert out["best"]["provenance"]["untie"].startswith(f"untie: +{cost:,} parameters")
    assert f"untie: +{cost:,} parameters" in out["apply"].stderr  # the run's opening line
    # A PACI answer: PACI's study trained pipelined points (P >= 2 splits the tied pair) to a score.
    table = yaml.safe_dump(out["best"]["candidates"])
    assert re.search(r"paci P=[24] ", table), table
    assert out["best"]["verdict"], out["best"]


@pytest.mark.slow
def test_search_and_apply_an_hf_llama(tmp_path: Path) -> None:
    out = _search(tmp_path, {"hf": "tiny-llama", "block_size": 16})
    assert "untie" not in out["best"]["provenance"]
