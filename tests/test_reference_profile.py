"""The example's reference profile (the rst clock's reference system) ships as package data and is
found by name, ``profiles/tiny-gpt.yaml``, from any folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from paci_tune.base.shipped import shipped, shipped_names
from paci_tune.config.tune import load_tune_config
from paci_tune.sim.profile import Profile


def test_the_example_profile_ships_and_loads() -> None:
    assert "tiny-gpt" in shipped_names("profiles")
    p = shipped("profiles", "tiny-gpt")
    assert p is not None
    prof = Profile.load(p)
    assert prof is not None
    doc = yaml.safe_load(p.read_text())
    assert doc["threads"] == 1 and doc["dtype"] == "fp32"
    assert set(doc["units"][1]["microbatch"]) == {4, 8, 16}  # every micro-batch size of cpu-small


def test_rst_budget_finds_the_shipped_profile_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = yaml.safe_load(shipped("examples", "tiny-gpt").read_text())  # type: ignore[union-attr]
    doc["budget"] = {**doc["budget"], "clock": "rst", "profile": "profiles/tiny-gpt.yaml"}
    monkeypatch.chdir(tmp_path)
    tune = load_tune_config(doc)
    assert tune.budget.clock == "rst"
    assert Path(tune.budget.profile or "").resolve() == shipped("profiles", "tiny-gpt").resolve()  # type: ignore[union-attr]


def test_profile_paths_find_the_shipped_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--profile profiles/tiny-gpt.yaml`` (train, simulate) reads the shipped file where no such file
    exists here; a file that exists here wins; another missing path is still refused, naming the key."""
    from paci_tune.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    shipped_doc = yaml.safe_load(shipped("profiles", "tiny-gpt").read_text())  # type: ignore[union-attr]
    assert Profile.load("profiles/tiny-gpt.yaml").units[1].name == shipped_doc["units"][1]["name"]
    (tmp_path / "profiles").mkdir()
    mine = {**shipped_doc, "seq_len": 64}
    (tmp_path / "profiles" / "tiny-gpt.yaml").write_text(yaml.safe_dump(mine))
    assert Profile.load("profiles/tiny-gpt.yaml").seq_len == 64
    with pytest.raises(ConfigError, match="--profile"):
        Profile.load("profiles/no-such.yaml", "--profile")
