"""The benchmarks' quick modes: each runs end to end and checks its own figures (CI runs these)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from helpers import REPO
from helpers.cli import cli_env

pytestmark = pytest.mark.slow


def _bench(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=cli_env(), check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_val_noise_quick() -> None:
    out = _bench("bench/val_noise.py", "--quick")
    assert "max |difference error|" in out


def test_search_seeds_quick() -> None:
    """Two real searches cold and two warm-started from one shared warm-up; the bench itself asserts
    that each verdict follows its interval and that exactly the warm ones say they were warm-started."""
    out = _bench("bench/search_seeds.py", "--quick", "--warm", "4")
    doc = json.loads(out.strip().splitlines()[-1])
    assert [(r["mode"], r["seed"]) for r in doc["rows"]] == [("cold", 0), ("cold", 1), ("warm", 0), ("warm", 1)]
    assert set(doc["summary"]) >= {"cold", "warm"}
    for r in doc["rows"]:  # an undecided verdict (a compared run missed the target) has no interval
        assert r["interval"] is None if r["verdict"] == "undecided" else r["interval"][0] <= r["interval"][1], r


def test_eval_bubble_quick() -> None:
    out = _bench("bench/eval_bubble.py", "--quick")
    assert "lowest bubble" in out


def test_dp_budget_quick(tmp_path: Path) -> None:
    """Two layouts of 8 devices trained on the sim clock; every row is P x D = 8 and a * b * D = 16."""
    out = _bench("bench/dp_budget.py", "--quick", "--workdir", str(tmp_path))
    doc = json.loads(out.strip().splitlines()[-1])
    assert {(r["stages"], r["data_parallel"]) for r in doc["rows"]} == {(2, 4), (4, 2)}
    assert all(r["stages"] * r["data_parallel"] == 8 for r in doc["rows"])
    assert all(r["data_parallel"] * r["window"] * r["microbatch_size"] == 16 for r in doc["rows"])
    assert all(r["allreduce_fraction"] > 0 and r["best_val_loss"] is not None for r in doc["rows"])
    assert "| 2 x 4 |" in out and "| 4 x 2 |" in out


BASELINES = ("zb-h1", "interleaved", "zb-v", "dualpipev")
"""Every synchronous schedule beside flush that the paper experiment can tune (GPipe aside)."""


def test_paper_scaled_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both batches and optimizers, PACI, flush, ZB-H1 and interleaved over every window and LR on the search
    seeds; the chosen points again on fresh seeds. Checked here against what the JSON's own runs say: the
    chosen points are the argmin of the search seeds' means, every ratio is the fresh seeds' scores, every
    interval is scipy's t-interval of the per-seed log ratios; ``--plan`` counts the curves the run trained."""
    import math
    import statistics

    import numpy as np
    from scipy import stats

    work, out = str(tmp_path / "work"), str(tmp_path)
    text = _bench("bench/paper_scaled.py", "--quick", "--workdir", work, "--out", out)
    doc = json.loads((tmp_path / "paper.json").read_text())
    search, fresh = doc["search_seeds"], doc["seeds"]
    assert len(fresh) >= 2 and not set(search) & set(fresh)  # a paired t-interval's least (df = 1)
    shape = [("forward", o, g) for o in ("adamw", "muon", "best") for g in (4, 8)]
    assert [(r["bw"], r["opt"], r["G"]) for r in doc["results"]] == shape
    # every grid point on the search seeds: 4 schedules x 2 windows x 2 LRs x 2 optimizers a batch
    pts = doc["search_points"]
    assert {(p["G"], p["schedule"], p["a"], p["lr"], p["opt"]) for p in pts} == {
        (g, s, a, lr, o)
        for g in (4, 8)
        for s in ("paci", "1f1b", "zb-h1", "interleaved")
        for a in (g // 2, g)
        for lr in (3e-3, 6e-3)
        for o in ("adamw", "muon")
    }
    for p in pts:
        assert sorted(map(int, p["scores"])) == search
        assert p["mean"] == pytest.approx(statistics.fmean(p["scores"].values()))
    # each optimizer's rows against its own target (its best flush's), "best" against the lowest of them
    for g in ("4", "8"):
        assert doc["targets"]["best"][g] == min(doc["targets"][o][g] for o in ("adamw", "muon"))
    fpts = {(p["scored_for"], p["G"], p["label"]): p for p in doc["fresh_points"]}
    assert all(sorted(map(int, p["scores"])) == fresh for p in fpts.values())
    chosen = {(r["opt"], r["G"], label) for r in doc["results"] for label in r["chosen"].values()}
    assert set(fpts) == chosen  # only the chosen points are reported on the fresh seeds
    for res in doc["results"]:
        mine = [p for p in pts if p["G"] == res["G"] and p["scored_for"] == res["opt"]]
        assert {p["opt"] for p in mine} == ({"adamw", "muon"} if res["opt"] == "best" else {res["opt"]})
        best = {}
        for s in ("paci", "1f1b", "zb-h1", "interleaved"):
            best[s] = min((p for p in mine if p["schedule"] == s), key=lambda p: p["mean"])
            assert res["search_mean"][s] == best[s]["mean"], (res, s)
            assert res["chosen"][s] == best[s]["label"] or math.isclose(  # a tie of means: either is the argmin
                next(p["mean"] for p in mine if p["label"] == res["chosen"][s]), best[s]["mean"]
            )
        assert res["search_mean"]["strongest"] == min(best[s]["mean"] for s in ("1f1b", "zb-h1", "interleaved"))
        paci_a = next(p["a"] for p in mine if p["label"] == res["chosen"]["paci"])
        assert res["search_mean"]["same_m"] == min(
            p["mean"] for p in mine if p["schedule"] == "1f1b" and p["a"] == paci_a
        )
        paci = fpts[(res["opt"], res["G"], res["chosen"]["paci"])]
        for name, r in res["ratios"].items():
            base = fpts[(res["opt"], res["G"], res["chosen"][name])]
            assert r["seeds"] == fresh and r["baseline"] == res["chosen"][name]
            assert r["ratios"] == pytest.approx([base["scores"][str(s)] / paci["scores"][str(s)] for s in fresh])
            assert r["missed"] == sum(paci["times"][str(s)] is None or base["times"][str(s)] is None for s in fresh)
            assert r["speedup"] == pytest.approx(math.exp(statistics.fmean(math.log(x) for x in r["ratios"])))
            if r["missed"]:  # a censored time: no interval
                assert r["low"] is None and r["high"] is None and r["verdict"] == "undecided"
                continue
            ci = stats.ttest_1samp(np.log(r["ratios"]), 0.0).confidence_interval(0.95)
            assert [r["low"], r["high"]] == pytest.approx([math.exp(ci.low), math.exp(ci.high)])
            assert r["verdict"] == ("paci" if r["low"] > 1 else "flush" if r["high"] < 1 else "tie")
    assert "Direction over the best flush" in text and (tmp_path / "paper.png").stat().st_size > 5_000
    # --clocks, every synchronous schedule, no training: DualPipeV refused exactly where a < 2P (P = 4),
    # one fastest per grid point, the one with the most global batches in the budget
    table = _bench("bench/paper_scaled.py", "--quick", "--workdir", work, "--clocks", "--baselines", *BASELINES)
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| adamw", "| muon"))]
    assert len(rows) == 8
    for row in rows:
        g, b, cells = int(row[1]), int(row[2]), row[3:]
        assert (cells[-1].strip(" |") == "refused") is (g // b < 8), row
        counts = [int(c.split()[0]) for c in cells if "refused" not in c]
        fastest = [c for c in cells if "fastest" in c]
        assert len(fastest) == 1 and int(fastest[0].split()[0]) == max(counts), row
    # the interval and verdict of a comparison with no miss, whatever this machine's profile made the runs do
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    bench = _module("paper_scaled")
    times = {"paci": [1.0, 1.2, 0.9, 1.1], "base": [1.8, 1.9, 1.5, 2.0]}
    sides = {
        k: {
            "schedule": "paci" if k == "paci" else "1f1b",
            "a": 2,
            "b": 2,
            "lr": 1e-3,
            "opt": "muon",
            "times": dict(enumerate(v)),
            "scores": dict(enumerate(v)),
        }
        for k, v in times.items()
    }
    r = bench.compare(sides["paci"], sides["base"], [0, 1, 2, 3])
    logs = np.log(np.array(times["base"]) / np.array(times["paci"]))
    ci = stats.ttest_1samp(logs, 0.0).confidence_interval(0.95)
    assert [r["low"], r["high"]] == pytest.approx([math.exp(ci.low), math.exp(ci.high)]) and r["verdict"] == "paci"
    assert r["speedup"] == pytest.approx(math.exp(logs.mean())) and r["missed"] == 0
    sides["base"]["times"][2] = None  # a miss on one seed: censored, no interval
    assert bench.compare(sides["paci"], sides["base"], [0, 1, 2, 3])["verdict"] == "undecided"
    # --plan before training says what this run trained: now every curve is done
    plan = _bench("bench/paper_scaled.py", "--quick", "--workdir", work, "--plan")
    p = doc["plan"]
    assert (
        f"search: {p['search_runs']} runs of {p['search_curves']} distinct curves ({p['search_curves']} done)" in plan
    )
    assert f"fresh, as chosen: {p['fresh_runs']} runs of {p['fresh_curves']} distinct curves" in plan
    # the synchronous schedules of one (G, LR, seed, optimizer) share a curve; each PACI point is its own
    assert p["search_curves"] == 2 * 2 * 2 * 2 * (1 + 2)


def test_stat_map_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench asserts every stage's drift <= its bound. Each distinct curve is trained once: as many runs
    as the tasks' numerics keys (fewer than the tasks), and a task that read another's run (flush at a = 2,
    P=1 PACI: flush's curve) equals a fresh run of its own configuration."""
    _bench("bench/stat_map.py", "--quick", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "map.json").read_text())
    assert {c["bw"] for c in doc["cells"]} == {"forward", "current"}  # both semantics by default
    for bw in ("forward", "current"):
        check_map_cells(doc, bw)
    # forward against current, paired run by run: at P = 1 nothing is stale, so the two are one run
    rows = {row["P"]: row for row in doc["semantics"]}
    assert set(rows) == {1, 2, None} and rows[None]["pairs"] == 4
    assert rows[1]["final_diff"] == 0.0 and rows[1]["reached_forward"] == rows[1]["reached_current"]
    assert (tmp_path / "map.png").stat().st_size > 5_000 and "| P \\ a |" in (tmp_path / "map.md").read_text()
    runs = doc["runs"]
    assert doc["base"]["data"]["draw"] == "sequence" and len(runs) == doc["curves"]["tasks"] == 10  # 2 flush + 2 x 4
    # The runs trained: one per numerics key, the oracle computed here from each task's own configuration.
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from paci_tune.tune.curves import numerics_key

    bench = _module("stat_map")
    keys = [numerics_key(bench.run_config(doc["base"], doc["steps"], doc["eval_every"], r)) for r in runs]
    assert [r["class"] for r in runs] == keys
    assert sum(r["trained"] for r in runs) == doc["curves"]["trained"] == len(set(keys)) == 5 < len(runs)
    # Every run trained was timed here; the sum is of those times (a resumed bench times only its new runs).
    rs = doc["run_seconds"]
    assert rs["timed"] == rs["of"] == 5
    assert rs["sum"] == pytest.approx(sum(r["wall_s"] for r in runs if r["trained"]), abs=0.2) and rs["sum"] > 0
    # A shared row against a fresh run of its own configuration (flush trained at a = 1; P=1 PACI is flush).
    for who in ({"schedule": "1f1b", "a": 2}, {"schedule": "paci", "P": 1, "a": 2, "bw": "forward"}):
        row = next(r for r in runs if who.items() <= r.items())
        assert not row["trained"]
        task = {k: row[k] for k in ("schedule", "P", "a", "seed", "lr", "bw") if k in row}
        fresh = bench.train(doc["base"], doc["steps"], doc["eval_every"], task)
        assert [s for s, _ in fresh["curve"]] == [s for s, _ in row["curve"]] and len(row["curve"]) == 3
        assert max(abs(x - y) for (_, x), (_, y) in zip(fresh["curve"], row["curve"], strict=True)) < 1e-5, who


def _module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported here, to run its own functions against what its process wrote."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_map_cells(doc: dict, bw: str) -> None:
    cells = {(c["P"], c["a"]): c for c in doc["cells"] if c["bw"] == bw}
    assert set(cells) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert cells[(1, 1)]["mean"] == 1.0 and cells[(1, 2)]["mean"] == 1.0  # no staleness, the same steps
    assert cells[(2, 1)]["bound"] == 1 and cells[(2, 2)]["bound"] == 1
    # What PACI's speed can buy back at most, (a + P - 1) / a; P = 1 has nothing to buy back and is never out of reach.
    assert [cells[k]["payback"] for k in ((1, 1), (2, 1), (2, 2))] == [1.0, 2.0, 1.5]
    assert not cells[(1, 1)]["cannot_win"] and not cells[(1, 2)]["cannot_win"]
    assert all(c["cannot_win"] == (c["mean"] >= c["payback"]) for k, c in cells.items() if k[0] == 2 and c["ratios"])
    lim = doc["stale_limit"]  # how the cells that cannot win fall over depth and bound (both semantics)
    losing = sum(c["cannot_win"] for c in doc["cells"] if c["P"] == 2)
    assert set(lim["per_depth"]) == {"2"} and lim["per_depth"]["2"] == f"{losing}/4"


def test_optimizer_map_quick(tmp_path: Path) -> None:
    """Every option against its own optimizer's flush partner, from one warm-up: a gap per cell, AdamW's closed
    share per option, PipeMare's runs shared with AdamW's where no stage has a bound of 2 or more."""
    _bench("bench/optimizer_map.py", "--quick", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "map.json").read_text())
    options = {c["option"] for c in doc["cells"]}
    assert options == set(doc["options"]) and {c["P"] for c in doc["cells"]} == {2, 4}
    assert {c["option"] for c in doc["closed"]} == options - {"adamw"}
    flush = {(r["option"], r["seed"]): r["final"] for r in doc["runs"] if r["schedule"] == "1f1b"}
    for c in doc["cells"]:  # the gap is the paired difference the runs give
        paci = [
            r
            for r in doc["runs"]
            if (r["schedule"], r["option"], r["P"], r["a"]) == ("paci", c["option"], c["P"], c["a"])
        ]
        assert len(paci) == c["seeds"] == 1
        partner = (
            "nadam+stage"
            if c["option"] == "nadam+stage"
            else (c["option"] if c["option"] in ("nadam", "muon") else "adamw")
        )
        assert abs(c["gap"] - (paci[0]["final"] - flush[(partner, 0)])) < 1e-12
    shared = [r for r in doc["runs"] if r.get("same_as")]
    assert shared and all(-(-(r["P"] - 1) // r["a"]) <= 1 for r in shared)


def test_delay_law_quick(tmp_path: Path) -> None:
    """The delay-law bench on the shipped grid tables: its noise floor is numpy's pooled sd of log steps to
    target over each LR's flush replicates, and predict-then-verify never reports less compute than the
    flush curves it starts from."""
    out = tmp_path / "delay.json"
    _bench("bench/delay_law.py", "--quick", "--json", str(out))
    doc = json.loads(out.read_text())
    table = json.loads((REPO / "bench" / "tuner_vs_grid" / "table-unshared.json").read_text())
    groups: dict[float, list[float]] = {}
    for p in table["points"]:
        step = p["evidence"].get("clock_step_time_s")
        if p["schedule"] != "paci" and p["time_to_target"] is not None and step:
            groups.setdefault(p["lr_scale"], []).append(np.log(round(p["time_to_target"] / step)))
    pooled = np.sqrt(sum(np.var(g) * len(g) for g in groups.values()) / sum(len(g) - 1 for g in groups.values()))
    assert doc["noise_floor_log_sd"] == pytest.approx(pooled, rel=1e-9)
    for run in doc["predict_then_verify"]:
        assert run["ratio"] >= 1.0 and 0 < run["compute"] <= 1.0, run
