"""What a report shows, read once: ``best.yaml`` (when there is one) and the study pair behind it.

A search leaves two things: the recommendation (``best.yaml``, with the verdict, the confirmation
and the provenance naming its storage and study) and the Optuna studies ``NAME.<schedule>`` (``paci``,
``1f1b`` and any other synchronous baseline the space named) holding every trial. The report reads
both and nothing else, so it can be made on any machine that reaches the storage, long after the
search, and it shows the same numbers the recommendation was made from.

best.yaml is the file people send each other, so the storage it names is not opened on its word
alone (a server of its author's choosing would get libpq's ``PGPASSWORD``; a file path would be
created): the report opens ``--storage``, or ``PACI_TUNE_STORAGE`` when there is no best.yaml or it
names best.yaml's storage (which keeps no password). The one exception is what a search leaves beside
its best.yaml: a SQLite or journal file that exists in best.yaml's folder or below it, opened read-only.
Otherwise the report is best.yaml's alone (its verdict, comparison, candidates and trial counts) and
:attr:`Evidence.note` says which storage holds the trials and the flag that includes them. A SQLite or
journal file that does not exist is refused (exit 2): a report creates no storage and writes to none
(SQLite is opened read-only). May import: optuna, :mod:`paci_tune.verdict`, :mod:`paci_tune.tune`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

from ..base.credentials import STORAGE_ENV, same_storage, shown
from ..errors import ConfigError, Failure
from ..schedule import FLUSH, NAMES
from ..tune.bestfile import BestFile, read_best
from ..tune.point import TrialParams
from ..tune.record import StudyRecord, TrialRecord
from ..tune.study import open_storage, storage_file
from ..verdict.best import params_of, trial_counts


@dataclass(frozen=True)
class TrialRow:
    """One trial as the report shows it."""

    schedule: str
    number: int
    state: str  # complete | pruned | failed | infeasible | running | waiting
    point: TrialParams | None
    score: float | None
    time_to_target: float | None
    best_val_loss: float | None
    curve: list[tuple[float, float]]
    reason: str | None  # why it was pruned or failed
    confirmation_of: int | None  # the search trial whose point this confirms
    seed: int | None
    attrs: dict[str, Any] = field(repr=False)
    transfer_of: int | None = None  # the search trial whose point this trains at a transfer check's longer budget

    @property
    def is_search(self) -> bool:
        """A search trial: not a confirmation or transfer-check run (:func:`paci_tune.tune.record.is_extra`)."""
        return self.confirmation_of is None and self.transfer_of is None

    @property
    def label(self) -> str:
        return self.point.label() if self.point else "?"


@dataclass(frozen=True)
class Evidence:
    """A finished (or running) search: its rows per schedule, its studies and its best.yaml."""

    name: str
    storage: str
    studies: dict[str, optuna.Study]
    rows: dict[str, list[TrialRow]]
    best: BestFile | None
    target: float | None
    budget: float | None
    clock: str
    note: str | None = None  # why the trials are not shown: the storage best.yaml names, and the flag to pass

    @property
    def baseline_schedule(self) -> str:
        return baseline_schedule(self.best)

    def winner(self, schedule: str) -> TrialRow | None:
        """The schedule's chosen search trial: best.yaml's (confirmed) pick, else its best single draw."""
        wanted = None
        compared = self.best.verdict_record if self.best is not None else None
        sides = {side["schedule"]: side for side in (compared.paci, compared.baseline)} if compared else {}
        if self.best is not None:
            if schedule in sides:
                wanted = _trial_number(sides[schedule].get("trial"))
            elif self.best.recommended.schedule == schedule:
                wanted = _trial_number(self.best.evidence.trial if self.best.evidence else None)
            elif (rows := (self.best.confirmation or {}).get(schedule)) and rows:
                wanted = rows[0]["trial"]  # the plan's first: the search's best
        search = [r for r in self.rows.get(schedule, []) if r.is_search]
        if wanted is not None:
            return next((r for r in search if r.number == wanted), None)
        done = [r for r in search if r.state == "complete" and r.score is not None]
        return min(done, key=lambda r: (r.score, r.number)) if done else None

    def confirmations(self, schedule: str, of: int) -> list[TrialRow]:
        return sorted((r for r in self.rows.get(schedule, []) if r.confirmation_of == of), key=lambda r: r.seed or 0)

    def counts(self) -> dict[str, dict[str, int]]:
        """Trials per state and schedule: the studies', else (no storage opened) best.yaml's as it recorded them."""
        if self.studies or self.best is None:
            return {s: trial_counts(st) for s, st in self.studies.items()}
        kept = (self.best.provenance or {}).get("trials")
        keys = ("complete", "pruned", "failed", "confirmation")
        return {
            str(s): c
            for s, c in (kept.items() if isinstance(kept, dict) else ())
            if isinstance(c, dict) and all(type(c.get(k)) is int for k in keys)
        }

    def reasons(self, schedule: str) -> dict[str, int]:
        """How many trials were pruned or failed for each reason (the reason's first clause)."""
        out: dict[str, int] = {}
        for r in self.rows.get(schedule, []):
            if r.state in ("pruned", "failed", "infeasible") and r.reason:
                head = r.reason.split(" (")[0]
                key = f"failed: {head.split(':')[0]}" if r.state == "failed" else head
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def baseline_schedule(best: BestFile | None) -> str:
    """The synchronous schedule PACI is compared with: best.yaml's (files before the key: 1f1b)."""
    return str((best.baseline_schedule if best is not None else None) or FLUSH)


def gather(best_path: str | Path | None, storage: str | None, study_name: str | None) -> Evidence:
    """The evidence of one search, from its best.yaml or from ``storage`` + ``study_name``.

    A best.yaml names its study; ``study_name`` overrides it. Which storage is opened is the module
    docstring's: ``storage`` (``--storage``), ``PACI_TUNE_STORAGE``, or best.yaml's own file beside it;
    else the report is best.yaml's alone, with a note. Without best.yaml the report shows the studies as
    they stand, and says there is no recommendation yet.
    """
    best = read_best(best_path, trainable=False) if best_path is not None else None
    prov = (best.provenance if best is not None else None) or {}
    kept = prov.get("storage") if isinstance(prov.get("storage"), str) else None
    key = "--storage"
    if not storage:
        storage, key = _chosen(kept, best_path)
    name = study_name or prov.get("study_name")
    if best is not None and not storage:
        return _best_alone(best, str(name or Path(str(best_path)).stem), kept)
    if not storage or not name:
        raise ConfigError(
            "report", "no study", "a best.yaml written by `paci-tune search`, or --storage URL and --study-name NAME"
        )
    store = _open(storage, key)
    names = {s.study_name for s in optuna.get_all_study_summaries(store)}
    studies = {s: optuna.load_study(study_name=f"{name}.{s}", storage=store) for s in NAMES if f"{name}.{s}" in names}
    if not studies:
        known = sorted({n.rsplit(".", 1)[0] for n in names})
        raise ConfigError("--study-name", name, f"a search stored in {shown(storage)}: {', '.join(known) or 'none'}")
    # The studies' fingerprint (tune.setup.fingerprint) holds the search's own target, budget and space.
    fp = next((f for st in studies.values() if (f := StudyRecord.read(st).fingerprint) is not None), {})
    batch = (fp.get("space") or {}).get("global_batch")
    fixed = int(batch) if isinstance(batch, int) else None
    rows = {s: [_row(t, s, fixed) for t in st.get_trials(deepcopy=False)] for s, st in studies.items()}
    clock, seconds, _ = fp.get("budget") or [prov.get("clock", "sim"), None, None]
    return Evidence(name, shown(storage), studies, rows, best, fp.get("target"), seconds, clock)


def _chosen(kept: str | None, best_path: str | Path | None) -> tuple[str | None, str]:
    """The storage to open without ``--storage``, and where it was named: PACI_TUNE_STORAGE's when there is no
    best.yaml or it names best.yaml's storage (``kept``, without its password); else best.yaml's own file
    beside it; else none."""
    env = os.environ.get(STORAGE_ENV)
    if env and (best_path is None or kept is None or same_storage(env, kept)):
        return env, STORAGE_ENV
    key = "best.yaml.provenance.storage"
    if kept is None or best_path is None or (f := storage_file(kept)) is None:
        return None, key
    beside = Path(best_path).resolve().parent
    return (kept if f.resolve().is_relative_to(beside) and f.is_file() else None), key


def _best_alone(best: BestFile, name: str, kept: str | None) -> Evidence:
    """The report of best.yaml without its studies: the storage it names is not opened (module docstring)."""
    where = shown(kept) if kept else "none"
    note = (
        f"best.yaml names its trials' storage {where}, not opened (a report opens a storage you name, or the "
        "search's file beside best.yaml): "
        f"pass --storage {where} (or set {STORAGE_ENV}) to include its trials; this report is best.yaml's alone"
        if kept
        else "best.yaml names no storage: pass --storage URL to include the search's trials"
    )
    target = (best.target or {}).get("value")
    budget = best.budget or {}
    clock = budget.get("clock") or (best.provenance or {}).get("clock") or "sim"
    return Evidence(name, f"not opened: {where}", {}, {}, best, target, budget.get("seconds"), str(clock), note)


def _open(url: str, key: str) -> BaseStorage:
    """The storage at ``url`` (named by ``key``), created nowhere: a SQLite or journal file must exist, and
    SQLite is opened read-only."""
    path = storage_file(url)
    if path is not None and not path.is_file():
        raise ConfigError(
            key, shown(url), "an existing SQLite or journal file of a search (a report creates no storage)"
        )
    if path is None or not url.startswith("sqlite:///"):
        return open_storage(url)
    ro = f"sqlite:///file:{urllib.parse.quote(str(path.resolve()))}?mode=ro&uri=true"
    try:  # not open_storage: it makes the file's folder, and Optuna writes its tables into any SQLite file
        return RDBStorage(ro, engine_kwargs={"connect_args": {"timeout": 60}})
    except Exception as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:240]
        raise Failure(f"opening the study storage {shown(url)} (read-only)", f"{type(e).__name__}: {first}") from None


def _row(t: FrozenTrial, schedule: str, fixed_batch: int | None) -> TrialRow:
    r = TrialRecord.read(t)
    state = {
        TrialState.COMPLETE: "complete",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "waiting",
    }[t.state]
    point = params_of(t, schedule, fixed_batch) if "stages" in t.params and "microbatch_size" in t.params else None
    reason = r.fail_reason
    if r.infeasible:  # a sampler's proposal outside the device budget, answered without training
        state, reason = "infeasible", "outside the device budget (unrun)"
    elif state == "pruned":
        where = r.pruned_clock
        reason = f"pruned at step {r.pruned_step}" + (f" ({where:.3g}s)" if isinstance(where, float) else "")
        if r.capped_at is not None:  # tune/capping.py: it could not rank
            reason = f"capped at step {r.pruned_step}, past {r.capped_at:.3g}s"
    return TrialRow(
        schedule=schedule,
        number=t.number,
        state=state,
        point=point,
        score=t.value,
        time_to_target=r.time_to_target,
        best_val_loss=r.best_val_loss,
        curve=[(float(c), float(v)) for c, v in r.curve or []],
        reason=reason,
        confirmation_of=r.confirm_of,
        seed=r.seed,
        attrs=dict(r.attrs),
        transfer_of=r.transfer_of,
    )


def _trial_number(ref: Any) -> int | None:
    """``NAME.paci#12`` -> 12."""
    if isinstance(ref, str) and "#" in ref:
        return int(ref.rsplit("#", 1)[1])
    return None
