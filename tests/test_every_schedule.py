"""Every schedule of the registry works in every layer, or is refused when the config is read.

One parametrized test per layer, over the registry's names, so a new schedule is exercised everywhere
the moment it is registered: the config, a search space, the memory model under a budget, the
simulator, the emulated runtime, the distributed runtime, the shared-curve key, the verdict's choice of
baseline and the report's colours.

Oracles written out here: plain single-process gradient accumulation (:func:`helpers.oracles.
plain_training`, what every synchronous schedule computes: its losses at P = 2 equal P = 1's within
1e-5); the bytes of each rank's weights summed by hand over the pieces it holds (looped: s, s + P, ...;
a V: s and 2P - 1 - s); torch's and the papers' rules for what each schedule refuses; the schedules'
textbook bubbles at equal costs and free transfers, by hand.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.cli import check_ok, read_metrics, run_cli, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import CONSTANT_LR, plain_training
from helpers.profiles import make_profile

from paci_tune.config import derive_run, load_run_config
from paci_tune.errors import ConfigError
from paci_tune.schedule import NAMES, SYNCHRONOUS, build, replay, schedule_of, strongest
from paci_tune.tune.curves import numerics_key
from paci_tune.tune.space import load_space

V_SHAPED = [n for n in NAMES if schedule_of(n).placement == "v"]
F_UNIT, B_UNIT, PARAM = 1e-3, 2e-3, 40_000


def _doc(schedule: str, stages: int = 2, **pipeline: Any) -> dict[str, Any]:
    return make_config(
        training={"steps": 4, "global_batch": 8, "eval_every": 1000, "eval_sequences": 4},
        optimizer={"lr": 3e-3},
        lr_schedule=CONSTANT_LR,
        pipeline={"schedule": schedule, "stages": stages, "window": 4, **pipeline},
    )


def _profile(tmp_path: Path) -> Path:
    cost = {"forward_s": F_UNIT, "backward_s": B_UNIT, "activation_bytes": 1000, "saved_bytes": 5000}
    units = [{"param_bytes": PARAM * (i + 1), "optimizer_s": 1e-4, "microbatch": {2: cost}} for i in range(4)]
    path = tmp_path / "profile.yaml"
    make_profile(units, seq_len=32).save(path)
    return path


def _timed(schedule: str, tmp_path: Path) -> dict[str, Any]:
    """On a profile clock: where the emulated runtime trains a timed schedule's numbers (1F1B's)."""
    doc = _doc(schedule)
    doc["training"].update({"clock": "sim", "profile": str(_profile(tmp_path))})
    return doc


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_it_and_refuses_what_it_cannot_run(name: str) -> None:
    spec = schedule_of(name)
    cfg = derive_run(_doc(name, runtime="distributed"))
    assert cfg.pipeline.schedule == name and cfg.layout.chunks == spec.chunks_of(None)
    assert cfg.layout.virtual_stages == 2 * spec.chunks_of(None)
    if spec.chunks is not None:  # a schedule that fixes its chunks refuses another count, naming the key
        with pytest.raises(ConfigError) as e:
            derive_run(_doc(name, chunks=spec.chunks + 1))
        assert e.value.key == "pipeline.chunks"
    if name == "dualpipev":  # DualPipeV: at least 2P micro-batches (torch's ScheduleDualPipeV)
        with pytest.raises(ConfigError) as e:
            derive_run(_doc(name, window=2, runtime="distributed"))
        assert e.value.key == "pipeline.window" and "at least 4" in e.value.allowed


# ------------------------------------------------------------------------------------------ space


@pytest.mark.parametrize("name", NAMES)
def test_a_space_of_it_binds_with_its_chunks(tmp_path: Path, name: str) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"schedules": [name], "stages": [2], "microbatch_size": [1, 2]}))
    space = load_space(str(path), global_batch=8, n_units=4, max_stages=None)
    grid = space.grid(name)
    assert grid and all(q.chunks == schedule_of(name).chunks_of(None) for q in grid)


# ------------------------------------------------------------------------------- memory and time


def _weights_by_hand(name: str, stages: int, units: list[int]) -> list[int]:
    """Each rank's weight bytes: the units of the pieces it holds, summed here by placement."""
    v = schedule_of(name).chunks_of(None)
    n = stages * v
    pieces = [units[j * len(units) // n : (j + 1) * len(units) // n] for j in range(n)]
    if schedule_of(name).placement == "v":
        held = [[s, 2 * stages - 1 - s] for s in range(stages)]
    else:
        held = [[s + c * stages for c in range(v)] for s in range(stages)]
    return [sum(sum(pieces[j]) for j in js) for js in held]


@pytest.mark.parametrize("name", NAMES)
def test_memory_model_holds_each_ranks_pieces(tmp_path: Path, name: str) -> None:
    from paci_tune.pipeline.planning import predicted_stage_memory
    from paci_tune.sim.profile import Profile

    profile = Profile.load(_profile(tmp_path))
    cfg = derive_run(_timed(name, tmp_path))
    v = schedule_of(name).chunks_of(None)
    sizes = [1] * (2 * v) if v > 1 else [2, 2]
    got = predicted_stage_memory(cfg, profile, sizes)
    assert len(got) == 2 and all(m.allocated > 0 for m in got)
    want = _weights_by_hand(name, 2, [PARAM * (i + 1) for i in range(4)])
    assert [m.params for m in got] == want


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_simulated_bubble_is_the_registrys_at_equal_costs(name: str) -> None:
    """Equal stages, F = 1, B = 2 (B = W = 1 where split), each chunk 1/v of that, free transfers."""
    spec = schedule_of(name)
    p, m = 4, 8
    v = spec.chunks_of(None)
    if spec.refusal(p, m, v):
        pytest.skip(spec.refusal(p, m, v)[1])  # type: ignore[index]
    per = {"F": 1.0, "B": 1.0 if spec.split_backward else 2.0, "W": 1.0, "S": 0.0}
    lists = build(name, p, m, 0, 1, chunks=v)
    tl = replay(lists, lambda s, a: per[a.op.value] / v, chunks=v, placement=spec.placement)
    assert tl.bubble_fraction == pytest.approx(spec.bubble(p, m, v), abs=1e-9)


# ------------------------------------------------------------------------------------- runtimes


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_emulated_runtime_trains_plain_accumulation(tmp_path: Path, name: str) -> None:
    """P = 2 on the emulated runtime: every synchronous schedule's losses are P = 1's (plain training)."""
    from helpers.cli import run_in_process

    doc = _timed(name, tmp_path)
    records = run_in_process(copy.deepcopy(doc))
    losses, val_loss, _ = plain_training(doc)
    assert train_losses(records) == pytest.approx(losses, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(val_loss, abs=1e-5, rel=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_distributed_runtime_trains_plain_accumulation(tmp_path: Path, name: str) -> None:
    """P = 2 ranks under torchrun (gloo): the schedule runs for real (torch's class where it has one)."""
    doc = _doc(name, runtime="distributed")
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--metrics", metrics, timeout=300))
    records = read_metrics(metrics)
    losses, val_loss, _ = plain_training(doc)
    assert train_losses(records) == pytest.approx(losses, abs=1e-5, rel=0)
    summary = summary_of(records)
    assert summary["final_val_loss"] == pytest.approx(val_loss, abs=1e-5, rel=0)
    assert (summary["schedule"], summary["numerics_schedule"], summary["runtime"]) == (name, name, "distributed")
    assert summary["clock_name"] == "wall" and summary["max_drift"] == 0
    assert {st["updates"] for st in summary["stages"]} == {4}  # every piece of every rank stepped every batch


# ----------------------------------------------------------------------- curves, verdict, report


@pytest.mark.parametrize("name", NAMES)
def test_shared_curve_key_is_flushs_for_every_synchronous_schedule(tmp_path: Path, name: str) -> None:
    key = numerics_key(load_run_config(_timed(name, tmp_path)))
    one_stage = {**_timed("1f1b", tmp_path), "pipeline": _doc("1f1b", 1)["pipeline"]}
    flush_one_stage = numerics_key(load_run_config(one_stage))
    assert key is not None
    assert (key == flush_one_stage) == schedule_of(name).synchronous


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_the_verdict_takes_it_as_the_baseline_when_it_is_strongest(name: str) -> None:
    scores = {s: 5.0 for s in SYNCHRONOUS} | {name: 1.0}
    assert strongest(scores) == name
    assert strongest({s: 5.0 for s in SYNCHRONOUS}) == "1f1b"  # a tie goes to flush, the simplest


def test_the_report_draws_every_schedule_in_a_colour_of_its_own() -> None:
    from paci_tune.report.figures import COLOURS

    assert set(COLOURS) == set(NAMES) and len(set(COLOURS.values())) == len(NAMES)
