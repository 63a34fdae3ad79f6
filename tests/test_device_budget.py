"""The search holds the device count fixed: every trial is P x D = ``hardware.devices``.

Oracles: divisor arithmetic (which (P, b) a budget admits), the Optuna storage of a real search
(every trial's P and D read back with Optuna), best.yaml's run section, and exit code 2 with the
key named for a budget that is missing, too large for the wall clock, or leaves no point.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers import REPO
from helpers.cli import check_ok, cli_env
from helpers.configs import NARROW_MODEL, merge
from helpers.searches import SEARCH_DOC
from optuna.trial import TrialState

from paci_tune.base.processes import cpu_count
from paci_tune.errors import ConfigError
from paci_tune.sim.profile import P2PCost, Profile, UnitCost, UnitProfile
from paci_tune.tune.narrow import restrict
from paci_tune.tune.space import TrialParams, load_space
from paci_tune.tune.study import counted

DOC: dict[str, Any] = merge(
    SEARCH_DOC,
    {
        "model": NARROW_MODEL,
        "data": {"vocab_size": 32, "n_train": 20_000, "n_val": 2_000},
        "training": {"steps": 4, "eval_sequences": 8},
        "target": {"value": 2.5},
        "budget": {"seconds": 0.2, "grid": 2},  # a handful of global batches per trial
        "search": {"sampler": "random"},
    },
)
# g = 8 on 4 devices: P=1 D=4 (8/4 = 2 per replica: b=2), P=2 D=2 (b=2, 4), P=4 D=1 (b=2, 4); P=3 never.
SPACE = {"schedules": ["paci", "1f1b"], "stages": [1, 2, 3, 4], "microbatch_size": [2, 4]}


def _space(tmp_path: Path, doc: dict[str, Any], **kw: Any) -> Any:
    p = tmp_path / "space.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_space(str(p), **{"global_batch": 8, "n_units": 4, "max_stages": None, **kw})


def _write(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in DOC.items()}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v} if v is not None else None
    doc = {k: v for k, v in doc.items() if v is not None}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    # A hand profile of the model's 4 units (no calibration in the test): the sim clock is exact.
    units = [
        UnitProfile(f"u{i}", 40_000, 1e-4, {b: UnitCost(1e-3 * b, 2e-3 * b, 2048 * b, 8192 * b) for b in (2, 4)})
        for i in range(4)
    ]
    Profile(units, P2PCost(1e-5, 1e9), seq_len=16).save(tmp_path / "profile.yaml")
    doc["search"] = {**doc["search"], "space": str(tmp_path / "space.yaml")}
    if "budget" in doc:
        doc["budget"] = {**doc["budget"], "profile": str(tmp_path / "profile.yaml")}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _search(config: Path, tmp: Path) -> Any:
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "paci_tune.cli",
        "search",
        str(config),
        "--no-live",
        "--workdir",
        str(tmp / "work"),
        "--out",
        str(tmp / "best.yaml"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=cli_env())


# ---------------------------------------------------------------------------- binding the space
def test_budget_keeps_only_points_that_divide(tmp_path: Path) -> None:
    s = _space(tmp_path, SPACE, devices=4)
    assert s.stages == (1, 2, 4) and s.microbatch_size == (2, 4)
    assert set(s.points) == {(1, 1, 2), (2, 2, 2), (2, 1, 4), (4, 4, 2), (4, 2, 4)}  # (P, a, b)
    assert any(why.startswith("P=3:") for why in s.dropped)
    assert any(why.startswith("P=1 D=4 b=4:") for why in s.dropped)
    grid = s.grid("1f1b")
    assert len(grid) == 5 and all(q.devices == 4 and q.global_batch == 8 for q in grid)
    # PACI at P = 1 is flush: its study leaves that layout to flush's
    assert {(q.stages, q.microbatch_size) for q in s.grid("paci")} == {
        (q.stages, q.microbatch_size) for q in grid if q.stages > 1
    }
    assert "1f1b's study searches this layout" in (s.why_not(TrialParams("paci", 1, 1, 2, 1.0, 4)) or "")
    bad = TrialParams("1f1b", 1, s.window_of(1, 4), 4, 1.0, 4)
    assert bad.window == 0 and "not a whole number" in (s.why_not(bad) or "")
    assert s.why_not(TrialParams("paci", 2, 1, 4, 1.0, 2)) is None
    # Without a budget (the API default) every P is D = 1, as before.
    s1 = _space(tmp_path, {"stages": [2, 4], "microbatch_size": [2, 4]})
    assert {q.data_parallel for q in s1.grid()} == {1} and len(s1.grid("paci")) == 4


def test_free_batch_under_a_budget_multiplies_d_in(tmp_path: Path) -> None:
    s = _space(
        tmp_path,
        {"global_batch": "free", "stages": [2, 8], "window": [2], "microbatch_size": [4]},
        devices=8,
        n_units=8,
    )
    assert {(q.stages, q.data_parallel, q.global_batch) for q in s.grid("paci")} == {(2, 4, 32), (8, 1, 8)}


def test_no_point_left_names_the_budget_and_every_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _space(tmp_path, {"stages": [2, 4], "microbatch_size": [2]}, devices=3)
    assert e.value.key == "hardware.devices" and "P=2:" in e.value.allowed and "P=4:" in e.value.allowed
    s = _space(tmp_path, SPACE, devices=4)
    kept = restrict(s, lambda q: None if q.stages == 4 else f"P={q.stages}: too big")
    assert kept.stages == (4,) and "P=1: too big" in kept.dropped
    with pytest.raises(ConfigError) as e:
        restrict(s, lambda q: "predicted 9 GiB vs 1 GiB")
    assert e.value.key == "hardware.devices" and "9 GiB" in e.value.allowed


def test_an_infeasible_proposal_is_answered_unrun_and_not_counted(tmp_path: Path) -> None:
    from paci_tune.base.files import read_yaml
    from paci_tune.config.tune import load_tune_config
    from paci_tune.tune.search import Search

    tune = load_tune_config(read_yaml(_write(tmp_path)))
    space = _space(tmp_path, SPACE, devices=4)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    study.enqueue_trial({"stages": 1, "microbatch_size": 4})  # D=4: a = 8/(4*4) is not whole
    search = Search(tune, space, {"1f1b": study}, runner=None, workdir=tmp_path, profile=None)  # type: ignore[arg-type]
    search.run_trial("1f1b")  # never reaches the runner
    (t,) = study.trials
    assert t.state == TrialState.PRUNED and t.user_attrs["fail_reason"].startswith("rejected: P=1 D=4 b=4")
    assert not t.intermediate_values and t.value is None
    assert t.params["stages"] * t.user_attrs["data_parallel"] == 4 and t.user_attrs["infeasible"]
    assert counted(study.trials, quota=3) == 0


# ------------------------------------------------------------------------------- bad budgets
@pytest.mark.parametrize("case", ["missing", "wall-too-many"])
def test_bad_budget_names_hardware_devices(tmp_path: Path, case: str) -> None:
    from paci_tune.tune.session import open_search

    sections: dict[str, Any] = {
        "missing": {"hardware": None},
        "wall-too-many": {"hardware": {"devices": cpu_count() + 1}, "budget": {"clock": "wall", "seconds": 1.0}},
    }[case]
    with pytest.raises(ConfigError) as e:
        open_search(_write(tmp_path, **sections), workdir=tmp_path / "work")
    assert e.value.key == "hardware.devices"
    assert not (tmp_path / "work" / "study.db").exists() or case == "wall-too-many"


@pytest.mark.slow
def test_a_budget_leaving_no_point_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # No depth of [1, 2, 3, 4] but 1 divides 5 devices, and 8 sequences do not split over 5 replicas.
    proc = _search(_write(tmp_path, hardware={"devices": 5}), tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: hardware.devices: got 5;") and "Traceback" not in proc.stderr
    assert "P=1 D=5" in last and "P=2:" in last and not (tmp_path / "best.yaml").exists()


# ------------------------------------------------------------------------------ a real search
@pytest.mark.slow
def test_search_on_four_devices_runs_only_p_times_d_four(tmp_path: Path) -> None:
    proc = _search(_write(tmp_path), tmp_path)
    check_ok(proc)
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    seen = set()
    for s in ("paci", "1f1b"):
        st = optuna.load_study(study_name=f"model.{s}", storage=storage)
        assert st.trials
        for t in st.trials:
            p, d = t.params["stages"], t.params.get("data_parallel", t.user_attrs.get("data_parallel"))
            assert p * d == 4, (s, t.number, t.params, t.user_attrs)
            if t.state == TrialState.COMPLETE:
                seen.add((p, d))
            else:
                assert t.state != TrialState.FAIL, t.user_attrs
    assert seen, "no trial completed"
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    rec, run = best["recommended"], best["run"]
    assert rec["stages"] * rec["data_parallel"] == rec["devices"] == 4
    assert rec["data_parallel"] * rec["window"] * rec["microbatch_size"] == 8
    assert run["pipeline"]["data_parallel"] == rec["data_parallel"] and run["pipeline"]["stages"] == rec["stages"]
    assert best["provenance"]["space"]["devices"] == 4
