"""What a search stores on Optuna's trials and studies: the one module that reads or writes user attributes.

Every key is spelled here once. Writers are small values written whole (:class:`Claim`,
:class:`PointAttrs`, :class:`Outcome`, the endings :func:`mark_pruned` / :func:`mark_failed` /
:func:`mark_refused`, the queued runs' :class:`Extra` and :class:`Retry`); the reader is
:meth:`TrialRecord.read`, every attribute of a finished or running trial at once (None where absent),
and :meth:`StudyRecord.read` for a study's. The stored format is unchanged from the bare-key code
it replaced, so old studies load. May import: optuna.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

# ------------------------------------------------------------------------------------ keys
CONFIRM = "confirm"  # on a confirmation trial: {"of": the search trial's number, "seed": training.seed}
TRANSFER = "transfer"  # on a transfer-check trial: {"of": the search trial, "factor": f}
RETRY_OF, ATTEMPT = "retry_of", "attempt"  # a failed trial queued again: its number; how many times so far
REPEAT_OF = "repeat_of"  # answered from an earlier trial of the same point (its number)
RERUN_OF = "rerun_of"  # a pruned point trained again because it now survives the pruner
NUMERICS = "numerics"  # on a trained trial others may share: {"key", "every", "curve": [[step, val_loss], ...]}
SHARED_FROM = "shared_from"  # answered from other trials' curve of its numerics (:mod:`.sharing`): {"study", "trial"}
PLAN_CLASS = "plan_class"  # queued by the planner (:mod:`.planner`): the numerics class it trains
PREDICTED = "predicted_time"  # and its predicted and optimistic times to target when it was chosen
SIBLING_OF = "sibling_of"  # queued as another layout of a search trial's curve (:mod:`.siblings`): its number
WORKER, HEARTBEAT = "worker", "heartbeat"  # who runs it (:class:`Claim`, a dict); its last sign of life
REAPED = "interrupted: its worker died"  # the fail_reason of a trial another worker found dead
LABEL, DATA_PARALLEL, DEVICES, BACKWARD_WEIGHTS = "label", "data_parallel", "devices", "backward_weights"
OPTIMIZER, STALENESS = "optimizer", "staleness"  # a recipe the space fixes (one choice: no parameter)
TIME_TO_TARGET, BEST_VAL_LOSS, CLOCK_USED = "time_to_target", "best_val_loss", "clock_used"
WALL_SECONDS, CURVE = "wall_seconds", "curve"
PRUNED_STEP, PRUNED_CLOCK = "pruned_step", "pruned_clock"
CAPPED_AT = "capped_at"  # pruned by adaptive capping (:mod:`.capping`): the clock it could not rank past
FAIL_REASON, INFEASIBLE = "fail_reason", "infeasible"
SUMMARY_KEYS = (
    "clock_tokens_per_s",
    "clock_step_time_s",
    "clock_bubble_fraction",
    "tokens_per_s",
    "bubble_fraction",
    "max_drift",
    "peak_memory_bytes",
    "memory_measured_per",
    "partition",
    "steps",
)
"""Summary figures kept on each trial from its run's summary; the ``clock_`` ones are on the objective's clock."""
MEASURED_KEYS = ("measured_peak_memory_bytes", "stage_drift", "predicted_peak_memory_bytes")
"""Per-stage figures kept beside them (measured and predicted peak memory, drift)."""
EXTRA_KEYS = (CONFIRM, TRANSFER)
"""The attributes that make a trial an extra run of a point the search already ran, not a search trial."""
NOT_COPIED = (WORKER, HEARTBEAT, LABEL, RETRY_OF, ATTEMPT, REPEAT_OF, SIBLING_OF)
"""What a repeat does not copy from the earlier trial that answers it."""

FINGERPRINT, SCHEDULE = "fingerprint", "schedule"  # on a study: what the search was run with; its schedule
CONFIRM_PLAN = "confirm_plan"  # on a study: the numbers of the search trials being confirmed, in rank order
TRANSFER_PLAN = "transfer_plan"  # on a study: the search trials whose points are trained longer, in rank order
WARM_START = "warm_start"  # on a study: {"folder", "checkpoint"} of the search's warm-up (tune/warm.py)

AnyTrial = optuna.Trial | FrozenTrial


# ------------------------------------------------------------------------------------ writers
@dataclass(frozen=True)
class Extra:
    """A queued extra run of a search trial's point: a confirmation (``seed``) or a transfer check (``factor``)."""

    of: int
    seed: int | None = None
    factor: float | None = None

    @property
    def key(self) -> str:
        return CONFIRM if self.seed is not None else TRANSFER

    def attrs(self) -> dict[str, Any]:
        value = {"of": self.of, "seed": self.seed} if self.seed is not None else {"of": self.of, "factor": self.factor}
        return {self.key: value}

    def enqueue(self, study: optuna.Study, params: dict[str, Any]) -> None:
        study.enqueue_trial(params, user_attrs=self.attrs())


@dataclass(frozen=True)
class Retry:
    """A failed trial queued again with its parameters (an extra run stays one: ``kept``, the raw attributes)."""

    of: int
    attempt: int
    kept: dict[str, Any] = field(default_factory=dict)

    def enqueue(self, study: optuna.Study, params: dict[str, Any]) -> None:
        study.enqueue_trial(params, user_attrs={RETRY_OF: self.of, ATTEMPT: self.attempt, **self.kept})


@dataclass(frozen=True)
class Claim:
    """The worker running a trial, and when it last said so (:mod:`.liveness` judges whether it lives).

    ``host`` and ``pid`` alone were all old claims held, and they cannot tell a pid reused after a reboot or
    a restart from the claimant: ``boot`` (the kernel's boot id), ``pidns`` (the pid namespace) and ``start``
    (the process's start time, clock ticks after boot) can, and ``worker`` (random, one per process) names
    the claimant for sure. Each is None where unreadable (no ``/proc``) and is then not written.
    """

    host: str
    pid: int
    heartbeat: float
    boot: str | None = None
    start: int | None = None
    pidns: str | None = None
    worker: str | None = None

    def identity(self) -> dict[str, Any]:
        """The stored ``worker`` attribute: the fields known (an old claim: only host and pid)."""
        extra = {"boot": self.boot, "start": self.start, "pidns": self.pidns, "id": self.worker}
        return {"host": self.host, "pid": self.pid, **{k: v for k, v in extra.items() if v is not None}}

    def write(self, trial: optuna.Trial) -> None:
        trial.set_user_attr(WORKER, self.identity())
        trial.set_user_attr(HEARTBEAT, self.heartbeat)

    @classmethod
    def read(cls, worker: Any, heartbeat: Any) -> Claim | None:
        """A stored claim (None for an unclaimed trial); fields an old claim lacks are None."""
        if not isinstance(worker, dict):
            return None
        start = worker.get("start")
        return cls(
            str(worker.get("host", "")),
            int(worker.get("pid", -1)),
            float(heartbeat) if heartbeat is not None else float("nan"),
            worker.get("boot"),
            None if start is None else int(start),
            worker.get("pidns"),
            worker.get("id"),
        )

    @staticmethod
    def beat(storage: optuna.storages.BaseStorage, trial_id: int, now: float | None = None) -> None:
        """Refresh a running trial's heartbeat through the storage (from the worker's heartbeat thread); a
        finished trial raises :class:`optuna.exceptions.UpdateFinishedTrialError`."""
        storage.set_trial_user_attr(trial_id, HEARTBEAT, time.time() if now is None else now)


def fail_interrupted(storage: optuna.storages.BaseStorage, trial_id: int, reason: str) -> None:
    """Record why a running trial whose worker died is being failed (before its state is set)."""
    storage.set_trial_user_attr(trial_id, FAIL_REASON, reason)


@dataclass(frozen=True)
class PointAttrs:
    """What a trial's parameters do not say: its label, D, its devices and (PACI, fixed by the space) its weights."""

    label: str
    data_parallel: int
    devices: int
    backward_weights: str | None = None  # written only when set
    optimizer: str | None = None  # the optimizer recipe (:mod:`.recipes`), written only when set
    staleness: str | None = None  # PACI's staleness recipe, written only when set

    def write(self, trial: optuna.Trial) -> None:
        trial.set_user_attr(LABEL, self.label)
        trial.set_user_attr(DATA_PARALLEL, self.data_parallel)
        trial.set_user_attr(DEVICES, self.devices)
        for key, value in (
            (BACKWARD_WEIGHTS, self.backward_weights),
            (OPTIMIZER, self.optimizer),
            (STALENESS, self.staleness),
        ):
            if value is not None:
                trial.set_user_attr(key, value)


@dataclass(frozen=True)
class Outcome:
    """What a trained trial measured (every field written, None included); ``measured``: the run summary's
    figures (:data:`SUMMARY_KEYS`, :data:`MEASURED_KEYS`), None when the run left no summary."""

    time_to_target: float | None
    best_val_loss: float | None
    clock_used: float
    wall_seconds: float
    curve: list[list[float]]
    measured: dict[str, Any] | None = None

    def write(self, trial: optuna.Trial) -> None:
        attrs: dict[str, Any] = {
            TIME_TO_TARGET: self.time_to_target,
            BEST_VAL_LOSS: self.best_val_loss,
            CLOCK_USED: self.clock_used,
            WALL_SECONDS: self.wall_seconds,
            CURVE: self.curve,
        }
        if self.measured is not None:
            attrs.update({k: self.measured.get(k) for k in (*SUMMARY_KEYS, *MEASURED_KEYS)})
        for k, v in attrs.items():
            trial.set_user_attr(k, v)


def mark_pruned(trial: optuna.Trial, step: int | None, clock: Any, capped_at: float | None = None) -> None:
    trial.set_user_attr(PRUNED_STEP, step)
    trial.set_user_attr(PRUNED_CLOCK, clock)
    if capped_at is not None:
        trial.set_user_attr(CAPPED_AT, capped_at)


def mark_failed(trial: optuna.Trial, reason: str | None) -> None:
    trial.set_user_attr(FAIL_REASON, reason)


def mark_refused(trial: optuna.Trial, why: str) -> None:
    """A proposal outside the device budget, answered unrun."""
    trial.set_user_attr(INFEASIBLE, True)
    trial.set_user_attr(FAIL_REASON, f"rejected: {why}")


def mark_rerun(trial: optuna.Trial, of: int) -> None:
    trial.set_user_attr(RERUN_OF, of)


def write_numerics(trial: optuna.Trial, key: str, every: int, curve: list[tuple[int, float]]) -> None:
    """The validations a trained trial scored, by step, under its numerics key: a curve later trials share."""
    trial.set_user_attr(NUMERICS, {"key": key, "every": every, "curve": [[s, v] for s, v in curve]})


def mark_shared(trial: optuna.Trial, study_name: str, number: int) -> None:
    """Answered from the curve of another trial with the same numerics (the first that trained it)."""
    trial.set_user_attr(SHARED_FROM, {"study": study_name, "trial": number})


def copy_result(earlier: FrozenTrial, trial: optuna.Trial) -> None:
    """A repeat of a finished point: everything the earlier trial measured, and which trial it was."""
    trial.set_user_attr(REPEAT_OF, earlier.number)
    for k, v in earlier.user_attrs.items():
        if k not in NOT_COPIED:
            trial.set_user_attr(k, v)


def copy_failure(earlier: FrozenTrial, trial: optuna.Trial, reason: str) -> None:
    trial.set_user_attr(REPEAT_OF, earlier.number)
    trial.set_user_attr(FAIL_REASON, reason)


def copy_pruned(earlier: FrozenTrial, trial: optuna.Trial, step: int) -> None:
    """A repeat of a pruned point that the pruner stops again at ``step``."""
    a = earlier.user_attrs
    trial.set_user_attr(REPEAT_OF, earlier.number)
    trial.set_user_attr(PRUNED_STEP, step)
    trial.set_user_attr(PRUNED_CLOCK, a.get(PRUNED_CLOCK))
    trial.set_user_attr(BEST_VAL_LOSS, a.get(BEST_VAL_LOSS))
    trial.set_user_attr(CURVE, a.get(CURVE))
    if a.get(CAPPED_AT) is not None:
        trial.set_user_attr(CAPPED_AT, a[CAPPED_AT])


# ------------------------------------------------------------------------------------ readers
@dataclass(frozen=True)
class TrialRecord:
    """Every user attribute of one trial, typed (None where the trial does not have it)."""

    confirm_of: int | None
    seed: int | None
    transfer_of: int | None
    factor: float | None
    retry_of: int | None
    attempt: int
    repeat_of: int | None
    worker: dict[str, Any] | None
    heartbeat: float | None
    label: str | None
    data_parallel: int | None
    backward_weights: str | None
    optimizer: str | None
    staleness: str | None
    time_to_target: float | None
    best_val_loss: float | None
    wall_seconds: float | None
    curve: list[Any] | None
    pruned_step: int | None
    pruned_clock: float | None
    capped_at: float | None
    fail_reason: str | None
    infeasible: bool
    numerics: dict[str, Any] | None
    shared_from: dict[str, Any] | None
    sibling_of: int | None
    plan_class: str | None
    attrs: dict[str, Any] = field(repr=False)  # the raw attributes (the report's per-trial figures)

    @classmethod
    def read(cls, t: AnyTrial) -> TrialRecord:
        a = t.user_attrs
        c, tr = a.get(CONFIRM), a.get(TRANSFER)
        return cls(
            confirm_of=None if c is None else int(c["of"]),
            seed=None if c is None else int(c["seed"]),
            transfer_of=None if tr is None else int(tr["of"]),
            factor=None if tr is None else float(tr.get("factor", 1.0)),
            retry_of=None if a.get(RETRY_OF) is None else int(a[RETRY_OF]),
            attempt=int(a.get(ATTEMPT, 0)),
            repeat_of=a.get(REPEAT_OF),
            worker=a.get(WORKER),
            heartbeat=a.get(HEARTBEAT),
            label=a.get(LABEL),
            data_parallel=a.get(DATA_PARALLEL),
            backward_weights=a.get(BACKWARD_WEIGHTS),
            optimizer=a.get(OPTIMIZER),
            staleness=a.get(STALENESS),
            time_to_target=a.get(TIME_TO_TARGET),
            best_val_loss=a.get(BEST_VAL_LOSS),
            wall_seconds=a.get(WALL_SECONDS),
            curve=a.get(CURVE),
            pruned_step=a.get(PRUNED_STEP),
            pruned_clock=a.get(PRUNED_CLOCK),
            capped_at=a.get(CAPPED_AT),
            fail_reason=a.get(FAIL_REASON),
            infeasible=bool(a.get(INFEASIBLE)),
            numerics=a.get(NUMERICS),
            shared_from=a.get(SHARED_FROM),
            sibling_of=a.get(SIBLING_OF),
            plan_class=a.get(PLAN_CLASS),
            attrs=a,
        )

    @property
    def claim(self) -> Claim | None:
        """Who claimed the trial (None: nobody yet, it died between being asked for and claimed)."""
        return Claim.read(self.worker, self.heartbeat)

    @property
    def is_confirmation(self) -> bool:
        return self.confirm_of is not None

    @property
    def is_transfer(self) -> bool:
        return self.transfer_of is not None

    @property
    def is_extra(self) -> bool:
        """Not a search trial: a confirmation or a transfer-check run of a point the search already ran."""
        return self.is_confirmation or self.is_transfer

    @property
    def is_repeat(self) -> bool:
        return self.repeat_of is not None

    def figure(self, key: str) -> Any:
        """One of the run's figures (:data:`SUMMARY_KEYS`, :data:`MEASURED_KEYS`, ``clock_used``); None if absent."""
        return self.attrs.get(key)

    def extra_attrs(self) -> dict[str, Any]:
        """The attributes that make it an extra run, as stored (a retry keeps them)."""
        return {k: self.attrs[k] for k in EXTRA_KEYS if k in self.attrs}


def is_extra(t: AnyTrial) -> bool:
    """Not a search trial (:attr:`TrialRecord.is_extra`), without reading the rest."""
    return any(k in t.user_attrs for k in EXTRA_KEYS)


def queue_sibling(study: optuna.Study, params: dict[str, Any], of: int) -> None:
    """Queue another layout of search trial ``of``'s curve in ``study`` (:mod:`.siblings`)."""
    study.enqueue_trial(params, user_attrs={SIBLING_OF: of})


def queue_planned(study: optuna.Study, params: dict[str, Any], key: str, times: list[float | None] | None) -> None:
    """Queue the planner's next point of numerics class ``key`` (:mod:`.planner`), with its predicted and
    optimistic times to target (None: a synchronous curve, trained without a prediction)."""
    attrs: dict[str, Any] = {PLAN_CLASS: key} | ({PREDICTED: times} if times is not None else {})
    study.enqueue_trial(params, user_attrs=attrs)


def is_sibling(t: AnyTrial) -> bool:
    """Queued as another layout of a search trial's curve (:func:`queue_sibling`)."""
    return SIBLING_OF in t.user_attrs


def is_confirmation(t: AnyTrial) -> bool:
    return CONFIRM in t.user_attrs


def is_transfer(t: AnyTrial) -> bool:
    return TRANSFER in t.user_attrs


@dataclass(frozen=True)
class StudyRecord:
    """A study's own attributes: the search's fingerprint, its schedule and the extra runs' plans."""

    fingerprint: dict[str, Any] | None
    schedule: str | None
    confirm_plan: list[int] | None
    transfer_plan: list[int] | None
    warm_start: dict[str, str] | None = None

    @classmethod
    def read(cls, study: optuna.Study) -> StudyRecord:
        a = study.user_attrs
        plans = [None if a.get(k) is None else [int(n) for n in a[k]] for k in (CONFIRM_PLAN, TRANSFER_PLAN)]
        return cls(a.get(FINGERPRINT), a.get(SCHEDULE), *plans, a.get(WARM_START))

    @staticmethod
    def write_warm_start(study: optuna.Study, where: dict[str, str]) -> None:
        """Record the warm-up's folder, so that a worker with another work folder uses the same one."""
        study.set_user_attr(WARM_START, where)

    @staticmethod
    def write_fingerprint(study: optuna.Study, fingerprint: dict[str, Any], schedule: str) -> None:
        study.set_user_attr(FINGERPRINT, fingerprint)
        study.set_user_attr(SCHEDULE, schedule)

    @staticmethod
    def write_plan(study: optuna.Study, key: str, numbers: list[int]) -> None:
        """Store a plan (``key``: :data:`CONFIRM_PLAN` or :data:`TRANSFER_PLAN`)."""
        assert key in (CONFIRM_PLAN, TRANSFER_PLAN), key
        study.set_user_attr(key, numbers)

    def plan(self, key: str) -> list[int] | None:
        return self.confirm_plan if key == CONFIRM_PLAN else self.transfer_plan


def keep_metrics(trial: optuna.Trial, metrics: Path, store: Path) -> None:
    """The trial's metrics file as an Optuna artifact in ``store`` (``WORKDIR/artifacts``), before the trial
    is told: ``optuna-dashboard --artifact-dir WORKDIR/artifacts`` then offers it beside the curve."""
    if not metrics.is_file():
        return
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    store.mkdir(parents=True, exist_ok=True)
    upload_artifact(
        artifact_store=FileSystemArtifactStore(str(store)),
        file_path=str(metrics),
        study_or_trial=trial,
        mimetype="application/jsonl",
    )
