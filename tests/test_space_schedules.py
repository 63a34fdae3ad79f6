"""A search space names any schedule of the registry: the stronger synchronous baselines ``zb-h1``,
``interleaved`` (with ``chunks``), ``zb-v`` and ``dualpipev`` (two chunks a rank, in a V) beside flush and PACI.

Oracles written out here, not taken from the code under test: the Cartesian product of a small
space's choices (what a grid must visit), torch's rule for interleaved 1F1B (``rounds = max(1, m // P)``
must divide ``m``; DualPipeV's ``m >= 2P``) and the count of pieces (``v * P`` at most the model's units), and the
contract that
interleaved and zb-h1 run for real on the distributed runtime only (torch's own classes), so a search
of either on the wall clock and the emulated runtime is refused naming ``space.schedules``. No training here
(``test_search_baselines`` runs one).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.configs import make_config
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.config import derive_doc
from paci_tune.config.tune import load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.tune.apply import apply_run
from paci_tune.tune.bestfile import read_best, write_best
from paci_tune.tune.point import TrialParams
from paci_tune.tune.space import SearchSpace, load_space
from paci_tune.verdict.best import build_best, params_of

ALL = ["paci", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev", "gpipe"]


def _space(tmp_path: Path, n_units: int = 4, global_batch: int = 8, **keys: Any) -> SearchSpace:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"schedules": ALL, "stages": [1, 2], "microbatch_size": [1, 2, 4], **keys}))
    return load_space(str(path), global_batch=global_batch, n_units=n_units, max_stages=None)


def _pieces_ok(p: int, a: int, v: int, n_units: int) -> bool:
    """torch's interleaved rule and the model's units, written out independently of the code."""
    rounds = max(1, a // p)
    return a % rounds == 0 and v * p <= n_units


def test_grid_is_the_product_less_what_each_schedule_cannot_run(tmp_path: Path) -> None:
    space = _space(tmp_path, chunks=[2, 3])
    for schedule in ("paci", "1f1b", "zb-h1", "gpipe", "zb-v", "dualpipev"):
        got = {(q.stages, q.window, q.microbatch_size, q.chunks) for q in space.grid(schedule)}
        depths = [1, 2] if schedule == "1f1b" else [2]  # P = 1 is no pipeline under every schedule: flush's study
        v = 2 if schedule in ("zb-v", "dualpipev") else 1  # a V: two chunks a rank, 2P = 4 pieces of 4 units
        fewest = 4 if schedule == "dualpipev" else 1  # DualPipeV: at least 2P micro-batches
        want = {(p, 8 // b, b, v) for p, b in itertools.product(depths, [1, 2, 4]) if 8 // b >= fewest}
        assert got == want, schedule
    got = {(q.stages, q.window, q.microbatch_size, q.chunks) for q in space.grid("interleaved")}
    product = itertools.product([1, 2], [1, 2, 4], [2, 3])
    want = {(p, 8 // b, b, v) for p, b, v in product if _pieces_ok(p, 8 // b, v, 4) and p == 2}
    assert got == want and len(want) == 3  # P=2 v=3 needs 6 pieces of 4 units: dropped for every b
    assert space.grid_params("interleaved")["chunks"] == [2, 3]
    assert "chunks" not in space.grid_params("zb-h1") and "chunks" not in space.grid_params("1f1b")
    assert sum("6 pieces, more than the model's 4 units" in d for d in space.dropped) == 3


def test_window_interleaved_cannot_run_is_refused_with_torchs_reason(tmp_path: Path) -> None:
    space = _space(tmp_path, global_batch=10, stages=[2], microbatch_size=[1, 2], n_units=8)
    assert _pieces_ok(2, 10, 2, 8) and not _pieces_ok(2, 5, 2, 8)  # a = 5 on P = 2: 2 rounds do not divide 5
    assert space.why_not(TrialParams("interleaved", 2, 10, 1, chunks=2)) is None
    why = space.why_not(TrialParams("interleaved", 2, 5, 2, chunks=2))
    assert why is not None and "rounds" in why
    assert space.why_not(TrialParams("1f1b", 2, 5, 2)) is None
    assert "rounds" in str(space.why_not(TrialParams("zb-h1", 2, 5, 2)))  # torch's zero-bubble class: rounds too
    assert any(d.startswith("interleaved P=2 v=2 a=5 b=2") for d in space.dropped)


def test_suggest_names_v_only_in_interleaved_study(tmp_path: Path) -> None:
    space = _space(tmp_path, chunks=[2])
    for schedule in ALL:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        trial = study.ask()
        q = space.suggest(trial, schedule)
        assert ("chunks" in trial.params) == (schedule == "interleaved"), schedule
        assert q.chunks == (2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1)
        study.tell(trial, 1.0)
        back = params_of(study.trials[0], schedule, 8)  # best.yaml reads the point back from the storage
        assert back == q
        assert ("pipeline.chunks" in q.overrides()) == (q.chunks > 1)


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"chunks": [1]}, "space.chunks"),
        ({"chunks": [2, 1]}, "space.chunks"),
        ({"schedules": ["paci", "zb-h1", "zb-h1"]}, "space.schedules"),
        ({"schedules": ["paci", "zb-h2"]}, "space.schedules"),
        ({"chunks": [3, 4], "stages": [2]}, "space.chunks"),  # no point leaves interleaved a run on 4 units
    ],
)
def test_bad_spaces_name_the_key(tmp_path: Path, keys: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        _space(tmp_path, **keys)
    assert e.value.key == key


WALL = {"budget": {"clock": "wall", "seconds": 1.0}}  # trials on the distributed runtime (hardware.runtime null)
WALL_EMULATED = {"budget": {"clock": "wall", "seconds": 1.0}, "hardware": {"devices": 2, "runtime": "emulated"}}
SIM_DISTRIBUTED = {"budget": {"clock": "sim", "seconds": 1.0}, "hardware": {"devices": 2, "runtime": "distributed"}}
SIM = {"budget": {"clock": "sim", "seconds": 1.0}}


@pytest.mark.parametrize(
    ("schedule", "sections", "refused"),
    [
        ("interleaved", WALL_EMULATED, True),  # as zb-h1: only the distributed runtime runs it for real
        ("interleaved", WALL, False),  # torch's own class on the distributed runtime
        ("interleaved", SIM_DISTRIBUTED, False),
        ("interleaved", SIM, False),
        ("zb-h1", WALL_EMULATED, True),  # the emulated runtime trains 1F1B's numbers: only a profile clock times it
        ("zb-h1", WALL, False),  # the distributed runtime runs it for real (torch's own class)
        ("zb-h1", SIM_DISTRIBUTED, False),
        ("zb-h1", SIM, False),
        ("zb-v", WALL_EMULATED, True),
        ("zb-v", WALL, False),
        ("dualpipev", WALL_EMULATED, True),
        ("dualpipev", SIM, False),
    ],
)
def test_timed_schedules_only_where_their_trials_can_run(
    tmp_path: Path, sections: dict[str, Any], refused: bool, schedule: str
) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"schedules": ["paci", schedule], "stages": [2], "microbatch_size": [2]}))
    doc = {
        **make_config(),
        "target": {"value": 2.0},
        "hardware": {"devices": 2},
        "search": {"space": str(space)},
        **sections,
    }
    if not refused:
        load_tune_config(doc)
        return
    with pytest.raises(ConfigError) as e:
        load_tune_config(doc)
    assert e.value.key == "space.schedules" and schedule in str(e.value) and "simulator" in str(e.value)


# --------------------------------------------------------------------------------- best.yaml and apply
def _study(schedule: str, value: float, partition: list[int], chunks: int | None = None) -> optuna.Study:
    """A study of one finished search trial at P=2, b=2 (a = 8/2 = 4) that reached the target at ``value``."""
    params: dict[str, Any] = {"stages": 2, "microbatch_size": 2}
    dists: dict[str, Any] = {"stages": CategoricalDistribution([2]), "microbatch_size": CategoricalDistribution([2])}
    if chunks is not None:
        params["chunks"], dists["chunks"] = chunks, CategoricalDistribution([chunks])
    attrs = {"time_to_target": value, "best_val_loss": 1.0, "partition": partition, "steps": 4}
    study = optuna.create_study(study_name=f"t.{schedule}", direction="minimize")
    study.add_trial(
        create_trial(state=TrialState.COMPLETE, value=value, params=params, distributions=dists, user_attrs=attrs)
    )
    return study


TWO_CHUNKS = ("interleaved", "zb-v", "dualpipev")


@pytest.mark.parametrize("winner", ["zb-h1", "interleaved", "zb-v", "dualpipev", "gpipe"])
def test_best_yaml_names_the_strongest_baseline_and_apply_trains_it(tmp_path: Path, winner: str) -> None:
    # Hand-chosen scores: the winner 2.0 beats PACI 3.0, which beats 1F1B-flush 4.0 (the other baselines 5.0),
    # each gap above the time to target's resolution (2.0 s / 4 validations = 0.5 s).
    scores = {s: 5.0 for s in ALL} | {"paci": 3.0, "1f1b": 4.0, winner: 2.0}
    studies = {
        s: _study(s, v, [1, 1, 1, 1] if s in TWO_CHUNKS else [2, 2], 2 if s == "interleaved" else None)
        for s, v in scores.items()
    }
    run = make_config(training={"steps": 4}, pipeline={"window": 4, "runtime": "emulated"})
    sim = {"training.clock": "sim", "training.profile": "profiles/tiny-gpt.yaml"}
    doc = build_best(
        studies,
        run_doc_for=lambda p: derive_doc(copy.deepcopy(run), {**p.overrides(), **sim}),
        base_lr=1e-3,
        fixed_batch=8,
        target={"metric": "val_loss", "value": 3.0},
        budget={"clock": "sim", "seconds": 2.0, "grid": 4},
        provenance={"study_name": "t"},
    )
    assert doc["recommended"]["schedule"] == winner and doc["baseline_schedule"] == winner
    c = doc["comparison"]  # PACI against the strongest synchronous point, not the easiest (flush, 4.0)
    assert c["baseline"]["schedule"] == winner and c["baseline"]["mean"] == 2.0 and c["paci"]["mean"] == 3.0
    assert c["speedup"] == pytest.approx(2 / 3, abs=1e-4) and doc["verdict"] == c["verdict"] == "flush"
    path = tmp_path / "best.yaml"
    write_best(path, doc)
    best = read_best(path)
    assert best.baseline_schedule == winner
    cfg = apply_run(path, {})
    assert cfg.pipeline.schedule == winner and cfg.training.clock == "sim"
    assert cfg.layout.chunks == (2 if winner in TWO_CHUNKS else 1)
    assert best.recommended.extra.get("chunks") == (2 if winner in TWO_CHUNKS else None)


def test_a_flush_only_comparison_is_one_record(tmp_path: Path) -> None:
    """A [paci, 1f1b] search: the comparison's baseline is flush, and no per-baseline key pairs are written."""
    doc = build_best(
        {"paci": _study("paci", 2.0, [2, 2]), "1f1b": _study("1f1b", 4.0, [2, 2])},
        run_doc_for=lambda p: derive_doc(make_config(), p.overrides()),
        base_lr=1e-3,
        fixed_batch=8,
        target={},
        budget={"seconds": 5.0, "grid": 4},
        provenance={},
    )
    assert doc["baseline_schedule"] == "1f1b" and doc["comparison"]["speedup"] == 2.0 and doc["verdict"] == "paci"
    old = {
        "speedup_vs_baseline",
        "paci_speedup_vs_baseline",
        "paci_baseline_interval",
        "verdict_vs_flush",
        "paci_speedup_vs_flush",
        "paci_speedup_interval",
        "baseline",
        "paci_won",
        "speedup_note",
    }
    assert not old & set(doc)
