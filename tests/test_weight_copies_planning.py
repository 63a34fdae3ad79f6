"""Planning counts ``pipeline.backward_weights: forward``'s weight copies: memory, partitioner, simulator, clock.

Oracles, independent of the code under test: the copy bound written out here as ``ceil((k - 1) / a)``
with ``k = min(P - s, inflight)`` for PACI and 0 for the flush schedules; a copy's bytes as parameters
times the compute dtype's width (4 in fp32, 2 in bf16; the fp32 masters are never copied); the copy's
time as ``copy_s`` added to the steps that copy; and, for which steps copy, a real run's own count
(``Stage.copies_stats()``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.cli import run_in_process, summary_of
from helpers.configs import make_config, sim_config, write_config

from paci_tune.cli import main
from paci_tune.config import derive_run
from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.model import load_model
from paci_tune.pipeline.planning import plan_partition, predicted_memory
from paci_tune.schedule import Op
from paci_tune.sim import Profile, partition, simulate, stage_memory
from paci_tune.sim.memory import stage_copies
from paci_tune.train.clock import ProfileClock

FREE = {"latency_s": 0.0, "bandwidth_Bps": math.inf}
N_PARAMS = 1000  # parameters per unit in the hand profiles


def hand_copies(schedule: str, s: int, p: int, a: int, inflight: int | None = None) -> int:
    """Copies a stage may hold: ceil((k - 1) / a) with k micro-batches in flight under PACI, none when flushing."""
    if schedule != "paci":
        return 0
    k = p - s if inflight is None else max(min(p - s, inflight), 1)
    return math.ceil((k - 1) / a)


def unit(*, params: int = N_PARAMS, f: float = 1.0, b: float = 2.0, opt: float = 0.0, copy: float | None = None):
    u: dict[str, Any] = {
        "param_bytes": 4 * params,
        "optimizer_s": opt,
        "microbatch": {1: {"forward_s": f, "backward_s": b, "activation_bytes": 100, "saved_bytes": 300}},
    }
    if copy is not None:
        u["copy_s"] = copy
    return u


def profile(units: list[dict[str, Any]], dtype: str = "fp32", seq_len: int = 16) -> Profile:
    return Profile.from_dict({"seq_len": seq_len, "dtype": dtype, "units": units, "p2p": FREE})


# ------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize(("dtype", "width"), [("fp32", 4), ("bf16", 2)])
def test_forward_exceeds_current_by_copies_bound_times_weight_bytes(dtype: str, width: int) -> None:
    prof = profile([unit(params=N_PARAMS * (i + 1)) for i in range(6)], dtype)
    checked = 0
    for schedule in ("paci", "1f1b", "gpipe"):
        for p in range(1, 6):
            for a in range(1, 5):
                for inflight in (None, 1, 2, 3):
                    for s in range(p):
                        units = [s]  # stage s owns unit s: (s + 1) * N_PARAMS parameters
                        kw = {"last": s == p - 1, "overhead_bytes": 0}
                        fwd = stage_copies(schedule, s, p, a, inflight, backward_weights="forward")
                        cur = stage_copies(schedule, s, p, a, inflight, backward_weights="current")
                        assert fwd == hand_copies(schedule, s, p, a, inflight) and cur == 0
                        m_fwd = stage_memory(prof, units, 1, 2, copies=fwd, **kw)
                        m_cur = stage_memory(prof, units, 1, 2, copies=cur, **kw)
                        extra = hand_copies(schedule, s, p, a, inflight) * (s + 1) * N_PARAMS * width
                        assert m_fwd.total - m_cur.total == m_fwd.weight_copies == extra
                        assert m_cur == stage_memory(prof, units, 1, 2, **kw)  # current: exactly as before
                        if schedule != "paci" or s == p - 1:
                            assert m_fwd.weight_copies == 0
                        checked += extra > 0
    assert checked > 20
    # the P=8 paper shape at a=16: one copy at every stage but the last
    assert [stage_copies("paci", s, 8, 16, backward_weights="forward") for s in range(8)] == [1] * 7 + [0]
    with pytest.raises(ValueError, match="backward_weights"):
        stage_copies("paci", 0, 2, 1, backward_weights="stale")


def test_planning_prediction_follows_the_configs_backward_weights() -> None:
    prof = profile([unit() for _ in range(4)], "bf16")

    def need(bw: str | None, schedule: str = "paci", **pipe: Any) -> list[int]:
        pipeline = {"schedule": schedule, "stages": 4, "window": 1, "microbatch_size": 1, "device": "cpu", **pipe}
        if bw is not None:
            pipeline["backward_weights"] = bw
        cfg = derive_run(make_config(training={"global_batch": 1}, pipeline=pipeline))
        return predicted_memory(cfg, prof, [1, 1, 1, 1])

    weights = N_PARAMS * 2  # bf16 weights per unit
    extra = [(f - c) for f, c in zip(need("forward"), need("current"), strict=True)]
    assert extra == [3 * weights, 2 * weights, 1 * weights, 0]  # ceil((P - s - 1) / 1) copies
    assert need(None) == need("forward")  # the config's default is forward
    capped = [(f - c) for f, c in zip(need("forward", inflight=2), need("current", inflight=2), strict=True)]
    assert capped == [weights, weights, weights, 0]  # k = 2 in flight: one copy
    assert need("forward", "1f1b") == need("current", "1f1b")  # a flush never copies


def test_planning_prediction_of_an_interleaved_cut_counts_each_stages_chunks() -> None:
    """An interleaved cut has v * P pieces, stage s holding pieces s, s + P: its prediction is per
    stage (P entries), and stage 0's activations are its warm-up plus one chunk activations,
    (v - 1) r + 2 (P - 1) + 1 = 5 at P = 2, v = 2, m = 4 (r = 2), each one 2-unit piece's."""
    prof = profile([unit() for _ in range(8)])
    pipeline = {"schedule": "interleaved", "chunks": 2, "stages": 2, "window": 4, "microbatch_size": 1, "device": "cpu"}
    cfg = derive_run(make_config(training={"global_batch": 4, "clock": "sim"}, pipeline=pipeline))
    need = predicted_memory(cfg, prof, [2, 2, 2, 2])
    sim = simulate(cfg.layout.with_partition([2, 2, 2, 2]), prof, 4)
    assert need == [st.memory.total for st in sim.per_stage]
    piece = 300 + 300 + 100  # one micro-batch on a 2-unit piece: both units' saved tensors and its output
    stage0 = stage_memory(prof, [0, 1, 4, 5], 1, 1, last=False, activations=5 * piece)
    assert need[0] == stage0.total


# --------------------------------------------------------------------------------------- partitioner


def test_a_limit_that_fits_current_but_not_forward_changes_or_refuses_the_cut() -> None:
    # Four equal-time units; the last has no parameters. P=2, a=4: stage 0 keeps ceil(1/4) = 1 copy.
    # fp32 AdamW: weights + grads + 2 moments = 4 x param_bytes = 16 bytes per parameter, + 4 per copy.
    prof = profile([unit(), unit(), unit(), unit(params=0)])
    kw = {"overhead_bytes": 0}
    lay = Layout("paci", 2, window=4, microbatch_size=1)
    act = 2 * (300 + 300 + 100)  # stage 0 of the cut [2, 2]: 2 in flight x (saved + its output)
    cur_s0 = 16 * 2 * N_PARAMS + act
    fwd_s0 = cur_s0 + 4 * 2 * N_PARAMS
    assert partition(prof, lay, backward_weights="current", **kw).memory_bytes[0] == cur_s0
    assert partition(prof, lay, backward_weights="forward", **kw).memory_bytes[0] == fwd_s0
    limit = cur_s0  # fits current's [2, 2]; forward's [2, 2] is over by one copy
    assert partition(prof, lay, memory_bytes=limit, backward_weights="current", **kw).sizes == [2, 2]
    moved = partition(prof, lay, memory_bytes=limit, backward_weights="forward", **kw)
    assert moved.sizes == [1, 3]
    assert moved.memory_bytes == [16 * N_PARAMS + 4 * N_PARAMS + 2 * (300 + 100), 16 * 2 * N_PARAMS + 3 * 300]
    # the default follows the config's default: forward
    assert partition(prof, lay, memory_bytes=limit, **kw).sizes == [1, 3]
    # flush schedules keep no copy: the same limit fits the same cut in either mode
    flush = dataclasses.replace(lay, schedule="1f1b")
    assert (
        partition(prof, flush, memory_bytes=limit, backward_weights="forward", **kw).sizes
        == partition(prof, flush, memory_bytes=limit, backward_weights="current", **kw).sizes
    )
    # Two units, P=2: the only cut is [1, 1]; a limit of stage 0's current-mode need fits current and
    # refuses forward (stage 0's one copy does not fit), naming the stage.
    pair = profile([unit(), unit()])
    limit = 16 * N_PARAMS + 2 * (300 + 100)
    assert partition(pair, lay, memory_bytes=limit, backward_weights="current", **kw).sizes == [1, 1]
    with pytest.raises(ConfigError) as e:
        partition(pair, lay, memory_bytes=limit, backward_weights="forward", **kw)
    assert e.value.key == "pipeline.stages" and "on stage 0" in e.value.allowed
    with pytest.raises(ConfigError) as e:
        partition(prof, lay, backward_weights="sometimes", **kw)
    assert e.value.key == "pipeline.backward_weights"


def test_partitioner_amortises_the_copy_time_over_the_window() -> None:
    prof = profile([unit(f=1.0, b=2.0, opt=0.4, copy=0.8) for _ in range(4)])
    kw = {"overhead_bytes": 0}
    lay = Layout("paci", 2, window=4, microbatch_size=1)
    fwd = partition(prof, lay, backward_weights="forward", **kw)
    cur = partition(prof, lay, backward_weights="current", **kw)
    assert cur.stage_time_s == pytest.approx([2 * (3.0 + 0.4 / 4)] * 2)
    assert fwd.stage_time_s == pytest.approx([2 * (3.0 + 0.4 / 4 + 0.8 / 4), 2 * (3.0 + 0.4 / 4)])  # not the last
    flush = dataclasses.replace(lay, schedule="1f1b")
    assert partition(prof, flush, **kw).stage_time_s == pytest.approx(cur.stage_time_s)


def test_plan_partition_follows_the_config() -> None:
    prof = profile([unit(), unit(), unit(), unit(params=0)])
    limit = 16 * 2 * N_PARAMS + 2 * (300 + 300 + 100) + 256 * 2**20  # [2, 2] in current mode, default overhead

    def plan(bw: str) -> list[int]:
        pipeline = {"schedule": "paci", "stages": 2, "window": 4, "microbatch_size": 1, "backward_weights": bw}
        cfg = derive_run(make_config(training={"global_batch": 4}, pipeline=pipeline))
        return plan_partition(cfg, [1.0] * 4, prof, memory_bytes=limit)

    assert plan("current") == [2, 2] and plan("forward") == [1, 3]


# ----------------------------------------------------------------------------------------- simulator


def test_simulator_memory_column_counts_the_copies() -> None:
    prof = profile([unit(params=N_PARAMS * (i + 1)) for i in range(4)], "bf16")
    for p, a, sizes in ((4, 1, [1, 1, 1, 1]), (4, 2, [1, 1, 1, 1]), (2, 4, [2, 2]), (2, 1, [3, 1])):
        for schedule in ("paci", "1f1b", "gpipe"):
            fwd = simulate(Layout(schedule, p, 1, a, 1, None, tuple(sizes)), prof, backward_weights="forward")
            cur = simulate(Layout(schedule, p, 1, a, 1, None, tuple(sizes)), prof, backward_weights="current")
            start = 0
            for s, (sf, sc) in enumerate(zip(fwd.per_stage, cur.per_stage, strict=True)):
                params = sum(N_PARAMS * (i + 1) for i in range(start, start + sizes[s]))
                start += sizes[s]
                extra = hand_copies(schedule, s, p, a) * params * 2
                assert sf.peak_memory_bytes - sc.peak_memory_bytes == extra
                assert sf.to_dict()["memory"]["weight_copies"] == extra
                assert sf.weight_copies_peak == hand_copies(schedule, s, p, a) and sc.weight_copies_peak == 0
            assert fwd.peak_memory_bytes >= cur.peak_memory_bytes  # the worst stage (here often the last: no copy)
            assert json.loads(json.dumps(fwd.to_dict()))["backward_weights"] == "forward"
    default = simulate(Layout("paci", 2, 1, 1, 1, None, (2, 2)), prof)  # the config's default: forward
    forward = simulate(Layout("paci", 2, 1, 1, 1, None, (2, 2)), prof, backward_weights="forward")
    assert default.to_dict() == forward.to_dict()
    with pytest.raises(ConfigError):
        simulate(Layout("paci", 2, 1, 1, 1, None, (2, 2)), prof, backward_weights="stale")


def test_simulator_charges_copy_s_at_the_steps_that_copy() -> None:
    # P=2, a=4, one unit per stage: stage 0 copies at every step but the drained run's last one.
    f, b, opt, cp, n = 1.0, 2.0, 0.5, 0.75, 6
    prof = profile([unit(f=f, b=b, opt=opt, copy=cp), unit(f=f, b=b, opt=opt, copy=cp)])
    fwd = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), prof, n, extend=False, backward_weights="forward")
    cur = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), prof, n, extend=False, backward_weights="current")
    assert [st.weight_copies_made for st in fwd.per_stage] == [n - 1, 0]
    assert [st.weight_copies_made for st in cur.per_stage] == [0, 0]
    assert fwd.per_stage[0].busy_s - cur.per_stage[0].busy_s == pytest.approx((n - 1) * cp)
    assert fwd.per_stage[1].busy_s == pytest.approx(cur.per_stage[1].busy_s)
    assert cur.per_stage[0].busy_s == pytest.approx(n * (4 * (f + b) + opt))
    step_durations = [end - start for act, start, end in fwd.timeline.stages[0].intervals if act.op is Op.STEP]
    assert step_durations == pytest.approx([opt + cp] * (n - 1) + [opt])
    # In steady state stage 0 is the bottleneck and never idles: a window of F+B, a step and a copy.
    long = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), prof, 16, backward_weights="forward")
    assert long.steady_step_time_s == pytest.approx(4 * (f + b) + opt + cp)
    current = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), prof, 16, backward_weights="current")
    assert current.steady_step_time_s == pytest.approx(4 * (f + b) + opt)
    # a profile without copy_s: the copies' memory, no time
    old = profile([unit(f=f, b=b, opt=opt), unit(f=f, b=b, opt=opt)])
    a_ = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), old, n, extend=False, backward_weights="forward")
    c_ = simulate(Layout("paci", 2, 1, 4, 1, None, (1, 1)), old, n, extend=False, backward_weights="current")
    assert a_.makespan_s == c_.makespan_s and a_.per_stage[0].weight_copies_made == n - 1
    assert a_.per_stage[0].peak_memory_bytes - c_.per_stage[0].peak_memory_bytes == 4 * N_PARAMS


def test_sim_clock_pays_the_copies() -> None:
    cp = 0.75
    prof = profile([unit(opt=0.5, copy=cp), unit(opt=0.5, copy=cp)])
    lay = Layout("paci", 2, window=4, microbatch_size=1, partition=(1, 1))
    fwd = ProfileClock("sim", prof, lay, backward_weights="forward")
    cur = ProfileClock("sim", prof, lay, backward_weights="current")
    # stage 0 leads; its copies at steps 0..n-2 delay every later batch by that much
    for n in (1, 3, 6):
        assert fwd.plan(n).makespan - cur.plan(n).makespan == pytest.approx((n - 1) * cp)
    flush = dataclasses.replace(lay, schedule="1f1b")
    flush_current = ProfileClock("sim", prof, flush, backward_weights="current")
    assert ProfileClock("sim", prof, flush).plan(4) == flush_current.plan(4)


@pytest.mark.parametrize(("p", "a", "steps"), [(2, 4, 5), (3, 1, 6), (3, 2, 5)])
def test_copies_the_simulator_counts_are_the_ones_a_run_makes(p: int, a: int, steps: int) -> None:
    doc = make_config(
        model={"preset": "tiny", "n_layer": 4, "d_model": 32, "n_head": 2, "block_size": 16},
        training={"steps": steps, "global_batch": 8},
        pipeline={"stages": p, "window": a, "backward_weights": "forward", "partition": [6 // p] * p},
    )
    run = summary_of(run_in_process(doc))["stages"]
    # a profile with the model's own parameter counts (4 bytes each), so the predicted copy bytes can be
    # compared with what the run's stages copied
    model = load_model(doc["model"], doc["data"]["vocab_size"], 0)
    prof = profile([unit(params=sum(q.numel() for q in model.units[i].parameters())) for i in range(model.n_units)])
    sizes = [6 // p] * p
    layout = Layout("paci", p, 1, a, 8 // a, None, tuple(sizes))
    sim = simulate(layout, prof, steps, extend=False, backward_weights="forward")
    made = [st["weight_copies_made"] for st in run]
    assert made == [st.weight_copies_made for st in sim.per_stage]
    assert [st["weight_copies_peak"] for st in run] == [st.weight_copies_peak for st in sim.per_stage]
    assert all(st["updates"] == steps for st in run)
    assert made[-1] == 0 and all(m > 0 for m in made[:-1])
    fwd = predicted_memory(derive_run(doc), prof, sizes)
    current = {**doc, "pipeline": {**doc["pipeline"], "backward_weights": "current"}}
    cur = predicted_memory(derive_run(current), prof, sizes)
    held = [st["weight_copies_peak"] * st["weight_copy_bytes"] for st in run]
    assert [f - c for f, c in zip(fwd, cur, strict=True)] == held  # the bound is reached, at the real copy's size


# ------------------------------------------------------------------------------------------- profile


def test_profile_with_and_without_copy_s_loads(tmp_path: Path) -> None:
    old = profile([unit(), unit(params=0)])
    assert [u.copy_s for u in old.units] == [None, None] and old.weight_copy_s([0, 1]) == 0.0
    assert "copy_s" not in old.to_dict()["units"][0]  # an old profile saves as it was
    new = profile([unit(copy=2e-4), unit(params=0, copy=0.0)])
    assert [u.copy_s for u in new.units] == [2e-4, 0.0] and new.weight_copy_s([0, 1]) == pytest.approx(2e-4)
    for prof in (old, new):
        path = tmp_path / "p.yaml"
        prof.save(path)
        assert Profile.load(path) == prof
    assert new.scale(3.0).units[0].copy_s == pytest.approx(6e-4) and old.scale(3.0).units[0].copy_s is None
    doc = yaml.safe_load(new.dumps())
    doc["units"][0]["copy_s"] = None  # null: not measured
    assert Profile.from_dict(doc).units[0].copy_s is None
    doc["units"][0]["copy_s"] = -1.0
    with pytest.raises(ConfigError) as e:
        Profile.from_dict(doc)
    assert e.value.key == "profile.units[0].copy_s"


def test_measure_copy_times_a_clone_of_the_weights() -> None:
    import torch

    from paci_tune.calibrate import measure_copy

    cpu = torch.device("cpu")
    t = measure_copy(torch.nn.Linear(64, 64), device=cpu, repeats=3, warmup=1)
    assert 0 < t < 1
    assert measure_copy(torch.nn.ReLU(), device=cpu, repeats=3) == 0.0


# ----------------------------------------------------------------------------------------- simulate


def test_simulate_command_follows_the_configs_backward_weights(tmp_path: Path) -> None:
    prof = profile([unit() for _ in range(4)])  # the config's model: embed, 2 blocks, head
    prof.save(tmp_path / "p.yaml")
    out = {}
    for bw in ("forward", "current"):
        cfg = sim_config(training={"global_batch": 4}, pipeline={"stages": 4, "backward_weights": bw})
        path = write_config(tmp_path, cfg, f"{bw}.yaml")
        res = CliRunner().invoke(main, ["simulate", str(path), "--profile", str(tmp_path / "p.yaml"), "--json"])
        assert res.exit_code == 0, res.output
        out[bw] = json.loads(res.stdout)
        assert out[bw]["backward_weights"] == bw
    for schedule in ("paci", "1f1b", "gpipe"):
        copies = [st["memory"]["weight_copies"] for st in out["forward"]["schedules"][schedule]["stages"]]
        assert copies == ([4 * N_PARAMS] * 3 + [0] if schedule == "paci" else [0] * 4)
        assert all(st["memory"]["weight_copies"] == 0 for st in out["current"]["schedules"][schedule]["stages"])
