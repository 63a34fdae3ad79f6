"""The benchmarks' quick modes: each runs end to end and checks its own figures (CI runs these)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import REPO
from helpers.cli import cli_env

pytestmark = pytest.mark.slow


def _bench(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=cli_env(), check=False)  # fmt: skip
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
    assert all(len(r["interval"]) == 2 and r["interval"][0] <= r["interval"][1] for r in doc["rows"])


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


def test_paper_scaled_quick(tmp_path: Path) -> None:
    """Both batches, PACI, flush and ZB-H1, every window and seed; the bench asserts PACI's simulated step is
    never longer than flush's at the same (P, a, b) and that the best flush reaches its own target."""
    out = _bench("bench/paper_scaled.py", "--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path))
    doc = json.loads((tmp_path / "paper.json").read_text())
    # one analysis per PACI semantics and batch, against the same flush runs
    assert [(r["bw"], r["G"]) for r in doc["results"]] == [(bw, g) for bw in ("forward", "current") for g in (4, 8)]
    for g in (4, 8):
        flush = [res["best_flush"] for res in doc["results"] if res["G"] == g]
        assert flush[0] == flush[1]
    for res in doc["results"]:
        assert {(p["schedule"], p["a"]) for p in res["points"]} == {(s, a) for s in ("paci", "1f1b", "zb-h1")
                                                                     for a in (res["G"] // 2, res["G"])}  # fmt: skip
        for r in res["ratios"].values():
            assert r["low"] <= r["speedup"] <= r["high"] and r["verdict"] in ("paci", "flush", "tie")
        # the strongest synchronous baseline is the lowest mean score of flush's and ZB-H1's points
        sync = [p for p in res["points"] if p["schedule"] != "paci"]
        strongest = min(sync, key=lambda p: (p["mean"], p["schedule"] != "1f1b"))
        assert res["ratios"]["strongest"]["flush"] == strongest["label"]
    assert "Direction:" in out and (tmp_path / "paper.png").stat().st_size > 5_000


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
        paci = [r for r in doc["runs"] if (r["schedule"], r["option"], r["P"], r["a"]) == ("paci", c["option"], c["P"],
                                                                                            c["a"])]  # fmt: skip
        assert len(paci) == c["seeds"] == 1
        partner = "nadam+stage" if c["option"] == "nadam+stage" else (c["option"] if c["option"] in ("nadam", "muon")
                                                                       else "adamw")  # fmt: skip
        assert abs(c["gap"] - (paci[0]["final"] - flush[(partner, 0)])) < 1e-12
    shared = [r for r in doc["runs"] if r.get("same_as")]
    assert shared and all(-(-(r["P"] - 1) // r["a"]) <= 1 for r in shared)
