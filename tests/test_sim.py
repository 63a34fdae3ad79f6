"""Simulator, cost profiles, memory prediction, timeline pictures and the simulate/calibrate commands.

Everything except two smoke tests uses hand-written profiles, so the expected figures are exact
and the tests do not depend on how busy the machine is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.configs import sim_config, write_config
from helpers.profiles import equal_profile, make_profile, unit

from paci_tune.cli import main
from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.schedule.actions import Op
from paci_tune.sim import P2PCost, Profile, simulate, stage_memory
from paci_tune.sim.memory import MIB
from paci_tune.sim.plot import plot_timelines

# ----------------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_flush_bubble_is_analytic_with_equal_stages(schedule: str, stages: int, m: int) -> None:
    prof = equal_profile(stages)
    r = simulate(Layout(schedule, stages, 1, m, 1, None, tuple([1] * stages)), prof, n_batches=3)
    expected = (stages - 1) / (m + stages - 1)
    assert r.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert r.steady_bubble_fraction == pytest.approx(expected, abs=1e-12)
    for st in r.per_stage:  # equal stages: every stage waits the same share
        assert st.bubble_fraction == pytest.approx(expected, abs=1e-12)
    # (m + P - 1) slots of F+B per global batch
    assert r.step_time_s == pytest.approx((m + stages - 1) * 3.0)
    assert r.analytic_bubble_fraction == pytest.approx(expected)
    assert r.max_drift == 0


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_paci_steady_state_has_no_bubble(stages: int, m: int) -> None:
    prof = equal_profile(stages)
    r = simulate(Layout("paci", stages, 1, m, 1, None, tuple([1] * stages)), prof, n_batches=2)
    assert r.n_batches == 4 * stages  # long enough run for a steady state
    assert r.steady_bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert r.steady_step_time_s == pytest.approx(m * 3.0)
    # over the whole run only the one fill and drain are idle: (P-1) slots out of n*m + P - 1
    n = r.n_batches
    assert r.bubble_fraction == pytest.approx((stages - 1) / (n * m + stages - 1))
    # PACI's drift bound ceil((P-s-1)/a) is reached and never exceeded
    for st in r.per_stage:
        assert st.max_drift == math.ceil((stages - st.stage - 1) / m) == st.drift_bound
        assert st.peak_inflight == stages - st.stage
        assert sum(st.drift_histogram.values()) == n * m


def test_paci_vs_1f1b_throughput_ratio() -> None:
    p, m = 4, 8
    prof = equal_profile(p)
    paci = simulate(Layout("paci", p, 1, m, 1, None, tuple([1] * p)), prof, n_batches=64)
    flush = simulate(Layout("1f1b", p, 1, m, 1, None, tuple([1] * p)), prof, n_batches=4)
    assert paci.steady_tokens_per_s / flush.tokens_per_s == pytest.approx((m + p - 1) / m)
    assert flush.tokens_per_s == pytest.approx(m * 16 / ((m + p - 1) * 3.0))


def test_unequal_costs_match_a_hand_worked_timeline() -> None:
    # Two stages, 1F1B, one global batch of m=2 micro-batches.
    # Stage 0 = units 0+1: F = 0.25+0.75 = 1, B = 0.5+1.5 = 2, step = 0.2+0.3 = 0.5.
    # Stage 1 = unit 2:    F = 2,              B = 3,           step = 0.5.
    # Transfer across the cut (unit 1's activation, 200 B): 0.05 s + 200 B / 1000 B/s = 0.25 s, both ways.
    # Action lists (schedules.build): stage 0 [F0 F1 B0 B1 S0] (2 in flight), stage 1 [F0 B0 F1 B1 S0].
    #   s0 F0 [0, 1]            s0 F1 [1, 2]
    #   s1 F0 starts at 1 + .25           -> [1.25, 3.25];  s1 B0 [3.25, 6.25]
    #   s1 F1 needs 2 + .25, stage busy until 6.25 -> [6.25, 8.25]; s1 B1 [8.25, 11.25]; s1 S0 [11.25, 11.75]
    #   s0 B0 needs 6.25 + .25   -> [6.5, 8.5]
    #   s0 B1 needs 11.25 + .25  -> [11.5, 13.5];  s0 S0 [13.5, 14]
    # Makespan 14; busy 6.5 and 10.5; bubbles 1 - 6.5/14 and 1 - 10.5/14 = 0.25.
    prof = make_profile(
        [
            unit(0.25, 0.5, opt=0.2),
            unit(0.75, 1.5, opt=0.3, act=200),
            unit(2.0, 3.0, opt=0.5),
        ],
        p2p={"latency_s": 0.05, "bandwidth_Bps": 1000.0},
    )
    r = simulate(Layout("1f1b", 2, 1, 2, 1, None, (2, 1)), prof, n_batches=1)
    got = [[(repr(a), round(t0, 9), round(t1, 9)) for a, t0, t1 in st.intervals] for st in r.timeline.stages]
    assert got == [
        [("F0", 0, 1), ("F1", 1, 2), ("B0", 6.5, 8.5), ("B1", 11.5, 13.5), ("S0", 13.5, 14)],
        [("F0", 1.25, 3.25), ("B0", 3.25, 6.25), ("F1", 6.25, 8.25), ("B1", 8.25, 11.25), ("S0", 11.25, 11.75)],
    ]
    assert r.makespan_s == pytest.approx(14.0)
    assert [st.busy_s for st in r.per_stage] == pytest.approx([6.5, 10.5])
    assert [st.idle_s for st in r.per_stage] == pytest.approx([7.5, 3.5])
    assert [st.bubble_fraction for st in r.per_stage] == pytest.approx([1 - 6.5 / 14, 0.25])
    assert r.tokens_per_s == pytest.approx(2 * 16 / 14.0)


def test_simulate_rejects_bad_input() -> None:
    prof = equal_profile(3)
    with pytest.raises(ConfigError) as e:
        simulate(Layout("1f1b", 2, 1, 2, 1, None, (1, 1)), prof)
    assert e.value.key == "pipeline.partition"
    with pytest.raises(ConfigError) as e:
        simulate(Layout("zigzag", 3, 1, 2, 1, None, (1, 1, 1)), prof)
    assert e.value.key == "pipeline.schedule"
    with pytest.raises(ConfigError) as e:
        simulate(Layout("paci", 4, 1, 2, 1, None, (1, 1, 1, 1)), prof)
    assert e.value.key == "pipeline.stages"


def test_result_to_dict_is_json() -> None:
    r = simulate(Layout("paci", 2, 1, 2, 1, None, (1, 1)), equal_profile(2))
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    for key in ("tokens_per_s", "bubble_fraction", "step_time_s", "steady_step_time_s", "stages"):
        assert key in d
    for st in d["stages"]:
        for key in ("busy_s", "idle_s", "bubble_fraction", "peak_inflight", "peak_memory_bytes", "max_drift"):
            assert key in st


# -------------------------------------------------------------------------------------- memory


def test_memory_prediction_matches_hand_computation() -> None:
    # Units: params 4000/1000/2000 B; saved 5000/7000/3000 B; activations 1000/600/400 B per micro-batch.
    prof = make_profile(
        [
            unit(1, 1, params=4000, saved=5000, act=1000),
            unit(1, 1, params=1000, saved=7000, act=600),
            unit(1, 1, params=2000, saved=3000, act=400),
        ]
    )
    overhead = 3 * MIB
    # Stage 0 = units 0, 1 under 1F1B with P=2, m=4: 2 in flight.
    # weights 5000 + grads 5000 + AdamW 2 x 5000 + 2 x (saved 12000 + output of unit 1: 600) + overhead
    expected0 = 5000 + 5000 + 10000 + 2 * (12000 + 600) + overhead
    # Stage 1 = unit 2 (last: holds only the loss): 1 in flight.
    expected1 = 2000 + 2000 + 4000 + 1 * 3000 + overhead
    mem = stage_memory(prof, [0, 1], 1, 2, last=False, overhead_bytes=overhead)
    assert (mem.params, mem.grads, mem.optimizer_state, mem.activations) == (5000, 5000, 10000, 25200)
    assert mem.total == expected0
    r = simulate(Layout("1f1b", 2, 1, 4, 1, None, (2, 1)), prof, overhead_bytes=overhead)
    assert [st.peak_inflight for st in r.per_stage] == [2, 1]
    assert [st.peak_memory_bytes for st in r.per_stage] == [expected0, expected1]
    # GPipe: the whole window in flight
    g = simulate(Layout("gpipe", 2, 1, 4, 1, None, (2, 1)), prof, overhead_bytes=overhead)
    assert [st.peak_inflight for st in g.per_stage] == [4, 4]
    assert g.per_stage[0].peak_memory_bytes == 20000 + 4 * 12600 + overhead
    sgd = stage_memory(prof, [2], 1, 1, last=True, optimizer="sgd", overhead_bytes=0)
    assert sgd.total == 2000 * 3 + 3000


# ------------------------------------------------------------------------------------- profile


def test_profile_yaml_round_trip(tmp_path: Path) -> None:
    prof = make_profile(
        [unit(0.1, 0.2, mb=4), unit(0.3, 0.6, opt=0.01, mb=4)],
        p2p={"latency_s": 1e-4, "bandwidth_Bps": 2e9},
        seq_len=64,
    )
    path = tmp_path / "p.yaml"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    assert not list(tmp_path.glob(".p.yaml*"))  # no temporary left behind
    free = make_profile([unit(1, 1)])
    free.save(path)
    assert Profile.load(path).p2p.transfer_s(10**9) == 0.0  # .inf bandwidth survives YAML


def test_hand_written_profile_with_quoted_sizes_and_defaults() -> None:
    text = """
    seq_len: 8
    units:
      - param_bytes: 10
        optimizer_s: 0
        microbatch:
          "2": {forward_s: 1, backward_s: 2, activation_bytes: 4, saved_bytes: 8}
    p2p: {latency_s: 0, bandwidth_Bps: .inf}
    """
    prof = Profile.from_dict(yaml.safe_load(text))
    assert prof.units[0].name == "unit0" and prof.microbatch_sizes == [2]
    assert prof.dtype == "fp32" and prof.threads is None


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d.pop("seq_len"), "profile.seq_len"),
        (lambda d: d.update(units=[]), "profile.units"),
        (lambda d: d.update(colour="red"), "profile.colour"),
        (lambda d: d["units"][1]["microbatch"][1].update(forward_s=-1.0), "profile.units[1].microbatch.1.forward_s"),
        (lambda d: d["units"][0]["microbatch"][1].pop("saved_bytes"), "profile.units[0].microbatch.1.saved_bytes"),
        (lambda d: d["units"][0]["microbatch"].update({"big": {}}), "profile.units[0].microbatch"),
        (lambda d: d["units"][0].update(param_bytes=1.5), "profile.units[0].param_bytes"),
        (lambda d: d["p2p"].update(bandwidth_Bps=0), "profile.p2p.bandwidth_Bps"),
        (lambda d: d.update(p2p=None), "profile.p2p"),
        (lambda d: d.update(dtype="fp8"), "profile.dtype"),
        (lambda d: d.update(format="other/9"), "profile.format"),
    ],
)
def test_profile_validation_names_the_key(mutate: Any, key: str) -> None:
    doc = make_profile([unit(1, 1), unit(1, 1)]).to_dict()
    mutate(doc)
    with pytest.raises(ConfigError) as e:
        Profile.from_dict(doc)
    assert e.value.key == key


def test_profile_load_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        Profile.load(tmp_path / "nope.yaml")
    assert e.value.key == "profile"


def test_interpolation_and_extrapolation_between_measured_sizes() -> None:
    u = {
        "param_bytes": 0,
        "optimizer_s": 0,
        "microbatch": {
            4: {"forward_s": 1.0, "backward_s": 2.0, "activation_bytes": 400, "saved_bytes": 1000},
            8: {"forward_s": 1.8, "backward_s": 3.6, "activation_bytes": 800, "saved_bytes": 2000},
        },
    }
    prof = make_profile([u])
    c6 = prof.at(6)[0]
    assert (c6.forward_s, c6.backward_s, c6.activation_bytes, c6.saved_bytes) == pytest.approx((1.4, 2.8, 600, 1500))
    c16 = prof.at(16)[0]  # extrapolated along the 4..8 line
    assert (c16.forward_s, c16.activation_bytes) == pytest.approx((3.4, 1600))
    c1 = prof.at(1)[0]
    assert (c1.forward_s, c1.activation_bytes) == pytest.approx((0.4, 100))
    single = make_profile([unit(1.0, 2.0, act=100, saved=300, mb=4)])  # one size: proportional
    c2 = single.at(2)[0]
    assert (c2.forward_s, c2.backward_s, c2.activation_bytes, c2.saved_bytes) == pytest.approx((0.5, 1.0, 50, 150))


def test_scale_makes_a_faster_copy() -> None:
    prof = make_profile([unit(1.0, 2.0, opt=0.5)], p2p={"latency_s": 1e-3, "bandwidth_Bps": 1e9})
    fast = prof.scale(0.5)
    c = fast.at(1)[0]
    assert (c.forward_s, c.backward_s, fast.units[0].optimizer_s) == (0.5, 1.0, 0.25)
    assert (fast.p2p.latency_s, fast.p2p.bandwidth_Bps) == (5e-4, 2e9)
    assert c.saved_bytes == prof.at(1)[0].saved_bytes
    slow_net = prof.scale(1.0, p2p_factor=10)
    assert slow_net.p2p.latency_s == pytest.approx(1e-2) and slow_net.at(1)[0].forward_s == 1.0
    r_fast = simulate(Layout("1f1b", 1, 1, 2, 1, None, (1,)), fast)
    r = simulate(Layout("1f1b", 1, 1, 2, 1, None, (1,)), prof)
    assert r_fast.step_time_s == pytest.approx(r.step_time_s / 2)
    with pytest.raises(ConfigError):
        prof.scale(0)


# ------------------------------------------------------------------------------------ timeline


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_timeline_written(tmp_path: Path, suffix: str) -> None:
    prof = make_profile([unit(1, 2), unit(1, 2), unit(1, 2)], p2p={"latency_s": 0.1, "bandwidth_Bps": 1e6})
    schedules = ("1f1b", "gpipe", "paci")
    results = [simulate(Layout(s, 3, 1, 4, 1, None, (1, 1, 1)), prof, 2, extend=False) for s in schedules]
    path = plot_timelines(results, tmp_path / f"t.{suffix}")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in data[:2000]
    assert [p.name for p in tmp_path.iterdir()] == [f"t.{suffix}"]
    with pytest.raises(ConfigError):
        plot_timelines(results, tmp_path / "t.jpg")


def test_timeline_boxes_are_the_action_lists() -> None:
    r = simulate(Layout("paci", 2, 1, 2, 1, None, (1, 1)), equal_profile(2), 2, extend=False)
    ops = [[a.op for a, _, _ in st.intervals] for st in r.timeline.stages]
    assert ops[0].count(Op.FORWARD) == ops[0].count(Op.BACKWARD) == 4 and ops[0].count(Op.STEP) == 2


# ------------------------------------------------------------------------------------- commands


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path, sim_config())


def _hand_profile(tmp_path: Path, n_units: int = 4, seq_len: int = 16) -> Path:
    path = tmp_path / "hand.yaml"
    make_profile([unit(1e-3, 2e-3, mb=2) for _ in range(n_units)], seq_len=seq_len).save(path)
    return path


def test_simulate_json_with_hand_profile(tmp_path: Path) -> None:
    cfg, prof = _config(tmp_path), _hand_profile(tmp_path)
    args = ["simulate", str(cfg), "--profile", str(prof), "--stages", "4", "--window", "4", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # nothing but the JSON object on stdout
    # all: every schedule; on 4 units at P = 4 the two-chunk ones need 8 pieces, DualPipeV 8 micro-batches
    assert set(doc["schedules"]) == {"paci", "1f1b", "gpipe", "zb-h1"}
    assert set(doc["not_fitting"]) == {"interleaved", "zb-v", "dualpipev"}
    for r in doc["schedules"].values():
        assert r["tokens_per_s"] > 0 and 0 <= r["bubble_fraction"] < 1
        assert r["microbatch_size"] == 2 and r["partition"] == [1, 1, 1, 1]
    assert doc["schedules"]["1f1b"]["bubble_fraction"] == pytest.approx(3 / 7)
    assert doc["paci_vs_1f1b_throughput"] == pytest.approx(7 / 4, rel=0.1)


def test_simulate_table_and_timeline(tmp_path: Path) -> None:
    cfg, prof = _config(tmp_path), _hand_profile(tmp_path)
    out = tmp_path / "tl.svg"
    args = ["simulate", str(cfg), "--profile", str(prof), "--schedule", "paci", "--stages", "2", "--timeline", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "paci" in res.stdout and "tokens/s" in res.stdout
    assert out.is_file()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--stages", "5"], "pipeline.stages"),
        (["--batches", "0"], "--batches"),
        (["--memory-gib", "1e-9"], "--memory-gib"),  # below the largest unit's weights: no cut can help
        (["--timeline", "t.jpg"], "--timeline"),
    ],
)
def test_simulate_bad_input_exits_2_with_one_line(tmp_path: Path, extra: list[str], needle: str) -> None:
    cfg, prof = _config(tmp_path), _hand_profile(tmp_path)
    res = CliRunner().invoke(main, ["simulate", str(cfg), "--profile", str(prof), *extra])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_simulate_rejects_profile_of_another_model(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    for prof in (_hand_profile(tmp_path, n_units=5), _hand_profile(tmp_path, seq_len=32)):
        res = CliRunner().invoke(main, ["simulate", str(cfg), "--profile", str(prof)])
        assert res.exit_code == 2 and "--profile" in res.stderr


# ---------------------------------------------------------------------------------- calibration


def test_saved_bytes_exclude_parameters() -> None:
    import torch

    from paci_tune.calibrate import measure_unit

    lin = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    cost = measure_unit(lin, x, last=False, device=torch.device("cpu"), dtype="fp32", repeats=1, warmup=0)
    assert cost.saved_bytes == 3 * 8 * 4  # the input only; the weight is a parameter, not a copy
    assert cost.activation_bytes == 3 * 4 * 4


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "act_size"), [("fp32", 4), ("bf16", 2)])
def test_calibrate_smoke_one_layer(tmp_path: Path, precision: str, act_size: int) -> None:
    from paci_tune.calibrate import calibrate
    from paci_tune.config import load_config

    cfg_path = _config(tmp_path)
    cfg = load_config(cfg_path, {"model.n_layer": 1})
    prof = calibrate(
        cfg, microbatch_sizes=[2], precision=precision, repeats=1, warmup=0, threads=1, p2p=P2PCost(0.0, math.inf)
    )
    assert [u.name for u in prof.units] == ["embed", "block0", "head"]
    assert prof.seq_len == 16 and prof.threads == 1 and prof.dtype == precision
    for u in prof.units:
        c = u.costs[2]
        assert c.forward_s > 0 and c.backward_s > 0 and c.saved_bytes > 0 and u.param_bytes > 0
        assert u.copy_s is not None and 0 < u.copy_s < 1  # one clone of the unit's weights, measured
    assert prof.split_measured  # B and W per unit, timed beside the whole backward
    assert [u.costs[2].backward_input_s == 0 for u in prof.units] == [True, False, False]  # the ids need none
    assert all(u.costs[2].backward_weight_s > 0 for u in prof.units)
    assert prof.units[0].costs[2].activation_bytes == 2 * 16 * 32 * act_size  # bf16 activations in bf16
    # 4 bytes per parameter in either precision (the profile's convention): matmuls + two LayerNorm weights
    assert prof.units[1].param_bytes == 4 * (12 * 32 * 32 + 2 * 32)
    path = tmp_path / "measured.yaml"
    prof.save(path)
    assert Profile.load(path) == prof


@pytest.mark.slow
def test_p2p_measurement_and_fit() -> None:
    from paci_tune.calibrate import fit_p2p, measure_p2p

    lat, bw = fit_p2p({1000: 1e-4 + 1000 / 1e9, 10**6: 1e-4 + 10**6 / 1e9, 10**7: 1e-4 + 10**7 / 1e9})
    assert lat == pytest.approx(1e-4) and bw == pytest.approx(1e9)
    lat, bw = fit_p2p({1000: 2e-3, 10**6: 1e-3})  # noise hid the size effect: never free transfers
    assert lat == 1e-3 and bw == pytest.approx(1e9)
    cost = measure_p2p([1024, 256 * 1024], repeats=3)
    assert cost.latency_s >= 0 and cost.bandwidth_Bps > 0 and cost.backend == "gloo-loopback"
