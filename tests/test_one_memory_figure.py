"""One memory figure: ``paci-tune simulate`` gives the per-device peak the search acts on.

Oracle: the search's own prediction for every point of a space listing every schedule -- the cut a
trial's run would use under ``hardware.memory`` and its predicted peak
(:func:`paci_tune.pipeline.planning.budget_fit` on :func:`paci_tune.tune.setup.point_run`), and the
dropped points' figures (:func:`paci_tune.tune.setup.drop_over_budget`). ``simulate --json`` on the same
config and layout must give the same bytes per device and the same cut, fitting or not, and say which
are over the budget; the device reserve (none on a CPU profile, 256 MiB on a GPU's) counts in both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.configs import NARROW_MODEL, merge
from helpers.searches import SEARCH_DOC

from paci_tune.cli import main
from paci_tune.config import derive_doc
from paci_tune.config.tune import load_tune_config
from paci_tune.pipeline.planning import budget_fit, budget_reserve
from paci_tune.schedule import NAMES
from paci_tune.sim.profile import P2PCost, Profile, UnitCost, UnitProfile
from paci_tune.tune.setup import bind_space, drop_over_budget, point_run, trial_runtime

UNIT_BYTES = 400_000
MIB = 2**20
SPACE = {"schedules": list(NAMES), "stages": [1, 2, 4], "microbatch_size": [2, 4]}  # every schedule of the registry


def _profile(device: str) -> Profile:
    """Weights heavy against activations, so a budget of a few MiB leaves some layouts over it and some under."""
    units = [
        UnitProfile(f"u{i}", UNIT_BYTES, 1e-4, {b: UnitCost(1e-3 * b, 2e-3 * b, 2048 * b, 8192 * b) for b in (2, 4)})
        for i in range(4)
    ]
    return Profile(units, P2PCost(1e-5, 1e9), seq_len=16, device=device)


def _write(tmp_path: Path, memory: Any, device: str = "cpu") -> tuple[Path, Path]:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    _profile(device).save(tmp_path / "profile.yaml")
    doc = merge(
        SEARCH_DOC,
        {
            "model": NARROW_MODEL,
            "data": {"vocab_size": 32, "n_train": 20_000, "n_val": 2_000},
            "training": {"global_batch": 16},  # a = 4 at P = 2 D = 2 b = 2: DualPipeV's 2P
            "search": {"space": str(tmp_path / "space.yaml")},
            "hardware": {"memory": memory},
            "budget": {"profile": str(tmp_path / "profile.yaml")},
        },
    )
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, tmp_path / "profile.yaml"


def _simulate(config: Path, profile: Path, q: Any) -> dict[str, Any]:
    args = [
        "simulate",
        str(config),
        "--profile",
        str(profile),
        "--schedule",
        q.schedule,
        "--stages",
        str(q.stages),
        "--window",
        str(q.window),
        "--microbatch-size",
        str(q.microbatch_size),
        "--data-parallel",
        str(q.data_parallel),
        "--chunks",
        str(max(q.chunks, 2)),
        "--json",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize(("device", "memory"), [("cpu", 3 * MIB), ("cpu", None), ("cuda", 259 * MIB)])
def test_simulate_gives_the_search_s_figure_for_every_schedule(tmp_path: Path, device: str, memory: int | None) -> None:
    config, profile_path = _write(tmp_path, memory, device)
    tune = load_tune_config(derive_doc(yaml.safe_load(config.read_text())), str(config))
    space = bind_space(tune)
    profile = _profile(device)
    assert budget_reserve(profile) == (0 if device == "cpu" else 256 * MIB)
    seen = set()
    over = total = 0
    for schedule in space.schedules:
        for q in space.grid_variants(schedule):
            if q.backward_weights not in (None, tune.run.pipeline.backward_weights) or space.why_not(q) is not None:
                continue
            cut, peaks = budget_fit(point_run(tune, q, trial_runtime(tune)), profile)
            doc = _simulate(config, profile_path, q)
            sim = doc["schedules"][schedule]
            assert sim["partition"] == cut, q.label()
            assert [st["peak_memory_bytes"] for st in sim["stages"]] == peaks, q.label()
            assert sim["peak_memory_bytes"] == max(peaks)
            fits = doc["memory_limit_bytes"] is None or max(peaks) <= doc["memory_limit_bytes"]
            assert (schedule in doc["not_fitting"]) == (not fits), q.label()
            over += not fits
            total += 1
            seen.add(schedule)
    assert seen == set(SPACE["schedules"])
    if memory is not None:
        assert 0 < over < total, "the budget must leave some layouts over it and some under"
        kept = drop_over_budget(tune, space, str(profile_path))
        assert kept.over_memory
        for d in kept.over_memory:  # the search's dropped-point lines: the same bytes
            assert _simulate(config, profile_path, d.params)["schedules"][d.params.schedule]["peak_memory_bytes"] == (
                d.peak_bytes
            )


def test_a_budget_no_unit_fits_is_refused_naming_the_key(tmp_path: Path) -> None:
    config, profile_path = _write(tmp_path, "100 KiB")
    res = CliRunner().invoke(main, ["simulate", str(config), "--profile", str(profile_path)])
    assert res.exit_code == 2 and "hardware.memory" in res.stderr and "100 KiB" in res.stderr


@pytest.mark.parametrize("schedule", NAMES)
def test_a_runs_closing_summary_gives_simulates_figure(tmp_path: Path, schedule: str) -> None:
    """The run's own report: its predicted peak per device is ``simulate``'s for the same layout, every schedule."""
    from helpers.cli import run_in_process, summary_of

    from paci_tune.cli.ui import budget_line
    from paci_tune.config.memory import format_bytes
    from paci_tune.config.tune import split_tune_sections

    config, profile_path = _write(tmp_path, None)
    run_doc, _ = split_tune_sections(yaml.safe_load(config.read_text()))
    over = {
        "pipeline.schedule": schedule,
        "pipeline.stages": 2,
        "pipeline.microbatch_size": 2,
        "pipeline.data_parallel": 1,
        "training.steps": 2,
        "training.clock": "sim",
        "training.profile": str(profile_path),
        "training.seconds": None,
    }
    doc = derive_doc(run_doc, over)
    summary = summary_of(run_in_process(doc))
    q = type(
        "Q", (), {"schedule": schedule, "stages": 2, "window": 8, "microbatch_size": 2, "data_parallel": 1, "chunks": 2}
    )
    sim = _simulate(config, profile_path, q)["schedules"][schedule]
    assert summary["predicted_peak_bytes"] == sim["peak_memory_bytes"]
    assert format_bytes(summary["predicted_peak_bytes"]) in str(budget_line(summary))
