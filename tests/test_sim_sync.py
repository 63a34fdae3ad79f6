"""Simulating interleaved 1F1B and ZB-H1 from a profile: bubbles, memory, the backward split, refusals.

Oracles, all on hand-written profiles so every figure is exact:

- the textbook bubbles on equal stages with free transfers (see ``tests/test_sync_schedules.py``):
  1F1B ``(P-1)/(m+P-1)``; interleaved ``(P-1)/(v m + P-1)`` for ``m`` a multiple of ``P``; ZB-H1
  ``(P-1)/(3m+P-1)`` when F = B = W (units with F = 1, backward 2 split into halves), a third of
  1F1B's bubble time, and in general ``(P-1)(F+B-W)/(m(F+B+W) + (P-1)(F+B-W))`` for ``W <= F``
  (Qi et al.): checked with a measured split B = 1.5, W = 0.5;
- memory worked out from the lists: ZB-H1 holds ``min(P, m)`` micro-batches at every stage, so its
  largest stage activation equals 1F1B's (stage 0's ``P``) on equal stages;
- the derived split ``W = backward/2 * trainable share`` of a profile without one.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.configs import sim_config, write_config
from helpers.profiles import FREE, make_profile, unit

from paci_tune.cli import main
from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.schedule import Op
from paci_tune.sim import Profile, simulate
from paci_tune.sim.costs import derived_split
from paci_tune.sim.plot import COLOURS, plot_timelines


def layout(schedule: str, stages: int, m: int, chunks: int = 1, n_units: int | None = None) -> Layout:
    pieces = stages * chunks
    per = (n_units or pieces) // pieces
    return Layout(schedule, stages, 1, m, 1, None, (per,) * pieces, chunks)


def split_unit(f: float, bi: float, bw: float, **kw) -> dict:
    """A unit whose backward (bi + bw) was measured in halves."""
    u = unit(f, bi + bw, **kw)
    u["microbatch"][1].update(backward_input_s=bi, backward_weight_s=bw)
    return u


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_bubble_is_analytic_with_equal_chunks(stages: int, mult: int, chunks: int) -> None:
    m = mult * stages
    prof = make_profile([unit(1.0, 2.0) for _ in range(stages * chunks)])
    r = simulate(layout("interleaved", stages, m, chunks), prof, n_batches=2)
    expected = (stages - 1) / (chunks * m + stages - 1)
    assert r.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert r.analytic_bubble_fraction == pytest.approx(expected)
    flush = simulate(layout("1f1b", stages, m, 1, stages * chunks), prof, n_batches=2)
    assert flush.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1), abs=1e-12)
    assert r.step_time_s < flush.step_time_s
    assert r.max_drift == 0 and r.to_dict()["chunks"] == chunks


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_zb_h1_bubble_with_a_derived_even_split(stages: int, m: int) -> None:
    """Units of F = 1, backward 2: the derived split is B = W = 1. For m >= P the bubble is
    (P-1)/(3m+P-1), a third of 1F1B's bubble time; for m < P the lists still run and beat 1F1B."""
    prof = make_profile([unit(1.0, 2.0) for _ in range(stages)])
    zb = simulate(layout("zb-h1", stages, m), prof, n_batches=2)
    flush = simulate(layout("1f1b", stages, m), prof, n_batches=2)
    assert zb.backward_split == "derived" and zb.to_dict()["backward_split"] == "derived"
    assert zb.analytic_bubble_fraction == pytest.approx((stages - 1) / (3 * m + stages - 1))
    if m >= stages:
        assert zb.bubble_fraction == pytest.approx((stages - 1) / (3 * m + stages - 1), abs=1e-12)
        busy = 3.0 * m * 2
        assert zb.makespan_s - busy == pytest.approx((flush.makespan_s - busy) / 3, abs=1e-12)
    assert zb.bubble_fraction <= flush.bubble_fraction + 1e-12


@pytest.mark.parametrize("stages", [2, 4])
def test_zb_h1_uses_the_measured_split(stages: int) -> None:
    """B = 1.5, W = 0.5 (F = 1): bubble (P-1)(F+B-W) / (m(F+B+W) + (P-1)(F+B-W)) = 2(P-1) / (3m + 2(P-1))."""
    m = 2 * stages
    prof = make_profile([split_unit(1.0, 1.5, 0.5) for _ in range(stages)])
    assert prof.split_measured
    zb = simulate(layout("zb-h1", stages, m), prof, n_batches=2)
    expected = 2 * (stages - 1) / (3 * m + 2 * (stages - 1))
    assert zb.backward_split == "measured"
    assert zb.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert zb.analytic_bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zb_h1_peak_activations_equal_1f1b(stages: int) -> None:
    m = 2 * stages
    prof = make_profile([unit(1.0, 2.0) for _ in range(stages)])
    zb = simulate(layout("zb-h1", stages, m), prof, n_batches=2)
    flush = simulate(layout("1f1b", stages, m), prof, n_batches=2)
    assert [st.peak_inflight for st in zb.per_stage] == [stages] * stages
    assert [st.peak_inflight for st in flush.per_stage] == [stages - s for s in range(stages)]
    assert max(st.memory.activations for st in zb.per_stage) == max(st.memory.activations for st in flush.per_stage)
    assert zb.peak_memory_bytes == flush.peak_memory_bytes  # equal weights, grads and state too


def test_interleaved_memory_counts_each_chunk_in_flight() -> None:
    """P=2, v=2, m=4 (torch's rounds: 2 of r=2 micro-batches): stage 0 warms up with (v-1)*r + 2(P-1) = 4
    forwards and peaks at 5 chunk activations, stage 1 at (v-1)*r + 1 = 3; each chunk is one unit of
    saved 5000 + output 1000 bytes."""
    prof = make_profile([unit(1.0, 2.0) for _ in range(4)])
    r = simulate(layout("interleaved", 2, 4, 2), prof, n_batches=1)
    assert [st.peak_inflight for st in r.per_stage] == [5, 3]
    # stage 1 holds the model's last chunk (no output kept: the loss) and chunk 0 (unit 1)
    assert r.per_stage[0].memory.activations == 5 * 6000
    assert [[c.start, c.stop] for c in r.per_stage[1].chunk_units] == [[1, 2], [3, 4]]
    doc = json.loads(json.dumps(r.to_dict()))
    assert doc["stages"][0]["chunk_units"] == [[0, 1], [2, 3]]


def test_transfers_between_pieces_are_paid_once_per_hop() -> None:
    """P=1 with two chunks: both pieces on one device, no transfer at all, whatever the link costs."""
    slow = {"latency_s": 5.0, "bandwidth_Bps": 1.0}
    prof = make_profile([unit(1.0, 2.0) for _ in range(2)], p2p=slow)
    r = simulate(layout("interleaved", 1, 2, 2), prof, n_batches=1)
    assert r.makespan_s == pytest.approx(2 * 3.0 * 2)
    # on two devices every hop pays: slower than on a free link
    slow4, free4 = make_profile([unit(1.0, 2.0)] * 4, p2p=slow), make_profile([unit(1.0, 2.0)] * 4)
    assert (
        simulate(layout("interleaved", 2, 2, 2), slow4, 1).makespan_s
        > simulate(layout("interleaved", 2, 2, 2), free4, 1).makespan_s + 5.0
    )


def test_simulate_refuses_layouts_the_schedule_cannot_run() -> None:
    prof = make_profile([unit(1.0, 2.0) for _ in range(8)])
    with pytest.raises(ConfigError) as e:
        simulate(layout("interleaved", 4, 8, 1, 8), prof)
    assert e.value.key == "pipeline.chunks"
    with pytest.raises(ConfigError) as e:
        simulate(Layout("interleaved", 4, 1, 9, 1, None, (1,) * 8, 2), prof)
    assert e.value.key == "pipeline.window" and "rounds" in str(e.value)
    with pytest.raises(ConfigError) as e:
        simulate(layout("zb-h1", 4, 8, 2), prof)
    assert e.value.key == "pipeline.chunks"
    with pytest.raises(ConfigError) as e:
        simulate(Layout("interleaved", 4, 1, 8, 1, None, (1,) * 4, 2), prof)  # a cut of P, not v*P, pieces
    assert e.value.key == "pipeline.partition"
    with pytest.raises(ConfigError) as e:
        simulate(Layout("interleaved", 4, 1, 8, 1, None, (1,) * 12, 3), prof)  # 12 pieces of 8 units
    assert e.value.key == "pipeline.chunks"
    with pytest.raises(ConfigError) as e:
        simulate(layout("zb-2p", 4, 8), prof)
    assert e.value.key == "pipeline.schedule" and "zb-h1" in str(e.value)


# ------------------------------------------------------------------------------- the backward split


def test_old_profiles_load_with_a_derived_split() -> None:
    frozen = unit(1.0, 2.0, params=4000)
    frozen["trainable_bytes"] = 1000
    prof = make_profile([unit(1.0, 2.0), frozen, unit(1.0, 0.6, params=0)])
    assert not prof.split_measured
    assert prof.backward_split(1) == [(1.0, 1.0), (1.75, 0.25), (0.6, 0.0)]
    assert derived_split(2.0, 1.0) == (1.0, 1.0)
    # a hand-written profile where no unit has parameters: every unit counts as training
    assert make_profile([unit(1.0, 2.0, params=0)]).backward_split(1) == [(1.0, 1.0)]


def test_a_measured_split_round_trips_interpolates_and_scales(tmp_path) -> None:
    units = [split_unit(1.0, 1.2, 0.9)]
    units[0]["microbatch"][4] = {
        "forward_s": 4.0,
        "backward_s": 8.0,
        "activation_bytes": 4000,
        "saved_bytes": 20000,
        "backward_input_s": 4.8,
        "backward_weight_s": 3.6,
    }
    prof = make_profile(units)
    path = tmp_path / "p.yaml"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof and back.split_measured
    assert back.backward_split(2) == [pytest.approx((2.4, 1.8))]  # interpolated between 1 and 4
    assert back.scale(0.5).backward_split(1) == [pytest.approx((0.6, 0.45))]
    old = make_profile([unit(1.0, 2.0)])
    assert "backward_input_s" not in old.dumps()  # a profile without a split is written without one


@pytest.mark.parametrize(("given", "expected"), [("backward_input_s", (1.5, 0.5)), ("backward_weight_s", (0.5, 1.5))])
def test_half_a_split_takes_the_rest_of_the_backward(given: str, expected: tuple[float, float]) -> None:
    u = unit(1.0, 2.0)
    u["microbatch"][1][given] = 1.5
    prof = Profile.from_dict({"seq_len": 16, "units": [u], "p2p": FREE})
    assert prof.split_measured and prof.backward_split(1) == [expected]
    u["microbatch"][1][given] = -1.0
    with pytest.raises(ConfigError) as e:
        Profile.from_dict({"seq_len": 16, "units": [u], "p2p": FREE})
    assert e.value.key == f"profile.units[0].microbatch.1.{given}"


# ------------------------------------------------------------------------------ picture and command


def test_timeline_draws_w_boxes_and_chunks(tmp_path) -> None:
    prof = make_profile([unit(1.0, 2.0) for _ in range(4)])
    results = [simulate(layout(s, 2, 4, v, 4), prof, 2, extend=False) for s, v in (("zb-h1", 1), ("interleaved", 2))]
    path = plot_timelines(results, tmp_path / "t.svg")
    svg = path.read_text()
    assert "weight gradient W" in svg and "interleaved (v=2)" in svg
    assert COLOURS[Op.WEIGHT][0].lower() in svg.lower()  # the W boxes have their own colour
    assert ">3.1<" in svg or "3.1" in svg  # chunk 1's micro-batch 3 is labelled with its chunk


def test_simulate_command_compares_the_new_schedules(tmp_path) -> None:
    cfg = write_config(tmp_path, sim_config())
    prof = tmp_path / "hand.yaml"
    make_profile([unit(1e-3, 2e-3, mb=2) for _ in range(4)]).save(prof)
    base = ["simulate", str(cfg), "--profile", str(prof), "--stages", "2", "--window", "4", "--json"]
    res = CliRunner().invoke(main, [*base, "--schedule", "1f1b", "--schedule", "zb-h1", "--schedule", "interleaved"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert list(doc["schedules"]) == ["1f1b", "zb-h1", "interleaved"]
    got = {n: r["bubble_fraction"] for n, r in doc["schedules"].items()}
    assert got == pytest.approx({"1f1b": 1 / 5, "zb-h1": 1 / 13, "interleaved": 1 / 9})
    assert doc["schedules"]["interleaved"]["partition"] == [1, 1, 1, 1]
    assert doc["schedules"]["zb-h1"]["backward_split"] == "derived"
    out = tmp_path / "t.png"
    res = CliRunner().invoke(main, [*base[:-1], "--schedule", "zb-h1", "--timeline", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "derived" in res.stdout
    # a layout interleaved cannot run: refused naming the key, the value and what is allowed
    res = CliRunner().invoke(main, [*base, "--schedule", "interleaved", "--chunks", "3"])
    assert res.exit_code == 2 and "--chunks" in res.stderr and "3" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
