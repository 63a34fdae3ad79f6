"""What a report shows, read once: ``best.yaml`` (when there is one) and the study pair behind it.

A search leaves two things: the recommendation (``best.yaml``, with the verdict, the confirmation
and the provenance naming its storage and study) and the Optuna studies ``NAME.<schedule>`` (``paci``,
``1f1b`` and any other synchronous baseline the space named) holding every trial. The report reads
both and nothing else, so it can be made on any machine that reaches the storage, long after the
search, and it shows the same numbers the recommendation was made from.

best.yaml keeps its storage's URL without a password: the report opens it with the password of
``PACI_TUNE_STORAGE`` when that names the same storage (else libpq's ``PGPASSWORD`` or ``~/.pgpass``
supply it), and shows it with the password hidden. May import: optuna, :mod:`paci_tune.verdict`,
:mod:`paci_tune.tune`, :mod:`paci_tune.schedule`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..base.credentials import STORAGE_ENV, same_storage, shown
from ..errors import ConfigError
from ..schedule import FLUSH, NAMES
from ..tune.bestfile import BestFile, read_best
from ..tune.point import TrialParams
from ..tune.record import StudyRecord, TrialRecord
from ..tune.study import open_storage
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
        return {s: trial_counts(st) for s, st in self.studies.items()}

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

    A best.yaml names its storage and study; ``storage`` / ``study_name`` given as well override
    them (the search ran elsewhere, its database moved). Without best.yaml the report shows the
    studies as they stand, and says there is no recommendation yet. Without ``storage``, the URL in
    ``PACI_TUNE_STORAGE`` is used when best.yaml names the same storage (it keeps no password) or
    when there is no best.yaml.
    """
    best = read_best(best_path, trainable=False) if best_path is not None else None
    prov = (best.provenance if best is not None else None) or {}
    storage = storage or _with_password(prov.get("storage"))
    name = study_name or prov.get("study_name")
    if not storage or not name:
        raise ConfigError(
            "report", "no study", "a best.yaml written by `paci-tune search`, or --storage URL and --study-name NAME"
        )
    store = open_storage(storage)
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


def _with_password(kept: str | None) -> str | None:
    """best.yaml's storage URL (kept without a password), or PACI_TUNE_STORAGE's when it names the same
    storage; with no best.yaml, PACI_TUNE_STORAGE's."""
    env = os.environ.get(STORAGE_ENV)
    if env and (kept is None or same_storage(env, kept)):
        return env
    return kept


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
