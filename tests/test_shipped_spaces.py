"""Each shipped search space is what its own description says, and offers every schedule of the registry.

Oracle: the ``description`` line of each file, read with the patterns written here ("every schedule",
"P in {1,2,4}", "micro-batch 1..16", "LR x0.5..x4" or "LR x0.5/x1/x2", "fixed global batch" or "a and b
independent", "cpu-small's layouts", "{AdamW, Muon}") against the file's own keys; and the registry's
names (a shipped space that says "every schedule" lists each, PACI first).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from paci_tune.schedule import NAMES, SYNCHRONOUS
from paci_tune.tune.space import load_space

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
FILES = sorted(SPACES.glob("*.yaml"))


def _doc(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_shipped_space_is_what_its_description_says(path: Path) -> None:
    doc = _doc(path)
    text = doc["description"]
    checked = 0
    if "every schedule" in text:
        assert doc["schedules"] == list(NAMES), "every schedule: the registry's, PACI first"
        assert set(SYNCHRONOUS) <= set(doc["schedules"])
        checked += 1
    if m := re.search(r"P in \{([\d,]+)\}", text):
        assert doc["stages"] == _ints(m.group(1))
        checked += 1
    if m := re.search(r"micro-batch (\d+)\.\.(\d+)", text):
        low, high = int(m.group(1)), int(m.group(2))
        assert doc["microbatch_size"] == [2**k for k in range(high.bit_length()) if low <= 2**k <= high]
        checked += 1
    if m := re.search(r"LR x([\d.]+)\.\.x([\d.]+)", text):
        lrs = doc["lr_scale"]
        assert (min(lrs), max(lrs)) == (float(m.group(1)), float(m.group(2)))
        assert all(b == 2 * a for a, b in itertools.pairwise(lrs)), "a grid in factors of two"
        checked += 1
    if m := re.search(r"LR (x[\d.]+(?:/x[\d.]+)+)", text):
        assert doc["lr_scale"] == [float(x) for x in m.group(1).replace("x", "").split("/")]
        checked += 1
    if "fixed global batch" in text:
        assert doc.get("global_batch", "fixed") == "fixed"
        checked += 1
    if "a and b independent" in text:
        assert doc["global_batch"] == "free" and doc["window"] and doc["microbatch_size"]
        checked += 1
    if "cpu-small's layouts" in text:
        small = _doc(SPACES / "cpu-small.yaml")
        assert (doc["stages"], doc["microbatch_size"]) == (small["stages"], small["microbatch_size"])
        checked += 1
    if m := re.search(r"\{(AdamW, Muon)\}", text):
        assert doc["optimizer"]["name"] == [n.strip().lower() for n in m.group(1).split(",")]
        checked += 1
    assert checked >= 3, f"{path.name}: the description says too little to be checked: {text!r}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_shipped_space_binds_and_gives_every_schedule_a_point(path: Path) -> None:
    """On a model of 8 units (2P pieces for a V at P = 4), every schedule keeps a point of its own."""
    space = load_space(str(path), global_batch=64, n_units=8, max_stages=None)
    assert space.schedules == tuple(NAMES)
    for schedule in space.schedules:
        if space.lr_is_range:
            continue
        assert space.grid(schedule), f"{path.name}: {schedule} has no point"
