"""Every layout of a curve (issue 39, item 3): a study's other points of a trained curve are queued and
answered from it (paci_tune.tune.siblings).

Oracles: the space itself (its feasible points and, independently of the search, each point's numerics
key: the flush study must hold every flush point of each curve it has), a fresh training of each queued
layout's own run (it must score what the study stored, :func:`helpers.sharing.scores_as_trained`), the
quota (only the sampler's trials count), and the same search with ``search.every_layout: false``.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from helpers.cli import check_ok
from helpers.searches import run, search_cmd, studies, write_search
from helpers.sharing import scores_as_trained
from optuna.trial import TrialState

from paci_tune.config import derive_run
from paci_tune.tune.curves import numerics_key
from paci_tune.tune.record import TrialRecord
from paci_tune.tune.session import open_search
from paci_tune.tune.study import counted

pytestmark = pytest.mark.slow  # two searches with trial processes, then every queued layout trained again

# 4 devices, global batch 8: flush at P=1 D=4 b=2, P=2 D=2 b=2 and b=4 (P=1 b=4 has no whole window) is
# one curve per LR; PACI at P=2 is one curve per window.
SPACE = {"schedules": ["1f1b", "paci"], "stages": [1, 2], "microbatch_size": [2, 4]}


def _search(tmp: Path, every_layout: bool) -> tuple[Path, dict[str, optuna.Study]]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "space.yaml").write_text(yaml.safe_dump(SPACE))
    config = write_search(
        tmp,
        search={"trials": 1, "sampler": "random", "pruner": "none", "seed": 3, "every_layout": every_layout},
        budget={"seconds": 0.3, "grid": 3},
        training={"eval_sequences": 16},
    )
    check_ok(run(search_cmd(config, tmp), timeout=600))
    return config, studies(f"sqlite:///{tmp / 'work' / 'study.db'}")


def test_a_study_holds_every_layout_of_each_curve_it_trained(tmp_path: Path) -> None:
    config, st = _search(tmp_path / "on", every_layout=True)
    session = open_search(config, workdir=tmp_path / "on" / "work", out=tmp_path / "best.yaml")
    search = session.search(lambda e: None)
    target = float(session.tune.target.value or 0.0)
    flush = st["1f1b"]
    done = flush.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    records = {t.number: TrialRecord.read(t) for t in done}
    sampled = [t for t in done if records[t.number].sibling_of is None]
    queued = [t for t in done if records[t.number].sibling_of is not None]
    assert len(sampled) == 1 and counted(flush.get_trials(), 1) == 1  # the queued layouts use no quota

    def key(params: dict) -> str | None:  # the point's run as its own trial trains it, from the space alone
        return numerics_key(derive_run(search.trial_doc(search.space.suggest(optuna.trial.FixedTrial(params), "1f1b"))))

    grid = [search.space.params_of(q) for q in search.space.grid("1f1b")]
    assert len(grid) == 3
    want = {tuple(sorted(p.items())) for p in grid if key(p) == key(sampled[0].params)}
    assert {tuple(sorted(t.params.items())) for t in done} == want  # every layout of the curve, once each
    assert len(queued) == len(want) - 1 >= 2
    for t in queued:
        rec = records[t.number]
        assert rec.sibling_of == sampled[0].number and rec.shared_from is not None and rec.numerics is None
        assert not (tmp_path / "on" / "work" / "trials" / flush.study_name / f"trial-{t.number:04d}").exists()
        scores_as_trained(search, target, "1f1b", t)  # what its own training scores

    _, off = _search(tmp_path / "off", every_layout=False)
    assert len(off["1f1b"].get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 1
    assert off["1f1b"].get_trials()[0].params == sampled[0].params  # the same seed samples the same point
