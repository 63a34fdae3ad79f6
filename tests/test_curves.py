"""Issue 39's ground: which layouts train the same curve, and a key that says so exactly.

The oracle is a fresh run of each layout: every layout the numerics key calls equal must train a
validation curve (and training losses) within 1e-5 of every other's, and every setting that changes
the numbers must change the key. Also checked: on a budget in seconds the LR schedule reads each
layout's own clock, so layouts of one global batch do *not* share a curve there, and
``lr_schedule.horizon_steps`` makes them share it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_in_process, train_losses
from helpers.configs import make_config

from paci_tune.config import load_run_config
from paci_tune.tune.curves import numerics_key

TOL = 1e-5
PROFILE = Path(__file__).resolve().parents[1] / "paci_tune" / "base" / "share" / "profiles" / "tiny-gpt.yaml"


def _doc(schedule: str, stages: int, d: int, b: int, **more: Any) -> dict[str, Any]:
    """Global batch 16 over D x a x b; an LR that warms up and decays, so the horizon matters."""
    doc = make_config(
        data={"draw": "sequence"},  # every split of a global batch on the same sequences
        training={"global_batch": 16, "steps": 8, "eval_every": 2, "eval_sequences": 8},
        lr_schedule={"warmup_fraction": 0.1, "min_ratio": 0.1, "scaling": "none"},
        pipeline={
            "schedule": schedule,
            "stages": stages,
            "data_parallel": d,
            "microbatch_size": b,
            "window": 16 // (d * b),
            "runtime": "emulated",
            "device": "cpu",
        },
    )
    for section, values in more.items():  # model and data are replaced whole (drawing sequences), the rest merged
        doc[section] = (
            {"draw": "sequence", **values}
            if section == "data"
            else values
            if section == "model"
            else {**doc.get(section, {}), **values}
        )
    return doc


def _curve(doc: dict[str, Any]) -> tuple[list[float], list[float]]:
    records = run_in_process(copy.deepcopy(doc))
    return train_losses(records), [r["val_loss"] for r in records if r.get("event") == "eval"]


def _key(doc: dict[str, Any]) -> str | None:
    return numerics_key(load_run_config(copy.deepcopy(doc)))


def _same(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]]) -> bool:
    return all(
        len(x) == len(y) and max(abs(u - v) for u, v in zip(x, y, strict=True)) <= TOL
        for x, y in zip(a, b, strict=True)
    )


# Classes the key calls equal: flush at P = 1, 2, 4 across D, a and b; zb-h1 and interleaved against it
# (on the sim clock: they are timed schedules) and PACI at P = 1; PACI across D and b at a fixed P, a and cut.
SYNCHRONOUS = [
    ("1f1b", 1, 1, 4),
    ("1f1b", 2, 2, 4),
    ("1f1b", 4, 1, 1),
    ("1f1b", 2, 1, 2),
    ("gpipe", 2, 2, 2),
    ("paci", 1, 2, 2),
]  # PACI on one stage: nothing in flight
PACI = [("paci", 2, 1, 4), ("paci", 2, 2, 2), ("paci", 2, 4, 1)]


@pytest.mark.parametrize("members", [SYNCHRONOUS, PACI], ids=["synchronous", "paci-P2-a4"])
def test_layouts_one_key_calls_equal_train_one_curve(members: list[tuple[str, int, int, int]]) -> None:
    pinned = {"partition": [1, 3]} if members is PACI else {}  # PACI's key needs its cut pinned
    docs = [_doc(*m, pipeline=pinned) for m in members]
    keys = {_key(d) for d in docs}
    assert len(keys) == 1 and None not in keys
    first = _curve(docs[0])
    for m, doc in zip(members[1:], docs[1:], strict=True):
        assert _same(_curve(doc), first), m


def test_timed_schedules_share_flushs_key_and_curve() -> None:
    """zb-h1 and interleaved train 1f1b's numbers (paci_tune.train.timed); on a step budget their key is flush's."""
    sim = {"clock": "sim", "profile": str(PROFILE)}
    tiny = {"preset": "tiny"}  # the profile's model (examples/tiny-gpt.yaml)
    data = {"source": "stdlib"}
    flush = _doc("1f1b", 2, 1, 4, training=sim, model=tiny, data=data)
    zb = _doc("zb-h1", 2, 1, 4, training=sim, model=tiny, data=data)
    inter = _doc("interleaved", 2, 1, 4, training=sim, model=tiny, data=data, pipeline={"chunks": 2})
    assert _key(flush) == _key(zb) == _key(inter) == _key(_doc("1f1b", 2, 2, 2, training=sim, model=tiny, data=data))


def test_paci_depth_and_window_change_the_curve_and_the_key() -> None:
    base = _doc("paci", 2, 1, 4, pipeline={"partition": [1, 3]})
    deeper = _doc("paci", 4, 1, 4, pipeline={"partition": [1, 1, 1, 1]})
    wider = _doc("paci", 2, 2, 4, pipeline={"partition": [1, 3]})  # a = 2
    assert len({_key(base), _key(deeper), _key(wider)}) == 3
    assert not _same(_curve(base), _curve(deeper)) and not _same(_curve(base), _curve(wider))


def test_under_the_default_draw_b_decides_the_data_and_stays_in_the_key() -> None:
    """``data.draw: microbatch`` (the default): each micro-batch draws its own b windows, so flush at
    b = 4 and b = 1 train different curves and keep different keys; at one b, P, D and a still share."""
    by_batch = {
        "source": "synthetic",
        "vocab_size": 64,
        "branching": 4,
        "n_train": 50_000,
        "n_val": 5_000,
        "draw": "microbatch",
    }
    four, one = _doc("1f1b", 1, 1, 4, data=by_batch), _doc("1f1b", 1, 1, 1, data=by_batch)
    assert _key(four) != _key(one) and not _same(_curve(four), _curve(one))
    other = _doc("1f1b", 2, 2, 4, data=by_batch)  # D = 2, a = 2, b = 4
    assert _key(other) == _key(four) and _same(_curve(other), _curve(four))


def test_paci_with_a_cut_left_to_the_planner_keeps_b_and_d() -> None:
    """``partition: auto`` is chosen from b and D (memory-aware): no key may assume the cut is the same."""
    assert _key(_doc("paci", 2, 1, 4)) != _key(_doc("paci", 2, 2, 2))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("optimizer", "lr", 2.0e-3),
        ("optimizer", "betas", [0.8, 0.95]),
        ("optimizer", "name", "nadam"),
        ("training", "seed", 1),
        ("training", "global_batch", 32),
        ("training", "eval_sequences", 16),
        ("lr_schedule", "min_ratio", 0.5),
        ("lr_schedule", "horizon_steps", 20),
        ("pipeline", "precision", "bf16"),
        ("pipeline", "backward_weights", "current"),
        ("pipeline", "stage_momentum", 0.99),
        ("model", "n_layer", 3),
        ("data", "branching", 3),
        ("training", "steps", 9),
    ],
)
def test_every_setting_that_changes_the_numbers_changes_the_key(section: str, key: str, value: Any) -> None:
    base = _doc("paci", 2, 1, 4, pipeline={"partition": [1, 3]})
    changed = copy.deepcopy(base)
    changed[section][key] = value
    if key == "global_batch":
        changed["pipeline"]["window"] = 8
    assert _key(changed) != _key(base), f"{section}.{key}"


def test_what_only_reads_the_curve_leaves_the_key() -> None:
    base = _doc("1f1b", 2, 1, 4)
    reads = [
        ("training", "eval_every", 3),
        ("training", "target_val_loss", 3.0),
        ("training", "clock", "wall"),
        ("pipeline", "runtime", "distributed"),
        ("training", "eval_microbatch_size", 4),
    ]
    for section, key, value in reads:
        changed = copy.deepcopy(base)
        changed[section][key] = value
        assert _key(changed) == _key(base), f"{section}.{key}"


def test_the_warm_start_checkpoint_is_part_of_the_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.pt").write_bytes(b"one")
    doc = _doc("1f1b", 2, 1, 4, training={"init_from": str(ckpt)})
    before = _key(doc)
    assert before != _key(_doc("1f1b", 2, 1, 4))
    (ckpt / "state.pt").write_bytes(b"other")  # written again in place
    assert _key(doc) != before


def test_on_a_budget_in_seconds_layouts_follow_their_own_clocks_unless_the_horizon_is_in_steps() -> None:
    """The finding that shapes issue 39: with the LR decaying over each layout's own sim clock, two flush
    layouts of one global batch train different curves (their keys differ); with
    ``lr_schedule.horizon_steps`` they train one (one key)."""
    tiny = {"preset": "tiny"}
    timed = {
        "clock": "sim",
        "profile": str(PROFILE),
        "steps": None,
        "seconds": 0.8,
        "eval_every": 2,
        "global_batch": 16,
        "eval_sequences": 8,
    }
    one = _doc("1f1b", 1, 1, 4, training=timed, model=tiny, data={"source": "stdlib"})
    two = _doc("1f1b", 2, 2, 2, training=timed, model=tiny, data={"source": "stdlib"})
    assert _key(one) != _key(two)
    c1, c2 = _curve(one), _curve(two)
    n = min(len(c1[0]), len(c2[0]))
    assert n >= 3 and max(abs(u - v) for u, v in zip(c1[0][:n], c2[0][:n], strict=True)) > TOL
    for doc in (one, two):
        doc["lr_schedule"]["horizon_steps"] = 8
    assert _key(one) == _key(two)
    h1, h2 = _curve(one), _curve(two)
    n = min(len(h1[0]), len(h2[0]))
    assert n >= 3 and max(abs(u - v) for u, v in zip(h1[0][:n], h2[0][:n], strict=True)) <= TOL


def test_a_run_whose_lr_reads_the_wall_clock_has_no_key() -> None:
    wall = {"clock": "wall", "steps": None, "seconds": 5.0}
    assert _key(_doc("1f1b", 2, 1, 4, training=wall)) is None
    assert _key(_doc("1f1b", 2, 1, 4, training=wall, lr_schedule={"horizon_steps": 8})) is not None
    assert _key(_doc("1f1b", 2, 1, 4, training={"clock": "wall"})) is not None  # a step budget
