"""An entry function that takes a keyword ``units`` builds only the units a rank owns (model.loader).

Oracles: what the function records it was asked to build (helpers.probe_models.BUILT_LOG), and the same
model built whole by a function without the opt-in, whose training the opt-in run must equal.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO
from helpers.cli import check_ok, cli_command, cli_env, read_metrics, run_in_process, train_losses
from helpers.configs import make_config, write_config
from helpers.guide_models import PYTHONPATH
from helpers.probe_models import BUILT_LOG

from paci_tune.errors import ConfigError
from paci_tune.model import load_model

SIZE = {"vocab_size": 64, "d_model": 32, "n_layer": 4, "n_head": 2, "block_size": 32}


def _spec(fn: str) -> dict[str, Any]:
    return {"entry": f"helpers.probe_models:{fn}", "kwargs": dict(SIZE), "block_size": 32}


def _asked(log: Path) -> list[tuple[int, list[int] | None]]:
    return [(r["pid"], r["units"]) for r in map(json.loads, log.read_text().splitlines())] if log.exists() else []


def test_given_the_whole_model_an_opt_in_function_builds_only_the_units_asked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(BUILT_LOG, str(tmp_path / "built.jsonl"))
    whole = load_model(_spec("build_own"), 64, 0)  # the checks' load: every unit
    part = load_model(_spec("build_own"), 64, 0, [4, 2], whole=whole)
    assert [u for _, u in _asked(tmp_path / "built.jsonl")] == [None, [2, 4]]
    assert sorted(part.units) == [2, 4] and part.n_units == 6 and part.trainable == whole.trainable
    for i in (2, 4):  # each unit as the whole build's
        got, want = part.units[i].state_dict(), whole.units[i].state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    plain = load_model(_spec("build_all"), 64, 0, [2, 4], whole=whole)  # no opt-in: every unit, as before
    assert sorted(plain.units) == list(range(6))


def test_an_opt_in_function_returning_other_units_is_refused(monkeypatch) -> None:
    import helpers.probe_models as models

    whole = load_model(_spec("build_own"), 64, 0)

    def wrong(units: list[int] | None = None, **kwargs: int) -> list[torch.nn.Module]:
        return models.build_all(**kwargs)  # every unit whatever it is asked

    monkeypatch.setattr(models, "build_wrong", wrong, raising=False)
    with pytest.raises(ConfigError) as err:
        load_model(_spec("build_wrong"), 64, 0, [1], whole=whole)
    assert err.value.key == "model.entry" and "called with units=[1], returns those units" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_model({**_spec("build_own"), "kwargs": {**SIZE, "units": [0]}}, 64, 0)
    assert err.value.key == "model.kwargs"


def _doc(fn: str) -> dict[str, Any]:
    doc = make_config(training={"steps": 3, "eval_every": 3}, pipeline={"stages": 2, "partition": [3, 3]})
    doc["model"] = _spec(fn)
    return doc


def test_emulated_opt_in_trains_as_the_whole_build() -> None:
    got, want = run_in_process(_doc("build_own")), run_in_process(_doc("build_all"))
    assert train_losses(got) == train_losses(want)


@pytest.mark.slow
def test_distributed_ranks_build_only_their_own_units(tmp_path: Path) -> None:
    log, metrics = tmp_path / "built.jsonl", tmp_path / "m.jsonl"
    env = {**cli_env(), "PYTHONPATH": PYTHONPATH, BUILT_LOG: str(log)}
    cmd = cli_command(write_config(tmp_path, _doc("build_own")), "--runtime", "distributed", "--metrics", metrics)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False)
    check_ok(proc)
    rank_builds = [(pid, units) for pid, units in _asked(log) if units is not None]
    assert sorted(units for _, units in rank_builds) == [[0, 1, 2], [3, 4, 5]]  # each rank its stage's units
    assert len({pid for pid, _ in rank_builds}) == 2  # in two processes
    want = run_in_process(copy.deepcopy(_doc("build_all")))
    assert train_losses(read_metrics(metrics)) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
