"""A search space tunes the optimizer (every schedule, the same recipes) and PACI's staleness controls (PACI only).

Oracles written out here: the expansion of a small space into its recipes (the Cartesian product of
the values each optimizer reads, listed by hand), the run each recipe must derive (its optimizer's
settings, read back from the config), the contract that a synchronous study never has the
staleness dimension, and, for a real search, the storage and each trial's own run file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.cli import check_ok
from helpers.configs import make_config
from helpers.profiles import reference_profile
from helpers.searches import run, search_cmd, write_search

from paci_tune.config import derive_run
from paci_tune.errors import ConfigError
from paci_tune.tune.narrow import skip_incompatible
from paci_tune.tune.recipes import optimizer_recipes, recipe_overrides, staleness_recipes
from paci_tune.tune.space import SearchSpace, load_space

OPT = {
    "name": ["adamw", "nadam", "muon"],
    "betas": [[0.9, 0.95], [0.99, 0.999]],
    "momentum_decay": [0.004, 0.04],
    "momentum": [0.95],
}
STALE = {"stage_momentum": [None, 0.995], "predict_weights": [False, True]}


def test_the_recipes_are_the_product_of_what_each_optimizer_reads() -> None:
    assert optimizer_recipes(OPT) == (
        "adamw betas=0.9,0.95",
        "adamw betas=0.99,0.999",
        "nadam betas=0.9,0.95 momentum_decay=0.004",
        "nadam betas=0.9,0.95 momentum_decay=0.04",
        "nadam betas=0.99,0.999 momentum_decay=0.004",
        "nadam betas=0.99,0.999 momentum_decay=0.04",
        "muon momentum=0.95 betas=0.9,0.95",
        "muon momentum=0.95 betas=0.99,0.999",
    )
    assert optimizer_recipes({"name": ["sgd", "adamw"]}) == ("sgd", "adamw")  # nothing given: the run's values
    assert staleness_recipes(STALE) == (
        "off",
        "predict_weights",
        "stage_momentum=0.995",
        "stage_momentum=0.995 predict_weights",
    )
    assert optimizer_recipes(None) == () and staleness_recipes(None) == ()


@pytest.mark.parametrize("recipe", optimizer_recipes(OPT))
def test_each_recipe_derives_the_run_it_names(recipe: str) -> None:
    cfg = derive_run(make_config(), recipe_overrides(recipe, "stage_momentum=0.999 predict_weights"))
    name, *pairs = recipe.split(" ")
    settings = cfg.optimizer.settings()
    assert settings["name"] == name
    for pair in pairs:
        key, value = pair.split("=")
        want = [float(v) for v in value.split(",")] if key == "betas" else float(value)
        assert settings[key] == want, (key, settings)
    assert (cfg.pipeline.stage_momentum, cfg.pipeline.predict_weights, cfg.pipeline.stale_lr) == (0.999, True, None)


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("optimizer", {"betas": [[0.9, 0.95]]}),
        ("optimizer.name", {"name": ["adam"]}),
        ("optimizer.betas", {"name": ["adamw"], "betas": [[0.9, 1.0]]}),
        ("optimizer.momentum_decay", {"name": ["nadam"], "momentum_decay": [0]}),
        ("optimizer", {"name": ["adamw"], "lr": [1e-3]}),
    ],
)
def test_a_bad_optimizer_section_names_its_key(key: str, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as e:
        optimizer_recipes(bad)
    assert e.value.key == f"space.{key}"


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("staleness", {"stale": [True]}),
        ("staleness.stage_momentum", {"stage_momentum": [1.0]}),
        ("staleness.predict_weights", {"predict_weights": [1]}),
        ("staleness.stale_lr", {"stale_lr": [0]}),
    ],
)
def test_a_bad_staleness_section_names_its_key(key: str, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as e:
        staleness_recipes(bad)
    assert e.value.key == f"space.{key}"


def _space(tmp_path: Path, **keys: Any) -> SearchSpace:
    path = tmp_path / "space.yaml"
    path.write_text(
        yaml.safe_dump({"schedules": ["paci", "1f1b", "zb-h1"], "stages": [2], "microbatch_size": [4], **keys})
    )
    return load_space(str(path), global_batch=8, n_units=4, max_stages=None)


def test_every_schedule_gets_the_optimizer_dimension_and_only_paci_the_staleness_one(tmp_path: Path) -> None:
    space = _space(tmp_path, optimizer={"name": ["adamw", "nadam"]}, staleness={"predict_weights": [False, True]})
    for s in space.schedules:
        dims = space.grid_params(s)
        assert dims["optimizer"] == ["adamw", "nadam"], s
        assert ("staleness" in dims) == (s == "paci"), s
        points = space.grid(s)
        assert {(q.optimizer, q.staleness) for q in points} == (
            {(o, st) for o in ("adamw", "nadam") for st in ("off", "predict_weights")}
            if s == "paci"
            else {("adamw", None), ("nadam", None)}
        )
    assert space.describe()["optimizer"] == ["adamw", "nadam"]
    labels = {q.label() for q in space.grid("paci")}
    assert "paci P=2 a=2 b=4 [nadam] +predict_weights" in labels


def test_a_stage_momentum_at_or_below_an_optimizers_beta1_is_dropped_for_that_pair(tmp_path: Path) -> None:
    space = _space(
        tmp_path,
        optimizer={"name": ["adamw", "nadam"], "betas": [[0.9, 0.95], [0.99, 0.999]]},
        staleness={"stage_momentum": [None, 0.95]},
    )
    narrowed = skip_incompatible(space, make_config())
    kept = {(q.optimizer, q.staleness) for q in narrowed.grid("paci")}
    assert ("adamw betas=0.9,0.95", "stage_momentum=0.95") in kept
    assert ("nadam betas=0.99,0.999 momentum_decay=0.004", "stage_momentum=0.95") not in kept  # 0.95 <= 0.99
    assert ("nadam betas=0.99,0.999 momentum_decay=0.004", "off") not in kept  # (no momentum_decay given: no psi)
    assert ("nadam betas=0.99,0.999", "off") in kept
    assert any("pipeline.stage_momentum" in d for d in narrowed.dropped)
    assert len(narrowed.grid("1f1b")) == len(space.grid("1f1b"))  # flush has no staleness to refuse


@pytest.mark.slow
def test_a_search_tunes_the_optimizer_for_every_schedule_and_staleness_for_paci(tmp_path: Path) -> None:
    doc = make_config()
    prof = reference_profile(4, doc["model"]["block_size"])
    for u in prof["units"]:
        u["optimizer_steps"] = {"nadam": u["optimizer_s"] * 1.2}  # the rst clock charges each its own step
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(prof))
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump(
            {
                "schedules": ["paci", "1f1b"],
                "stages": [2],
                "microbatch_size": [2, 4],
                "optimizer": {"name": ["adamw", "nadam"], "betas": [[0.99, 0.999]]},
                "staleness": {"predict_weights": [False, True]},
            }
        )
    )
    config = write_search(
        tmp_path,
        budget={"clock": "rst", "profile": str(tmp_path / "profile.yaml"), "seconds": 0.3, "grid": 3},
        search={"trials": 4, "sampler": "grid"},
    )
    check_ok(run(search_cmd(config, tmp_path)))
    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    for s in ("paci", "1f1b"):
        study = optuna.load_study(study_name=f"model.{s}", storage=storage)
        for t in study.trials:
            assert t.params["optimizer"] in ("adamw betas=0.99,0.999", "nadam betas=0.99,0.999"), t.params
            assert ("staleness" in t.params) == (s == "paci"), t.params
            folder = tmp_path / "work" / "trials" / f"model.{s}" / f"trial-{t.number:04d}"
            if not folder.is_dir():
                assert {"repeat_of", "shared_from"} & set(t.user_attrs) or t.user_attrs.get("infeasible"), t.user_attrs
                continue  # a point already run, or its curve, is answered from the storage
            ran = yaml.safe_load((folder / "trial.yaml").read_text())
            assert ran["optimizer"]["name"] == t.params["optimizer"].split(" ")[0]
            assert ran["optimizer"]["betas"] == [0.99, 0.999]
            assert ran["pipeline"].get("predict_weights", False) == (t.params.get("staleness") == "predict_weights")
            assert t.params["optimizer"].split(" ")[0] in t.user_attrs["label"]
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["recommended"]["optimizer"]["name"] == best["run"]["optimizer"]["name"]
    assert best["recommended"]["optimizer"]["betas"] == [0.99, 0.999]
    base = best["comparison"]["baseline"]  # the compared synchronous point names its optimizer recipe
    assert base["schedule"] == "1f1b" and ("[adamw betas=0.99,0.999]" in base["point"] or "[nadam" in base["point"])


@pytest.mark.parametrize("live", [False, True])
def test_the_search_view_prints_the_optimizer_recipe_in_brackets(live: bool):
    """A label's ``[muon ...]`` is text, not rich markup (which drops an unknown tag without a word)."""
    import io

    from rich.console import Console

    from paci_tune.cli.search_view import SearchView
    from paci_tune.tune.events import SearchEvent
    from paci_tune.tune.point import TrialParams

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=live, width=200, color_system=None)
    params = TrialParams(
        "paci", 2, 4, 4, data_parallel=2, optimizer="muon momentum=0.95 betas=0.9,0.95", staleness="predict_weights"
    )
    with SearchView(budget=4.0, clock="rst", target=2.75, console=console, live=live) as view:
        view.on_event(SearchEvent("start", "paci", 3, params=params))
        view.on_event(SearchEvent("end", "paci", 3, params=params, state="complete", value=2.0, reason="[done]"))
    out = buf.getvalue()
    assert "[muon momentum=0.95 betas=0.9,0.95] +predict_weights" in out
    assert "[done]" in out
