"""A per-device memory budget (``hardware.memory``) in search, train and apply.

Oracles: the Optuna storage of a real search (which points trained), the analytic floor of a stage's
memory (weights, gradients and AdamW's two moments are four copies of the weights: no prediction may
be below that), exit code 2 with the key named before any work (no trial folder, no metrics file),
and best.yaml's sections read back as YAML.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers import REPO
from helpers.cli import check_error, check_ok, cli_env
from helpers.configs import NARROW_MODEL, merge
from helpers.searches import SEARCH_DOC
from optuna.trial import TrialState

from paci_tune.config import derive_run
from paci_tune.config.memory import parse_size
from paci_tune.config.tune import split_tune_sections
from paci_tune.errors import ConfigError
from paci_tune.pipeline.planning import budget_fit
from paci_tune.sim.profile import P2PCost, Profile, UnitCost, UnitProfile

UNIT_BYTES = 400_000  # fp32 weights of each of the hand profile's 4 units
DOC: dict[str, Any] = merge(
    SEARCH_DOC,
    {
        "model": NARROW_MODEL,
        "data": {"vocab_size": 32, "n_train": 20_000, "n_val": 2_000},
        "training": {"steps": 4, "eval_sequences": 8},
        "target": {"value": 2.5},
        "budget": {"seconds": 0.2, "grid": 2},
        "search": {"sampler": "random", "trials": 3},
    },
)
SPACE = {"schedules": ["paci", "1f1b"], "stages": [1, 2, 4], "microbatch_size": [2, 4]}


def _profile() -> Profile:
    """Weights heavy against activations (as a model that needs a pipeline is): the cut decides the fit."""
    units = [
        UnitProfile(f"u{i}", UNIT_BYTES, 1e-4, {b: UnitCost(1e-3 * b, 2e-3 * b, 2048 * b, 8192 * b) for b in (2, 4)})
        for i in range(4)
    ]
    return Profile(units, P2PCost(1e-5, 1e9), seq_len=16)


def _write(tmp_path: Path, memory: Any) -> Path:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    _profile().save(tmp_path / "profile.yaml")
    doc = merge(
        DOC,
        {
            "search": {"space": str(tmp_path / "space.yaml")},
            "hardware": {"memory": memory},
            "budget": {"profile": str(tmp_path / "profile.yaml")},
        },
    )
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _peak(memory: Any, stages: int, b: int, schedule: str = "1f1b") -> int:
    """The most loaded stage's prediction for a point of the space (D = 4 / P devices, global batch 8)."""
    run_doc, _ = split_tune_sections(merge(DOC, {"hardware": {"memory": memory}}))
    d = 4 // stages
    cfg = derive_run(
        run_doc,
        {
            "pipeline.schedule": schedule,
            "pipeline.stages": stages,
            "pipeline.data_parallel": d,
            "pipeline.microbatch_size": b,
            "pipeline.window": 8 // (d * b),
        },
    )
    return max(budget_fit(cfg, _profile())[1])


def _between_one_and_two_stages() -> int:
    """A budget that holds every 2-stage point and no 1-stage one, taken from the memory model."""
    one = min(_peak(None, 1, 2, s) for s in ("paci", "1f1b"))
    two = max(_peak(None, 2, b, s) for b in (2, 4) for s in ("paci", "1f1b"))
    assert two < one, "the hand profile must make one stage the heaviest layout"
    return (one + two) // 2


def _cli(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "paci_tune.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=cli_env())


# ------------------------------------------------------------------------------------ the key
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),
        ("24GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("1.5KiB", 1536),
    ],
)
def test_sizes_read_in_bytes_with_binary_and_decimal_units(value: Any, expected: int) -> None:
    assert parse_size("hardware.memory", value) == expected


@pytest.mark.parametrize("value", [0, -1, "0GiB", "24G", "3 furlongs", "GiB", True, [1]])
def test_bad_budget_is_refused_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        derive_run({"hardware": {"memory": value}})
    assert e.value.key == "hardware.memory"


def test_prediction_is_never_below_four_copies_of_the_weights() -> None:
    """Weights, gradients and AdamW's two moments: a single stage holds at least 4x the model's weights."""
    assert _peak(None, 1, 2) >= 4 * 4 * UNIT_BYTES


def test_budget_is_not_part_of_a_checkpoints_numerics() -> None:
    from paci_tune.train.fingerprint import fingerprint

    base = {"training": {"steps": 4}}
    assert fingerprint(derive_run(base)) == fingerprint(derive_run({**base, "hardware": {"memory": "24GiB"}}))


@pytest.mark.parametrize(("flag", "shown"), [("0", "'0'"), ("-5MiB", "'-5MiB'"), ("24G", "'24G'"), ("100", "'100'")])
def test_train_refuses_a_bad_budget_before_any_work(tmp_path: Path, flag: str, shown: str) -> None:
    """0, negative, an unknown unit, or less than one unit's weights (100 bytes): exit 2, one line, no metrics."""
    config, metrics = _write(tmp_path, None), tmp_path / "m.jsonl"
    proc = _cli(
        "train",
        config,
        "--memory",
        flag,
        "--stages",
        "2",
        "--profile",
        tmp_path / "profile.yaml",
        "--steps",
        "1",
        "--metrics",
        metrics,
    )
    check_error(proc, metrics, "hardware.memory", shown)


def test_train_refuses_a_run_predicted_over_the_budget_and_runs_one_under_it(tmp_path: Path) -> None:
    cap = _between_one_and_two_stages()
    config, metrics = _write(tmp_path, cap), tmp_path / "m.jsonl"
    common = ("--profile", tmp_path / "profile.yaml", "--steps", "1", "--clock", "sim", "--metrics", metrics)
    proc = _cli("train", config, "--stages", "1", "--data-parallel", "1", "--microbatch-size", "2", *common)
    check_error(proc, metrics, "hardware.memory", str(cap))
    assert "stage 0 is predicted" in proc.stderr
    check_ok(_cli("train", config, "--stages", "2", "--data-parallel", "1", "--microbatch-size", "2", *common))
    none = tmp_path / "none.jsonl"  # --memory none lifts the file's budget: the refused layout runs
    lifted = [*common[:-1], none]
    check_ok(
        _cli(
            "train",
            config,
            "--memory",
            "none",
            "--stages",
            "1",
            "--data-parallel",
            "1",
            "--microbatch-size",
            "2",
            *lifted,
        )
    )
    assert none.exists()
    summary = [r for r in map(yaml.safe_load, metrics.read_text().splitlines()) if r.get("event") == "summary"][-1]
    assert summary["memory_budget_bytes"] == cap


# ------------------------------------------------------------------------------------ search
@pytest.mark.slow
def test_search_never_trains_a_point_over_the_budget(tmp_path: Path) -> None:
    """P = 1 cannot fit: the storage holds no trial at P = 1, and best.yaml names every dropped point."""
    cap = _between_one_and_two_stages()
    proc = _cli(
        "search",
        _write(tmp_path, cap),
        "--no-live",
        "--workdir",
        tmp_path / "work",
        "--out",
        tmp_path / "best.yaml",
        timeout=600,
    )
    check_ok(proc)
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    ran = []
    for s in ("paci", "1f1b"):
        for t in optuna.load_study(study_name=f"model.{s}", storage=storage).trials:
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                ran.append(t.params["stages"])
    assert ran and 1 not in ran, ran
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["recommended"]["stages"] >= 2
    mem = best["memory"]
    assert mem["memory_bytes"] == cap
    dropped = {(d["schedule"], d["stages"], d["microbatch_size"]) for d in mem["dropped"]}
    assert ("1f1b", 1, 2) in dropped and not any(p == 1 for sched, p, _ in dropped if sched == "paci")  # P = 1: flush's
    assert all(d["predicted_peak_bytes"] > cap for d in mem["dropped"])
    rows = [r for table in best["candidates"].values() for r in table]
    assert rows and all(r["predicted_peak_bytes"] <= cap for r in rows if r["predicted_peak_bytes"] is not None)
    assert "dropped: " in proc.stderr and "candidates" in proc.stderr


def test_a_budget_below_every_point_exits_2_before_any_trial(tmp_path: Path) -> None:
    cap = 4 * UNIT_BYTES  # one unit's weights fit; its gradient and moments do not
    proc = _cli(
        "search", _write(tmp_path, cap), "--no-live", "--workdir", tmp_path / "work", "--out", tmp_path / "best.yaml"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "error: hardware.memory: got" in proc.stderr and "smallest predicted peak" in proc.stderr
    assert not list((tmp_path / "work").glob("trials/*/trial-*")) and not (tmp_path / "best.yaml").exists()


def test_apply_keeps_to_the_budget_its_best_yaml_carries(tmp_path: Path) -> None:
    """best.yaml's run holds the search's ``hardware.memory``: apply refuses a recommendation predicted over
    it (exit 2, the key named, nothing trained), ``--memory`` can lift or change it, and under it apply trains."""
    cap = _between_one_and_two_stages()
    _write(tmp_path, cap)
    run_doc, _ = split_tune_sections(merge(DOC, {"hardware": {"memory": cap}}))
    run_doc = merge(
        run_doc,
        {
            "training": {"steps": 1, "clock": "sim", "profile": str(tmp_path / "profile.yaml")},
            "pipeline": {"schedule": "1f1b", "stages": 1, "data_parallel": 1, "window": 4, "microbatch_size": 2},
        },
    )
    run_doc["pipeline"].pop("partition", None)
    cfg = derive_run(run_doc)
    opt = {
        "name": "adamw",
        "lr": cfg.optimizer.lr,
        "betas": list(cfg.optimizer.betas),
        "eps": cfg.optimizer.eps,
        "weight_decay": cfg.optimizer.weight_decay,
        "grad_clip": cfg.optimizer.grad_clip,
    }
    best = {
        "recommended": {
            "schedule": "1f1b",
            "stages": 1,
            "data_parallel": 1,
            "devices": 1,
            "window": 4,
            "microbatch_size": 2,
            "partition": [4],
            "global_batch": cfg.training.global_batch,
            "lr": cfg.optimizer.lr,
            "lr_scale": 1.0,
            "optimizer": opt,
        },
        "target": {"metric": "val_loss", "value": 2.5},
        "budget": {"clock": "sim", "seconds": 0.2, "grid": 2},
        "run": run_doc,
    }
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(best, sort_keys=False))
    metrics = tmp_path / "m.jsonl"
    proc = _cli("apply", path, "--no-live", "--metrics", metrics)
    check_error(proc, metrics, "hardware.memory", str(cap))
    assert "stage 0 is predicted" in proc.stderr
    for flag, held in (("none", None), (str(2 * cap), 2 * cap)):
        shutil.rmtree(tmp_path / "best-checkpoints", ignore_errors=True)  # each apply is a fresh run
        check_ok(_cli("apply", path, "--no-live", "--metrics", metrics, "--memory", flag))
        records = [yaml.safe_load(line) for line in metrics.read_text().splitlines()]
        summary = [r for r in records if r.get("event") == "summary"][-1]
        assert summary.get("memory_budget_bytes") == held and summary["stages"][0]["stage"] == 0


def test_a_baseline_no_point_fits_leaves_the_search_and_one_left_without_any_is_refused(tmp_path: Path) -> None:
    """Oracle: a predictor that prices every point of one schedule over the cap. A synchronous schedule that fits
    nowhere leaves the search, said in ``dropped`` (the shipped spaces name them all); PACI that fits nowhere,
    or every synchronous schedule, is refused naming ``hardware.memory``."""
    from paci_tune.tune.narrow import drop_over_memory
    from paci_tune.tune.point import MemoryDrop
    from paci_tune.tune.space import load_space

    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**SPACE, "schedules": ["paci", "1f1b", "zb-h1"], "stages": [2]}))
    space = load_space(str(tmp_path / "s.yaml"), global_batch=8, n_units=4, max_stages=None, devices=4)

    def pricing(heavy: set[str]) -> Any:
        return lambda q: MemoryDrop(q, 10**9 if q.schedule in heavy else 10, 0, (2, 2), 1000)

    kept = drop_over_memory(space, pricing({"zb-h1"}), 1000, "1000")
    assert kept.schedules == ("paci", "1f1b") and any(d.startswith("zb-h1: left out") for d in kept.dropped)
    for heavy in ({"paci"}, {"1f1b", "zb-h1"}):
        with pytest.raises(ConfigError) as e:
            drop_over_memory(space, pricing(heavy), 1000, "1000")
        assert e.value.key == "hardware.memory" and "none of them fits" in e.value.allowed
