"""Data parallelism in planning: the all-reduce cost, the DP x PP timeline, per-device memory.

Oracles: the ring all-reduce formula ``2 (D-1)/D * bytes / bandwidth + 2 (D-1) * latency`` worked
out by hand, a 1F1B timeline of P=2, D=2, a=2 with unit costs placed by hand, and the profile's
own YAML read back. Hand-written profiles only (plus one real, quick gloo measurement), so the
expected figures are exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.configs import sim_config, write_config

from paci_tune.calibrate.allreduce import fit_allreduce, measure_allreduce
from paci_tune.cli import main
from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.schedule.actions import Op
from paci_tune.sim import Profile, simulate
from paci_tune.sim.partitioner import partition
from paci_tune.train.clock import ProfileClock

FREE = {"latency_s": 0.0, "bandwidth_Bps": math.inf}


def _unit(f: float, b: float, params: int = 4000, opt: float = 0.0) -> dict[str, Any]:
    cost = {"forward_s": f, "backward_s": b, "activation_bytes": 100, "saved_bytes": 500}
    return {"param_bytes": params, "optimizer_s": opt, "microbatch": {1: cost}}


def _profile(units: list[dict[str, Any]], allreduce: dict[str, Any] | None = None) -> Profile:
    doc: dict[str, Any] = {"seq_len": 16, "units": units, "p2p": FREE}
    if allreduce is not None:
        doc["allreduce"] = allreduce
    return Profile.from_dict(doc)


def ring(nbytes: float, d: int, latency: float, bandwidth: float) -> float:
    """The analytic ring all-reduce, written out independently of the code under test."""
    return 2 * (d - 1) / d * nbytes / bandwidth + 2 * (d - 1) * latency


# ------------------------------------------------------------------------------ the all-reduce term
@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_simulated_allreduce_is_the_ring_formula(d: int) -> None:
    lat, bw = 3e-4, 2e6
    prof = _profile(
        [_unit(1, 2, params=4000, opt=0.1), _unit(1, 2, params=12000, opt=0.2)], {"latency_s": lat, "bandwidth_Bps": bw}
    )
    r = simulate(Layout("1f1b", 2, d, 2, 1, None, (1, 1)), prof, n_batches=2)
    for st, nbytes, opt in zip(r.per_stage, (4000, 12000), (0.1, 0.2), strict=True):
        assert st.allreduce_s == pytest.approx(ring(nbytes, d, lat, bw), rel=1e-12)
        steps = [end - start for act, start, end in r.timeline.stages[st.stage].intervals if act.op is Op.STEP]
        assert steps == pytest.approx([opt + ring(nbytes, d, lat, bw)] * 2, rel=1e-12)
    assert r.layout.global_batch == d * 2 * 1 and r.layout.devices == 2 * d
    assert (r.allreduce_fraction == 0.0) is (d == 1)


def test_d1_is_exactly_the_plain_simulation() -> None:
    prof = _profile([_unit(1, 2, opt=0.1) for _ in range(4)], {"latency_s": 1e-3, "bandwidth_Bps": 1e6})
    for schedule in ("paci", "1f1b", "gpipe"):
        plain = simulate(Layout(schedule, 2, 1, 4, 1, None, (2, 2)), prof, n_batches=4)
        one = simulate(Layout(schedule, 2, 1, 4, 1, None, (2, 2)), prof, n_batches=4)
        assert one.to_dict() == plain.to_dict()
        assert one.timeline.makespan == plain.timeline.makespan


def test_hand_worked_dp_pp_timeline() -> None:
    """P=2, D=2, a=2, 1F1B, one global batch, free transfers; F=1, B=2 per stage, optimizer 0.

    All-reduce of 4000 B over D=2 at 4000 B/s and 0.25 s latency: 2*(1/2)*1 + 2*1*0.25 = 1.5 s.
    Stage 1: F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7], step [7,8.5].
    Stage 0: F0 [0,1], F1 [1,2], B0 [4,6] (after stage 1's B0), B1 [7,9], step [9,10.5].
    """
    prof = _profile([_unit(1, 2), _unit(1, 2)], {"latency_s": 0.25, "bandwidth_Bps": 4000})
    r = simulate(Layout("1f1b", 2, 2, 2, 1, None, (1, 1)), prof, n_batches=1, extend=False)
    got = [[(a.op.name, a.mb, s, e) for a, s, e in st.intervals] for st in r.timeline.stages]
    assert got[0] == [
        ("FORWARD", 0, 0, 1),
        ("FORWARD", 1, 1, 2),
        ("BACKWARD", 0, 4, 6),
        ("BACKWARD", 1, 7, 9),
        ("STEP", 0, 9, 10.5),
    ]
    assert got[1] == [
        ("FORWARD", 0, 1, 2),
        ("BACKWARD", 0, 2, 4),
        ("FORWARD", 1, 4, 5),
        ("BACKWARD", 1, 5, 7),
        ("STEP", 0, 7, 8.5),
    ]
    assert r.makespan_s == 10.5
    assert r.allreduce_fraction == pytest.approx((1.5 + 1.5) / (2 * 10.5))
    # The sim clock reads the same layout: batch 0 closes when the last stage steps, the model when stage 0 does.
    clock = ProfileClock("sim", prof, Layout("1f1b", 2, 2, window=2, microbatch_size=1, partition=(1, 1)))
    plan = clock.plan(1)
    assert (plan.batch_end, plan.model_end, plan.makespan) == ((8.5,), (10.5,), 10.5)


def test_paci_steady_step_grows_by_the_allreduce_of_the_bottleneck() -> None:
    """Equal stages, one step per global batch per stage: the steady period is a*(F+B) + opt + all-reduce."""
    prof = _profile([_unit(1, 2) for _ in range(2)], {"latency_s": 0.05, "bandwidth_Bps": 8000})
    base = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), prof, n_batches=16)
    dp = simulate(Layout("paci", 2, 4, 4, 1, None, (1, 1)), prof, n_batches=16)
    assert base.steady_step_time_s == pytest.approx(4 * 3)
    assert dp.steady_step_time_s == pytest.approx(4 * 3 + ring(4000, 4, 0.05, 8000))


def test_partitioner_weighs_the_allreduce_and_memory_is_per_device() -> None:
    """A heavy-parameter unit: with D=8 its all-reduce dominates and the cut moves; memory is D-free."""
    units = [_unit(1, 1, params=4), _unit(1, 1, params=4), _unit(1, 1, params=4), _unit(1.2, 1, params=40_000)]
    prof = _profile(units, {"latency_s": 0.0, "bandwidth_Bps": 10_000})
    assert partition(prof, Layout("paci", 2, window=1, microbatch_size=1)).sizes == [2, 2]
    assert partition(prof, Layout("paci", 2, data_parallel=8, window=1, microbatch_size=1)).sizes == [3, 1]
    one = simulate(Layout("paci", 2, 1, 2, 1, None, (2, 2)), prof)
    eight = simulate(Layout("paci", 2, 8, 2, 1, None, (2, 2)), prof)
    assert [s.peak_memory_bytes for s in one.per_stage] == [s.peak_memory_bytes for s in eight.per_stage]


# ---------------------------------------------------------------------------------- the profile
def test_profile_allreduce_round_trips_and_old_profiles_derive_it_from_p2p(tmp_path: Path) -> None:
    prof = _profile([_unit(1, 2)], {"latency_s": 1e-4, "bandwidth_Bps": 5e8, "backend": "nccl-nvlink"})
    path = tmp_path / "p.yaml"
    prof.save(path)
    back = Profile.load(path)
    assert back.allreduce == prof.allreduce and back.allreduce.backend == "nccl-nvlink"
    old = Profile.from_dict({"seq_len": 16, "units": [_unit(1, 2)], "p2p": {"latency_s": 2e-5, "bandwidth_Bps": 1e9}})
    assert (old.allreduce.latency_s, old.allreduce.bandwidth_Bps) == (2e-5, 1e9)
    assert "allreduce" not in old.to_dict()  # a derived cost is not written back as if measured
    scaled = prof.scale(2.0)
    assert (scaled.allreduce.latency_s, scaled.allreduce.bandwidth_Bps) == (2e-4, 2.5e8)


@pytest.mark.parametrize(
    ("allreduce", "key"),
    [
        ({"latency_s": -1, "bandwidth_Bps": 1e9}, "profile.allreduce.latency_s"),
        ({"latency_s": 0, "bandwidth_Bps": 0}, "profile.allreduce.bandwidth_Bps"),
        ({"latency_s": 0, "bandwidth_Bps": 1, "speed": 3}, "profile.allreduce.speed"),
        ("fast", "profile.allreduce"),
    ],
)
def test_bad_allreduce_names_the_key(allreduce: Any, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        Profile.from_dict({"seq_len": 16, "units": [_unit(1, 2)], "p2p": FREE, "allreduce": allreduce})
    assert e.value.key == key


def test_fit_recovers_a_ring_step_from_all_reduce_times() -> None:
    lat, bw = 7e-5, 3e9
    for ranks in (2, 4):
        points = {n: ring(n, ranks, lat, bw) for n in (16_384, 524_288, 4_194_304)}
        got_lat, got_bw = fit_allreduce(points, ranks)
        assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


@pytest.mark.slow
def test_measured_gloo_allreduce_is_positive_and_grows_with_size() -> None:
    cost = measure_allreduce(2, sizes=[16_384, 2**21], repeats=2)
    assert cost.latency_s >= 0 and 0 < cost.bandwidth_Bps < math.inf
    assert cost.ring_s(2**21, 2) > cost.ring_s(16_384, 2) > 0


@pytest.mark.slow
def test_one_launch_measures_both_links_as_the_separate_measurements_do() -> None:
    from paci_tune.calibrate import measure_links

    sizes = {"allreduce_sizes": [16_384, 2**21], "allreduce_repeats": 2}
    p2p, allreduce = measure_links([1024, 256 * 1024], p2p_repeats=3, **sizes)
    assert p2p.backend == "gloo-loopback" and allreduce.backend == "gloo-loopback x2"
    assert p2p.latency_s >= 0 and 0 < p2p.bandwidth_Bps < math.inf
    assert allreduce.latency_s >= 0 and 0 < allreduce.bandwidth_Bps < math.inf
    assert allreduce.ring_s(2**21, 2) > allreduce.ring_s(16_384, 2) > 0


# ------------------------------------------------------------------------------- simulate command
def test_simulate_shows_d_and_the_allreduce_share(tmp_path: Path) -> None:
    from paci_tune.sim.profile import UnitCost, UnitProfile

    doc = sim_config(
        data={"vocab_size": 32, "n_train": 2000, "n_val": 200},
        training={"global_batch": 16, "steps": 2, "eval_sequences": 8},
    )
    cfg = write_config(tmp_path, {**doc, "pipeline": {"stages": 2, "device": "cpu"}}, "m.yaml")  # no window: D sets it
    units = [UnitProfile(f"u{i}", 40_000, 1e-3, {2: UnitCost(1e-3, 2e-3, 1000, 4000)}) for i in range(4)]
    from paci_tune.sim.profile import P2PCost

    prof = Profile(units, P2PCost(1e-5, 1e9), seq_len=16)
    prof.save(tmp_path / "p.yaml")
    args = [
        "simulate",
        str(cfg),
        "--profile",
        str(tmp_path / "p.yaml"),
        "--schedule",
        "paci",
        "--data-parallel",
        "2",
        "--microbatch-size",
        "2",
    ]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.output)
    r = doc["schedules"]["paci"]
    assert (doc["data_parallel"], doc["devices"], doc["window"], r["global_batch"]) == (2, 4, 4, 16)
    assert r["allreduce_fraction"] > 0 and r["stages"][0]["allreduce_s"] == pytest.approx(ring(80_000, 2, 1e-5, 1e9))
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0 and "D=2" in table.output and "all-reduce" in table.output
    bad = CliRunner().invoke(main, [*args[:-4], "--data-parallel", "3"])
    assert bad.exit_code == 2 and "pipeline.data_parallel" in bad.output


# ----------------------------------------------------------------------------- a training's clock
def test_a_dp_training_on_the_sim_clock_reads_the_dp_layout(tmp_path: Path) -> None:
    """The trainer's sim clock after 3 batches is the simulated makespan of the P=2, D=2 layout."""
    from helpers.configs import make_config

    from paci_tune.config import derive_run
    from paci_tune.train.run import resolve_run, run_training

    units = [_unit(1e-3, 2e-3, params=40_000, opt=1e-4) for _ in range(4)]
    for u in units:
        u["microbatch"] = {2: u["microbatch"][1]}
    prof = Profile.from_dict(
        {"seq_len": 32, "units": units, "p2p": FREE, "allreduce": {"latency_s": 1e-3, "bandwidth_Bps": 1e7}}
    )
    prof.save(tmp_path / "p.yaml")
    doc = make_config(
        training={"global_batch": 8, "steps": 3, "clock": "sim", "profile": str(tmp_path / "p.yaml")},
        pipeline={"stages": 2, "data_parallel": 2, "window": 2, "partition": [2, 2]},
    )
    doc["pipeline"].pop("microbatch_size", None)
    summary = run_training(resolve_run(derive_run(doc))) or {}
    dp = ProfileClock("sim", prof, Layout("paci", 2, 2, window=2, microbatch_size=2, partition=(2, 2))).plan(3).makespan
    assert summary["clock"] == pytest.approx(dp)
