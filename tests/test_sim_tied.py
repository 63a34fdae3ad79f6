"""The simulator charges tied parameters' all-reduce among their holders (paci_tune/sim/tied.py).

Oracle: the ring formula written out here, not read from the code: an all-reduce of ``B`` bytes over
``n`` ranks with one ring step of latency ``L`` and bandwidth ``W`` takes ``2 (n-1)/n * B / W + 2 (n-1) L``.
On equal stages under 1F1B and GPipe, stage 0 is the last to finish each batch's backwards and the
first to start the next batch's forwards, so a tie between the first and the last stage lengthens
every global batch by exactly one all-reduce among 2 holders; a tie kept on one stage by nothing. And
calibrate records what the model shares: tests/helpers/guide_models.py ``build_tied`` (unit 5
multiplies by unit 0's ``tok.weight``, ``vocab_size x d_model`` fp32 parameters).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers.configs import write_config
from helpers.guide_runs import doc_for
from helpers.profiles import FREE, unit

from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.sim import Profile, simulate
from paci_tune.sim.profile import P2PCost
from paci_tune.sim.tied import TiedGroup

LATENCY, BANDWIDTH = 1e-3, 1e6  # one ring step of the profile's all-reduce
TIED_BYTES = 500_000


def ring(nbytes: float, ranks: int) -> float:
    """The module docstring's formula, written independently of AllReduceCost.ring_s."""
    return 2 * (ranks - 1) / ranks * nbytes / BANDWIDTH + 2 * (ranks - 1) * LATENCY


def doc(n_units: int, tied: list[dict[str, Any]] | None = None, **unit_kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "seq_len": 16,
        "units": [unit(1.0, 2.0, **unit_kw) for _ in range(n_units)],
        "p2p": FREE,
        "allreduce": {"latency_s": LATENCY, "bandwidth_Bps": BANDWIDTH},
    }
    if tied is not None:
        out["tied"] = tied
    return out


def step_times(layout: Layout, tied: list[dict[str, Any]], n_units: int = 4) -> tuple[float, float, float]:
    """(average, steady) step time added by ``tied``, and the untied profile's step time."""
    untied = simulate(layout, Profile.from_dict(doc(n_units)), 8)
    with_tie = simulate(layout, Profile.from_dict(doc(n_units, tied)), 8)
    return (
        with_tie.step_time_s - untied.step_time_s,
        with_tie.steady_step_time_s - untied.steady_step_time_s,
        untied.step_time_s,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "data_parallel"), [(2, 1), (4, 1), (4, 2)])
def test_a_tie_between_first_and_last_stage_adds_one_ring_all_reduce_of_two_holders(
    schedule: str, stages: int, data_parallel: int
) -> None:
    layout = Layout(schedule, stages, data_parallel, window=8, partition=(1,) * stages)
    added, steady, before = step_times(layout, [{"units": [0, stages - 1], "bytes": TIED_BYTES}], n_units=stages)
    expected = ring(TIED_BYTES, 2)
    assert expected > 0.4  # the tie is not lost in rounding: ~0.5 s against a step of ~33 s
    assert added == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert steady == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert before > 10 * expected


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_tie_kept_on_one_stage_costs_nothing(schedule: str) -> None:
    layout = Layout(schedule, 2, 1, window=8, partition=(2, 2))
    added, steady, _ = step_times(layout, [{"units": [0, 1], "bytes": TIED_BYTES}])
    assert added == 0.0 and steady == 0.0
    res = simulate(layout, Profile.from_dict(doc(4, [{"units": [0, 1], "bytes": TIED_BYTES}])), 8)
    assert [st.tied_allreduce_s for st in res.per_stage] == [0.0, 0.0]


def test_the_holders_steps_meet_and_each_pays_the_all_reduce() -> None:
    """A tie between the two middle stages of four (neither on the critical path's end): the holders'
    steps end together at every batch (optimizer_s 0: the all-reduce is the step), non-holders pay nothing,
    and the JSON and the all-reduce share say so."""
    layout = Layout("1f1b", 4, 1, window=4, partition=(1, 1, 1, 1))
    res = simulate(layout, Profile.from_dict(doc(4, [{"units": [1, 2], "bytes": TIED_BYTES}])), 6)
    expected = ring(TIED_BYTES, 2)
    assert [st.tied_allreduce_s for st in res.per_stage] == pytest.approx([0.0, expected, expected, 0.0])
    ends = [[end for act, _, end in st.intervals if act.op.value == "S"] for st in res.timeline.stages]
    assert ends[1] == pytest.approx(ends[2])
    assert res.to_dict()["stages"][1]["tied_allreduce_s"] == pytest.approx(expected)
    share = 2 * expected * res.n_batches / (res.makespan_s * 4)
    assert res.allreduce_fraction == pytest.approx(share)


def test_three_holders_sum_in_one_ring_of_three() -> None:
    layout = Layout("gpipe", 3, 1, window=4, partition=(1, 1, 1))
    added, _, _ = step_times(layout, [{"units": [0, 1, 2], "bytes": TIED_BYTES}], n_units=3)
    assert added == pytest.approx(ring(TIED_BYTES, 3))


def test_paci_refuses_a_cut_splitting_a_tie_and_keeps_one_on_a_stage() -> None:
    prof = Profile.from_dict(doc(4, [{"units": [0, 3], "bytes": TIED_BYTES}]))
    with pytest.raises(ConfigError) as err:
        simulate(Layout("paci", 2, 1, window=4, partition=(2, 2)), prof, 8)
    assert err.value.key == "pipeline.schedule" and "[(0, 1)]" in err.value.allowed
    simulate(Layout("paci", 1, 1, window=4, partition=(4,)), prof, 8)


def test_a_profile_without_tied_loads_unchanged_and_tied_round_trips() -> None:
    old = doc(4)
    prof = Profile.from_dict(old)
    assert prof.tied == [] and "tied" not in prof.to_dict()
    assert Profile.from_dict(prof.to_dict()) == prof
    tied = Profile.from_dict(doc(4, [{"units": [3, 0], "bytes": TIED_BYTES}]))
    assert tied.tied == [TiedGroup((0, 3), TIED_BYTES)]
    assert tied.to_dict()["tied"] == [{"units": [0, 3], "bytes": TIED_BYTES}]
    assert Profile.from_dict(tied.to_dict()) == tied
    assert tied.scale(2.0).tied == tied.tied


@pytest.mark.parametrize(
    ("tied", "key"),
    [
        ({"units": [0, 3]}, "profile.tied"),
        ([{"units": [0], "bytes": 8}], "profile.tied[0].units"),
        ([{"units": [0, 4], "bytes": 8}], "profile.tied[0].units"),
        ([{"units": [1, 1], "bytes": 8}], "profile.tied[0].units"),
        ([{"units": [0, [1]], "bytes": 8}], "profile.tied[0].units"),
        ([{"units": [0, 1], "bytes": 0}], "profile.tied[0].bytes"),
        ([{"units": [0, 1], "bytes": True}], "profile.tied[0].bytes"),
        ([{"units": [0, 1]}], "profile.tied[0]"),
        ([{"units": [0, 1], "bytes": 8, "names": ["w"]}], "profile.tied[0]"),
    ],
)
def test_bad_tied_entries_are_refused_naming_the_key(tied: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        Profile.from_dict({**doc(4), "tied": tied})
    assert err.value.key == key


def test_the_models_ties_replace_an_old_profiles_for_a_run(tmp_path) -> None:
    """check_profile (train's and simulate's path to a profile) gives the profile the model's tied groups:
    an old profile of build_tied times 1f1b's all-reduce, and PACI's split cut is refused, not timed."""
    from paci_tune.calibrate.predict import predict_schedules
    from paci_tune.config import load_config

    cfg = load_config(write_config(tmp_path, doc_for("1f1b", [3, 3], entry="build_tied")))
    path = tmp_path / "old.yaml"
    Profile.from_dict({**doc(6), "seq_len": 32}).save(path)  # the guide model's 6 units, no tied key
    pred = predict_schedules(cfg, schedules=["paci", "1f1b"], profile_path=str(path), batches=4)
    assert pred.profile.tied == [TiedGroup((0, 5), 4 * 64 * 32)]  # tok.weight: vocab 64 x d_model 32
    assert [st.tied_allreduce_s for st in pred.results["1f1b"].per_stage] == pytest.approx([ring(4 * 64 * 32, 2)] * 2)
    assert set(pred.results) == {"1f1b"} and pred.not_fitting["paci"].startswith("pipeline.schedule")


@pytest.mark.slow
def test_calibrate_records_the_tied_embedding(tmp_path) -> None:
    from paci_tune.calibrate import calibrate
    from paci_tune.config import load_config

    cfg = load_config(write_config(tmp_path, doc_for("1f1b", [3, 3], entry="build_tied", n_layer=1)))
    prof = calibrate(
        cfg,
        microbatch_sizes=[2],
        repeats=1,
        warmup=0,
        threads=1,
        processes=1,
        p2p=P2PCost(0.0, math.inf),
        allreduce=False,
    )
    assert prof.n_units == 3
    assert prof.tied == [TiedGroup((0, 2), 4 * 64 * 32)]
    assert Profile.from_dict(prof.to_dict()).tied == prof.tied
