"""Run configs for the tests: one tiny base document, and a deep merge to vary it.

Every test that trains, simulates or searches starts from :data:`BASE_CONFIG` (or a section of it)
and names only what it changes, instead of writing out a whole config of its own.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# A model and data small enough that a training step takes milliseconds on a 2-core CPU.
# Every hyper-parameter the oracles use is spelled out, so no test depends on a default.
BASE_CONFIG: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32},
    "data": {"source": "synthetic", "vocab_size": 64, "branching": 4, "n_train": 50_000, "n_val": 5_000},
    "training": {"global_batch": 8, "steps": 6, "seed": 0, "eval_every": 1000, "eval_sequences": 4},
    "optimizer": {"name": "adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8},
    "lr_schedule": {"warmup_fraction": 0.0, "min_ratio": 1.0, "scaling": "none"},
    "pipeline": {"schedule": "paci", "stages": 2, "window": 4, "runtime": "emulated", "device": "cpu"},
}

NARROW_MODEL: dict[str, Any] = {"preset": "tiny", "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 16}
"""A narrower tiny GPT (4 units) for the tests that simulate or plan rather than train for numbers."""

SIM_CONFIG: dict[str, Any] = {
    "model": NARROW_MODEL,
    "data": {"source": "synthetic", "vocab_size": 64, "n_train": 5000, "n_val": 1000},
    "training": {"global_batch": 8, "steps": 4},
    "pipeline": {"stages": 2, "window": 4, "device": "cpu"},
}
"""A config for the simulate command and the docs' readers: the narrow model, the rest at paci-tune's defaults."""


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (section by section)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """BASE_CONFIG with some keys of some sections replaced: ``make_config(training={"steps": 3})``."""
    return merge(BASE_CONFIG, sections)


def sim_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """SIM_CONFIG with some keys of some sections replaced (or sections added)."""
    return merge(SIM_CONFIG, sections)


def write_config(directory: Path, doc: dict[str, Any], name: str = "run.yaml") -> Path:
    """``doc`` as YAML in ``directory``; the file's path."""
    path = Path(directory) / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_best_for(folder: Path, run: dict[str, Any]) -> Path:
    """A minimal best.yaml recommending ``run`` (what ``apply`` reads), in ``folder``."""
    p = run["pipeline"]
    best = {
        "recommended": {
            "schedule": p["schedule"],
            "stages": p["stages"],
            "window": p["window"],
            "microbatch_size": run["training"]["global_batch"] // p["window"],
            "global_batch": run["training"]["global_batch"],
            "lr": run["optimizer"]["lr"],
        },
        "evidence": {"steps": run["training"]["steps"]},
        "target": {"metric": "val_loss", "value": 1.0},
        "budget": {"clock": "sim", "seconds": 0.3, "grid": 3},
        "provenance": {"study_name": "run"},
        "run": copy.deepcopy(run),
    }
    path = folder / "best.yaml"
    path.write_text(yaml.safe_dump(best, sort_keys=False))
    return path
