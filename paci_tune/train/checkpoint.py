"""Checkpoints at drained segment boundaries, written so that a crash never leaves a half one.

Layout: ``DIR/batch_00000120/stage_0.pt .. stage_{P-1}.pt`` and ``meta.json`` (the loop's state),
then ``DIR/LATEST`` naming that folder. Each file is written to a temporary name and renamed;
``LATEST`` moves only after every rank's stage file and the meta file exist, so resuming always
finds a complete checkpoint. Several machines need ``DIR`` on a shared file system. May import:
:mod:`paci_tune.base`, :mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..base.files import atomic_write, atomic_write_text
from ..errors import ConfigError


def _atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def folder_for(root: Path, batches_done: int) -> Path:
    return root / f"batch_{batches_done:08d}"


def save_stages(root: Path, batches_done: int, states: dict[int, dict]) -> None:
    """Every process writes its own stages' files (step 1 of 2)."""
    folder = folder_for(root, batches_done)
    for s, state in states.items():
        _atomic_torch_save(state, folder / f"stage_{s}.pt")


def commit(root: Path, batches_done: int, meta: dict, keep: int) -> None:
    """One process, after all stage files exist, writes meta and moves LATEST (step 2 of 2)."""
    folder = folder_for(root, batches_done)
    atomic_write_text(folder / "meta.json", json.dumps(meta))
    atomic_write_text(root / "LATEST", folder.name + "\n")
    done = sorted(p for p in root.glob("batch_*") if (p / "meta.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> Path | None:
    marker = root / "LATEST"
    if not marker.is_file():
        return None
    folder = root / marker.read_text().strip()
    return folder if (folder / "meta.json").is_file() else None


def load(root: Path, stages: list[int]) -> tuple[dict, dict[int, dict]]:
    """Meta and the requested stages' states of the newest complete checkpoint."""
    folder = latest(root)
    if folder is None:
        raise ConfigError("--resume", str(root), "a checkpoint folder holding a complete checkpoint (none found)")
    meta = json.loads((folder / "meta.json").read_text())
    states = {s: torch.load(folder / f"stage_{s}.pt", map_location="cpu", weights_only=False) for s in stages}
    return meta, states
