"""Durable checkpoints: on disk before LATEST moves, LATEST never dangling unnoticed, a full disk a clear failure.

Oracles: the order of the real ``fsync`` and ``rename`` calls of a real run (recorded, each then
done); a LATEST that names nothing complete refused by the real CLI with exit 2 before any
training (no metrics file, the checkpoint untouched); a disk that fills during the second
checkpoint (``torch.save`` as it fails on a full disk) leaves the first intact, and resuming from it
gives the uninterrupted run's losses.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config

from paci_tune.errors import ConfigError, Failure
from paci_tune.train import checkpoint

STEPS, EVERY = 6, 2


def _doc(ckpt: Path, keep: int = 2) -> dict[str, Any]:
    return make_config(
        training={"steps": STEPS, "checkpoint_every": EVERY, "keep_checkpoints": keep, "checkpoint_dir": str(ckpt)}
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A finished run's checkpoint root (batch 4 and 6 kept, LATEST naming 6) and its records."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    return root, run_in_process(_doc(root))


def _copy(saved: tuple[Path, list], tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    return root


# ------------------------------------------------------------------------------------ fsync order
def test_files_and_folders_are_on_disk_before_latest_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    events: list[tuple[str, str, str]] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        events.append(("replace", str(Path(src).absolute()), str(Path(dst).absolute())))
        real_replace(src, dst, **kw)

    def rmtree(path: Any, *a: Any, **kw: Any) -> None:
        events.append(("rmtree", str(Path(path).absolute()), ""))
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    root = tmp_path.resolve() / "ckpt"
    run_in_process(_doc(root, keep=1))
    monkeypatch.undo()

    def index(kind: str, a: str, b: str = "", after: int = -1) -> int:
        found = [i for i, e in enumerate(events) if e[0] == kind and e[1] == a and e[2] == b and i > after]
        assert found, f"no {kind} of {a} {b} after event {after}: {events}"
        return found[0]

    latest_moves = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "LATEST")]
    assert len(latest_moves) == STEPS // EVERY
    previous = -1
    for n, move in enumerate(latest_moves):
        folder = root / f"batch_{(n + 1) * EVERY:08d}"
        files = [folder / "stage_0.pt", folder / "stage_1.pt", folder / "meta.json", root / "LATEST"]
        for f in files:  # each file's data on disk before its name
            rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(f) and i > previous)
            assert ("fsync", events[rename][1], "") in events[previous + 1 : rename], f"{f} renamed before its fsync"
        last_in_folder = max(
            i for i, e in enumerate(events[:move]) if e[0] == "replace" and e[2].startswith(str(folder) + "/")
        )
        assert index("fsync", str(folder), after=last_in_folder) < move, "the folder was not fsynced before LATEST"
        assert index("fsync", str(root), after=last_in_folder) < move, "the root was not fsynced before LATEST"
        previous = move
    for i in (i for i, e in enumerate(events) if e[0] == "rmtree"):  # pruned only after a newer LATEST is on disk
        moved = [m for m in latest_moves if m < i]
        assert moved, f"{events[i][1]} pruned before any LATEST moved"
        named = root / f"batch_{len(moved) * EVERY:08d}"
        assert events[i][1] < str(named), f"pruned {events[i][1]} while LATEST names {named}"
        assert index("fsync", str(root), after=moved[-1]) < i, "pruned before LATEST's move was on disk"
    assert (root / "LATEST").read_text().strip() == f"batch_{STEPS:08d}"
    assert sorted(p.name for p in root.glob("batch_*")) == [f"batch_{STEPS:08d}"]


def test_atomic_write_tolerates_a_folder_fsync_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Some file systems answer EINVAL to a folder's fsync: the write still succeeds."""
    from paci_tune.base import files

    real = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    files.atomic_write_text(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"


# ----------------------------------------------------------------------------- LATEST that dangles
def _break(root: Path, how: str) -> str:
    """Break the saved checkpoint ``how``; what the refusal must name."""
    marker, folder = root / "LATEST", root / f"batch_{STEPS:08d}"
    if how == "missing-folder":
        marker.write_text("batch_00000099\n")
        return "batch_00000099"
    if how == "no-meta":
        (folder / "meta.json").unlink()
        return folder.name
    if how == "garbage":
        marker.write_bytes(b"\x00\xffnot a name\n")
        return str(marker)
    if how == "missing-stage":
        (folder / "stage_1.pt").unlink()
        return str(folder / "stage_1.pt")
    assert how == "truncated-stage"
    data = (folder / "stage_1.pt").read_bytes()
    (folder / "stage_1.pt").write_bytes(data[: len(data) // 2])
    return str(folder / "stage_1.pt")


@pytest.mark.parametrize("how", ["missing-folder", "no-meta", "garbage", "missing-stage", "truncated-stage"])
def test_latest_naming_nothing_complete_is_refused(saved: tuple[Path, list], tmp_path: Path, how: str):
    root = _copy(saved, tmp_path)
    named = _break(root, how)
    with pytest.raises(ConfigError) as e:
        run_in_process(_doc(root), resume=True)
    assert e.value.key == "--resume" and named in str(e.value), str(e.value)
    assert sorted(p.name for p in root.glob("batch_*")) == sorted(p.name for p in saved[0].glob("batch_*"))
    with pytest.raises(ConfigError) as e:  # starting another layout from it names its own key
        checkpoint.check_files(checkpoint.find(root), checkpoint.INIT_FROM)
    assert e.value.key == "training.init_from" and named in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing-folder", "truncated-stage"])
def test_cli_resume_from_a_dangling_latest_exits_2_before_training(saved, tmp_path: Path, how: str):
    root = _copy(saved, tmp_path)
    named = _break(root, how)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    metrics = tmp_path / "m.jsonl"
    t0 = time.monotonic()
    proc = run_cli(write_config(tmp_path, _doc(root)), "--resume", "--metrics", metrics, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60, "refused only after a while: it should be refused before any work"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --resume: got "), lines[0]
    assert named in lines[0], lines[0]
    if how == "missing-folder":
        assert str(root / "LATEST") in lines[0] and "does not exist" in lines[0], lines[0]
    assert not metrics.exists() and "step 1:" not in proc.stdout
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before, "the refused run changed the folder"


def test_resume_with_no_latest_still_starts_fresh(tmp_path: Path):
    got = run_in_process(_doc(tmp_path / "never-written"), resume=True)
    assert [r["resumed_at"] for r in got if r["event"] == "start"] == [0]


# --------------------------------------------------------------------------------------- full disk
def test_full_disk_during_a_checkpoint_keeps_the_last_one(
    saved: tuple[Path, list], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The second checkpoint's first stage file meets a full disk: a Failure naming that file, the first
    checkpoint still LATEST and complete, no temporary file left; resuming reaches the uninterrupted losses."""
    real_save = torch.save
    calls = {"n": 0}

    def full_disk_save(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:  # the first checkpoint's two stage files
            return real_save(obj, f, *a, **kw)
        if isinstance(f, (str, os.PathLike)):
            return real_save(obj, "/dev/full")  # what torch does with a path on a full disk
        f.write(b"PK\x03\x04" + bytes(4096))  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    root = tmp_path / "ckpt"
    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(Failure) as e:
        run_in_process(_doc(root))
    monkeypatch.undo()
    stage = root / f"batch_{2 * EVERY:08d}" / "stage_0.pt"
    assert str(stage) in str(e.value) and "no space left" in str(e.value), str(e.value)
    assert (root / "LATEST").read_text().strip() == f"batch_{EVERY:08d}"
    checkpoint.check_files(root / f"batch_{EVERY:08d}", "--resume")
    leftovers = [p for p in root.rglob(".*") if p.name != checkpoint.LOCK]
    assert not leftovers, f"temporary files left behind: {leftovers}"

    resumed = run_in_process(_doc(root), resume=True)
    reference = saved[1]
    assert [r["resumed_at"] for r in resumed if r["event"] == "start"] == [0, EVERY]
    assert train_losses(resumed) == pytest.approx(train_losses(reference), abs=1e-6, rel=0)
    assert summary_of(resumed)["final_val_loss"] == pytest.approx(summary_of(reference)["final_val_loss"], abs=1e-6)
