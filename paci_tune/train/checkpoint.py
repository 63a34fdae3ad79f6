"""Checkpoints at drained segment boundaries, written so that a crash never leaves a half one.

Layout: ``DIR/batch_00000120/stage_0.pt .. stage_{P-1}.pt`` and ``meta.json`` (the loop's state),
then ``DIR/LATEST`` naming that folder. Each file is written to a temporary name, fsynced and
renamed (:func:`paci_tune.base.files.atomic_write`); ``LATEST`` moves only once every rank's stage
file, the meta file, their folder and the root's entry for it are on disk, and older checkpoints
are pruned only after the move is on disk: a crash, even of the machine, leaves ``LATEST`` naming a
complete checkpoint. A ``LATEST`` that names nothing complete (copied or edited by hand, or a folder
deleted) is refused, naming it (:func:`latest`), never taken for "nothing saved yet": that would
start the run again from step 0 and its next checkpoint would prune the good ones.

One run writes a checkpoint root at a time: :func:`hold` takes its lock (:mod:`paci_tune.base.locks`;
the launcher of a distributed run holds it for its workers, :data:`LOCK_ENV`), and a second run
on the same root is refused, naming the first. :func:`reshard` reads a checkpoint per model unit and
parameter name (each stage file names its optimizer's parameter order) and gathers the units of
another layout's stages, so ``training.init_from`` (``--init-from``) starts any layout from it.
Several machines need ``DIR`` on a shared file system.

A checkpoint is data from outside the process (another run, another person, a shared file system),
so a stage file is unpickled only by torch's weights-only loader, which builds tensors and plain
containers and refuses anything else; :func:`check_files` refuses a file holding anything else
before any work, naming it, without unpickling it. Everything paci-tune writes is such data:
tensors, dicts, lists, numbers and strings (the loop's state is JSON, ``meta.json``). May import:
:mod:`paci_tune.base`, :mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..base.files import atomic_write, atomic_write_text, fsync_dir
from ..base.locks import Holder, Lock, try_lock
from ..errors import ConfigError, Failure

INIT_FROM = "training.init_from"
"""The config key (``--init-from`` on the command line) errors about a checkpoint to start from name."""

RESUME = "--resume"
"""What errors about the checkpoint a run resumes from name."""

DIR = "training.checkpoint_dir"

LOCK = ".writer.lock"
"""The root's lock file (not warm-start's ``.lock``: the warm-up holds that one while it trains here)."""

LOCK_ENV = "PACI_TUNE_CHECKPOINT_LOCKED"
"""Set by the distributed launcher to the root it holds the lock of: its workers do not take it again."""

_NAME = re.compile(r"batch_\d{8}")

_FOREIGN = (
    "a stage file paci-tune wrote: this one holds objects a paci-tune checkpoint never contains{what}, "
    "so it was not loaded (unpickling them could run code)"
)


def _refuse(path: Path, key: str, what: str = "") -> ConfigError:
    return ConfigError(key, str(path), _FOREIGN.format(what=what))


def read_stage_file(path: Path, key: str) -> dict:
    """One stage file, unpickled by torch's weights-only loader (tensors and plain containers, nothing
    that runs code); a file that needs anything else is refused as not paci-tune's (exit 2)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise _refuse(path, key) from None


def _stage_count(folder: Path, key: str) -> int:
    """How many stage files the checkpoint has (its meta's partition has an entry per stage file)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return len(meta["partition"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            key, str(folder / "meta.json"), "the meta file of a checkpoint paci-tune wrote (unreadable or truncated)"
        ) from None


def check_files(folder: Path, key: str) -> None:
    """Refuse, before any work, a checkpoint folder that is incomplete or whose stage files hold anything but data.

    Every stage its meta file names must have its file. torch lists the classes and functions a
    file's pickle names (without unpickling it, and without reading its tensors); anything outside
    what the weights-only loader allows -- which covers all that paci-tune writes -- is named in the
    refusal. A file that is not a torch checkpoint at all (truncated, another format) is refused too.
    """
    for s in range(_stage_count(folder, key)):
        if not (folder / f"stage_{s}.pt").is_file():
            raise ConfigError(key, str(folder / f"stage_{s}.pt"), "a complete checkpoint (this stage file is missing)")
    for path in sorted(folder.glob("stage_*.pt")):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError, OSError):
            raise ConfigError(
                key,
                str(path),
                "a stage file paci-tune wrote (this is not a file torch.save wrote: truncated, or another format)",
            ) from None
        if unsafe:
            shown = ", ".join(unsafe[:4]) + (", ..." if len(unsafe) > 4 else "")
            raise _refuse(path, key, f" ({shown})")


def _atomic_torch_save(obj: Any, path: Path) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a Python file: a full disk is an OSError here (a path gives a RuntimeError)
            torch.save(obj, f)

    atomic_write(path, write)


def folder_for(root: Path, batches_done: int) -> Path:
    return root / f"batch_{batches_done:08d}"


def save_stages(root: Path, batches_done: int, states: dict[int, dict]) -> None:
    """Every process writes its own stages' files, each on disk before this returns (step 1 of 2)."""
    folder = folder_for(root, batches_done)
    for s, state in states.items():
        _atomic_torch_save(state, folder / f"stage_{s}.pt")


def _fsync_dir(folder: Path, unreadable_ok: bool = False) -> None:
    try:
        fsync_dir(folder)
    except PermissionError:
        if not unreadable_ok:
            raise Failure(f"writing the checkpoint {folder}", "opening its folder: permission denied") from None
    except OSError as e:
        raise Failure(f"writing the checkpoint {folder}", f"flushing its folder failed ({e.strerror or e})") from e


def commit(root: Path, batches_done: int, meta: dict, keep: int) -> None:
    """One process, after all stage files are on disk, writes meta and moves LATEST (step 2 of 2).

    The folder (every rank's stage file in it) and the root (the folder in it) are fsynced before
    LATEST is replaced, and LATEST's move is on disk before any older checkpoint is pruned.
    """
    folder = folder_for(root, batches_done)
    atomic_write_text(folder / "meta.json", json.dumps(meta))
    _fsync_dir(folder)
    _fsync_dir(root)
    if not (root / "LATEST").exists():  # the first checkpoint: the root's own entry too (where readable)
        _fsync_dir(root.parent, unreadable_ok=True)
    atomic_write_text(root / "LATEST", folder.name + "\n")  # fsyncs the root after the rename
    prune(root, folder, keep)


def prune(root: Path, current: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints -- never ``current``, the one LATEST names --
    and the incomplete folders older than it (a crash's leftovers: LATEST never named them)."""
    folders = sorted(p for p in root.glob("batch_*") if p.is_dir() and _NAME.fullmatch(p.name))
    done = [p for p in folders if (p / "meta.json").is_file()]
    stale = set(done[:-keep]) | {p for p in folders if p not in done and p.name < current.name}
    for old in sorted(stale - {current}):
        shutil.rmtree(old, ignore_errors=True)


def _complete(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("batch_*") if _NAME.fullmatch(p.name) and (p / "meta.json").is_file())


def latest(root: Path, key: str = RESUME) -> Path | None:
    """The checkpoint folder ``root/LATEST`` names; None when there is no LATEST (nothing saved yet).

    A LATEST that names nothing complete is refused (exit 2, naming ``key``), never read as "nothing
    saved": a run resumed from step 0 would prune the good checkpoints at its first save.
    """
    marker = root / "LATEST"
    if not marker.exists():
        return None
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        name, why = None, f"it is unreadable ({getattr(e, 'strerror', None) or e})"
    if name is not None:
        folder = root / name
        if not _NAME.fullmatch(name):
            why = f"it names {name[:80]!r}, not a checkpoint folder (batch_ and 8 digits)"
        elif not folder.is_dir():
            why = f"it names {name!r}, which does not exist"
        elif not (folder / "meta.json").is_file():
            why = f"it names {name!r}, which has no meta.json (an incomplete checkpoint)"
        else:
            return folder
    found = _complete(root)
    hint = (
        f"; complete checkpoints there: {', '.join(found[-3:])} (write one's name into LATEST to resume from it)"
        if found
        else "; there is no complete checkpoint there (remove LATEST to start afresh)"
    )
    raise ConfigError(key, str(marker), f"a LATEST naming a complete checkpoint folder beside it: {why}{hint}")


def load(root: Path, stages: list[int]) -> tuple[dict, dict[int, dict]]:
    """Meta and the requested stages' states of the newest complete checkpoint (checked: :func:`check_files`)."""
    folder = latest(root)
    if folder is None:
        raise ConfigError(RESUME, str(root), "a checkpoint folder holding a complete checkpoint (none found)")
    check_files(folder, RESUME)
    meta = json.loads((folder / "meta.json").read_text())
    states = {s: read_stage_file(folder / f"stage_{s}.pt", RESUME) for s in stages}
    return meta, states


def hold(root: Path) -> Lock:
    """The lock of checkpoint root ``root`` for this run (release it when the run ends); a root another
    live run holds is refused (exit 2), naming it. Nothing is locked on a file system without flock."""
    got = try_lock(root / LOCK)
    if isinstance(got, Holder):
        raise ConfigError(
            DIR,
            str(root),
            f"a checkpoint folder no other run is writing: {got.describe()} is training into it "
            "(wait for it to end, or choose another --checkpoint-dir)",
        )
    return got


def check_free(root: Path) -> None:
    """Refuse now, before any work, a root another run holds (:func:`hold`); creates nothing."""
    if (root / LOCK).exists():
        hold(root).release()


def _ranges(sizes: list[int]) -> list[range]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def find(path: Path, key: str = INIT_FROM) -> Path:
    """A checkpoint folder, or the newest one under a root with ``LATEST``."""
    if (path / "meta.json").is_file():
        return path
    folder = latest(path, key)
    if folder is None:
        raise ConfigError(key, str(path), "a checkpoint folder (with meta.json) or a checkpoint root with LATEST")
    return folder


def units_of(folder: Path) -> tuple[dict, dict[tuple[int, str], dict]]:
    """Meta and the checkpoint keyed by (model unit, name within the unit): value and optimizer state.

    Replica 0's stages are the state (replicas are identical after each step). The value is fp32:
    the master weight of a bf16 parameter (of every parameter under weight prediction, whose
    parameters hold the extrapolated weights), else the parameter itself. A frozen parameter (not in the
    optimizer: ``opt_names``) has no optimizer state; a stage with nothing to train has an empty
    ``opt_names``. ``param_names`` tells frozen parameters from buffers (checkpoints written before it
    had no frozen parameters: every parameter was in the optimizer). ``meta["updates"]`` is the most
    steps any stage took (a stage with nothing to train took none).
    """
    meta = json.loads((folder / "meta.json").read_text())
    units: dict[tuple[int, str], dict] = {}
    meta["updates"] = 0
    for s, rng in enumerate(_ranges(meta["partition"])):
        st = read_stage_file(folder / f"stage_{s}.pt", INIT_FROM)
        if "opt_names" not in st:
            raise ConfigError(INIT_FROM, str(folder), "a checkpoint written by this version (no parameter index)")
        names = st["opt_names"]
        opt = st["optimizer"]["state"]
        masters = iter(st.get("masters") or [])
        param_set = set(names)
        all_params = set(st.get("param_names", names))
        for key, tensor in st["module"].items():
            i, rest = key.split(".", 1)
            entry: dict = {"value": tensor}
            if key in param_set:
                entry["state"] = opt.get(names.index(key), {})
            elif key in all_params:
                entry["state"] = {}  # frozen: a value, no optimizer state
            else:
                entry["buffer"] = True
            units[(rng[int(i)], rest)] = entry
        # whose masters: named (bf16 parameters, or all of them under weight prediction), else the bf16 ones
        owners = st.get("master_names") or [
            k for k in st["module"] if k in param_set and st["module"][k].dtype == torch.bfloat16
        ]
        for key in owners:
            i, rest = key.split(".", 1)
            units[(rng[int(i)], rest)]["value"] = next(masters)
        for alias, first in _ties(st["module"], param_set, all_params).items():
            i, rest = alias.split(".", 1)
            j, first_rest = first.split(".", 1)
            units[(rng[int(i)], rest)] = units[(rng[int(j)], first_rest)]
        for e in units.values():
            if not e.get("buffer") and e["value"].dtype != torch.float32:
                e["value"] = e["value"].float()
        meta["updates"] = max(meta["updates"], st["updates"])  # every stage that trains took as many
    return meta, units


def _ties(module: dict[str, torch.Tensor], stepped: set[str], params: set[str]) -> dict[str, str]:
    """A parameter saved under a second name (tied within one stage), mapped to the name its optimizer used.

    The stage's module state names each use of a tied parameter, one storage saved once; its optimizer
    state and bf16 master are under the first name only. The second name takes the first's entry, so a
    cut that puts the two units on different stages starts both copies with the state (:mod:`paci_tune.pipeline.tied`).
    """

    def where(t: torch.Tensor) -> tuple:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)

    first = {where(module[n]): n for n in module if n in stepped}
    out = {}
    for name in sorted(params - stepped):
        owner = first.get(where(module[name]))
        if owner is not None:
            out[name] = owner
    return out


def reshard(folder: Path, sizes: list[int], stages: list[int]) -> tuple[dict, dict[int, dict]]:
    """Meta and the states of ``stages`` of the cut ``sizes``, gathered per model unit from ``folder``."""
    meta, units = units_of(folder)
    n = 1 + max(u for u, _ in units)
    if sum(sizes) != n:
        raise ConfigError(INIT_FROM, str(folder), f"a checkpoint of a model with {sum(sizes)} units (it has {n})")
    updates = meta["updates"]
    out = {}
    for s in stages:
        rng = _ranges(sizes)[s]
        params, buffers = {}, {}
        for (u, rest), e in units.items():
            if u in rng:
                local = f"{u - rng.start}.{rest}"
                if e.get("buffer"):
                    buffers[local] = e["value"]
                else:
                    params[local] = {"value": e["value"], "state": e["state"]}
        out[s] = {"params": params, "buffers": buffers, "updates": updates}
    return meta, out
