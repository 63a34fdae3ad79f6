"""Optuna plumbing: storage URLs, samplers, pruners, one study per schedule, dead-worker recovery.

One search is one Optuna study per schedule of its space in one storage, ``NAME.paci``,
``NAME.1f1b`` (and ``NAME.zb-h1``, ``NAME.interleaved`` where the space names them): each schedule
gets its own sampler model and the same number of trials, so every synchronous baseline is tuned
as hard as PACI. Any number of workers (``paci-tune search`` processes, on any machines that
reach the storage) can run the same search; each takes the next trial of whichever schedule is
furthest from its quota.

Dead workers: a running trial carries who claimed it (host, pid, boot id, start time, a worker id)
and a heartbeat the worker refreshes every few seconds; :mod:`.liveness` judges whether that worker
lives (its pid on its own machine, its heartbeat everywhere, tolerating hosts' clocks that differ by
less than :data:`.liveness.MAX_SKEW_S`). A trial whose worker died is failed as ``interrupted`` and
enqueued again with the same parameters, up to ``search.retries`` times (:func:`reap_dead`). This
works the same on SQLite, a journal file and a database server (Optuna's own heartbeat covers only
RDB storages).

A storage URL may carry a password: it is remembered when the storage opens and never shown
(:mod:`paci_tune.base.credentials`). May import: optuna, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors`, :mod:`.space`, :mod:`.record`, :mod:`.liveness`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from ..base.credentials import remember, scrub, shown
from ..config.tune import SearchConfig
from ..errors import ConfigError, Failure
from .liveness import HOST, Watch, is_dead
from .record import REAPED, Retry, StudyRecord, TrialRecord, fail_interrupted
from .space import SearchSpace

GRACE_S = SearchConfig.heartbeat_grace  # a heartbeat silent this long means its worker died (:mod:`.liveness`)


def open_storage(url: str) -> BaseStorage:
    """An Optuna storage from a URL: ``sqlite:///f.db``, ``postgresql://...``, ``mysql://...``, or
    a journal file (``journal:///path/f.log`` or any path ending in ``.log``/``.journal``)."""
    remember(url)
    if url.startswith("journal://"):
        return _journal(url[len("journal://") :])
    if "://" not in url:
        if url.endswith((".log", ".journal")):
            return _journal(url)
        raise ConfigError(
            "--storage", shown(url), "an Optuna storage URL (sqlite:///f.db, postgresql://..., journal:///f.log)"
        )
    # A database server's pooled connection may have been cut (a restart, an idle timeout): checked before
    # use, and replaced (Optuna does so for MySQL only). A query during the outage itself: :mod:`.outage`.
    engine: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        # Several local workers share one file: wait for the write lock rather than fail.
        engine = {"connect_args": {"timeout": 60}}
    url = _with_driver(url)
    for attempt in range(_CREATE_TRIES):
        try:
            return RDBStorage(url, engine_kwargs=engine)
        except (ImportError, ModuleNotFoundError) as e:
            raise ConfigError("--storage", shown(url), f"a URL whose database driver is installed ({e})") from None
        except Exception as e:
            # Workers starting together on an empty database race to create Optuna's tables: the loser
            # sees a duplicate of what the winner made, and finds the tables in place when it tries again.
            # SQLite's file lock does not cover it (two workers on a fresh file: 7 of 15 starts failed).
            if attempt + 1 < _CREATE_TRIES and _creation_race(e):
                time.sleep(0.5 * (attempt + 1))
                continue
            raise Failure(f"opening the study storage {shown(url)}", f"{type(e).__name__}: {_first_line(e)}") from None
    raise AssertionError("unreachable")


_CREATE_TRIES = 6


def storage_file(url: str) -> Path | None:
    """The file a SQLite or journal storage URL names (None for a database server)."""
    for prefix in ("sqlite:///", "journal://"):
        if url.startswith(prefix):
            return Path(url[len(prefix) :])
    return Path(url) if "://" not in url else None


def _with_driver(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; with only psycopg 3 (``paci-tune[postgres]``) use that."""
    import importlib.util

    if (
        url.startswith("postgresql://")
        and importlib.util.find_spec("psycopg2") is None
        and (importlib.util.find_spec("psycopg") is not None)
    ):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def _first_line(e: BaseException) -> str:
    """The first line of a storage error, without the password a driver's message may quote."""
    return scrub(next((ln.strip() for ln in str(e).splitlines() if ln.strip()), ""))[:240]


def _creation_race(e: BaseException) -> bool:
    text = str(e).lower()
    return type(e).__name__ in ("IntegrityError", "ProgrammingError", "OperationalError") and (
        "already exists" in text or "duplicate key" in text or "unique" in text
    )


def _journal(path: str) -> JournalStorage:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(path))


def make_sampler(search: SearchConfig, space: SearchSpace, schedule_index: int) -> optuna.samplers.BaseSampler:
    seed = search.seed * 100 + schedule_index
    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        # The grid's points are enqueued when the study is created (see enqueue_grid): Optuna's
        # GridSampler stops a study from inside ``optimize`` only, which this ask/tell loop is not.
        space.grid_params()  # refuses a continuous dimension
        return optuna.samplers.RandomSampler(seed=seed)
    startup = search.startup_trials if search.startup_trials is not None else max(2, search.trials // 3)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, constant_liar=True)


def make_pruner(search: SearchConfig, grid: int) -> optuna.pruners.BasePruner:
    """Pruners on the clock grid: step k is the k-th of ``grid`` validations over the budget."""
    if search.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=grid, reduction_factor=3)
    if search.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if search.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    return optuna.pruners.NopPruner()


def open_studies(
    storage: BaseStorage,
    name: str,
    schedules: tuple[str, ...],
    search: SearchConfig,
    space: SearchSpace,
    grid: int,
    fingerprint: dict[str, Any],
) -> dict[str, optuna.Study]:
    """Create or load ``NAME.<schedule>`` for each schedule; refuse to mix a different search in."""
    studies = {}
    for i, schedule in enumerate(schedules):
        study = optuna.create_study(
            study_name=f"{name}.{schedule}",
            storage=storage,
            direction="minimize",
            load_if_exists=True,
            sampler=make_sampler(search, space, i),
            pruner=make_pruner(search, grid),
        )
        stored = StudyRecord.read(study).fingerprint
        if stored is None:
            StudyRecord.write_fingerprint(study, fingerprint, schedule)
        elif stored != fingerprint:
            diff = sorted(k for k in set(stored) | set(fingerprint) if stored.get(k) != fingerprint.get(k))
            raise ConfigError(
                "--study-name",
                name,
                f"a new name or storage: the stored study was run with a different {', '.join(diff)}",
            )
        studies[schedule] = study
    return studies


def enqueue_grid(study: optuna.Study, space: SearchSpace, schedule: str, seed: int) -> None:
    """Queue every point of ``schedule``'s grid, in a seeded random order (a grid search)."""
    import random

    points = space.grid(schedule)
    random.Random(seed).shuffle(points)
    for p in points:  # the grid sampler draws the recipes itself: its own grid names them
        params = {k: v for k, v in space.params_of(p).items() if k not in ("optimizer", "staleness")}
        study.enqueue_trial(params, skip_if_exists=True)


def counted(trials: list[FrozenTrial], quota: int) -> int:
    """Trials that use up the quota: running or finished ones.

    Not counted: queued ones (not started yet), failures that were enqueued again (their retry
    counts), confirmation and transfer-check runs (:attr:`.record.TrialRecord.is_extra`), the other layouts
    of a trained curve (``sibling_of``, :mod:`.siblings`: the simulator's cost, not a trial's), and repeats of a
    point already run (answered from the earlier trial, no compute spent) -- samplers propose repeats
    often in small discrete spaces, and counting them would leave most of the quota unexplored.
    Repeats beyond twice the quota do count, so a search of an exhausted space still ends. So do
    proposals outside the device budget's feasible points (``infeasible``: answered unrun, no
    compute spent), beyond twice the quota.
    """
    records = [(t, TrialRecord.read(t)) for t in trials]
    retried = {r.retry_of for _, r in records}
    fresh = repeats = 0
    for t, r in records:
        unstarted = t.state == TrialState.WAITING or (t.state == TrialState.FAIL and t.number in retried)
        if unstarted or r.is_extra or r.sibling_of is not None:
            continue
        if r.is_repeat or r.infeasible:
            repeats += 1
        else:
            fresh += 1
    return fresh + max(0, repeats - 2 * quota)


def exhausted(trials: list[FrozenTrial], points: list[dict[str, Any]]) -> bool:
    """Every point (as its Optuna parameters) has a finished search trial: the sampler has nothing new to
    propose, and its repeats would only run on until they count (:func:`counted`)."""
    done = {
        tuple(sorted(t.params.items()))
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and not TrialRecord.read(t).is_extra
    }
    return bool(points) and all(tuple(sorted(p.items())) in done for p in points)


def retry_waiting(study: optuna.Study) -> bool:
    """A dead worker's trial, enqueued again (:func:`reap_dead`), waits to be run: the search owes it a run
    whatever the quota says (workers that each stopped at the quota may together have passed it)."""
    trials = study.get_trials(deepcopy=False)
    records = {t.number: t for t in trials}
    return any(t.state == TrialState.WAITING and TrialRecord.read(t).retry_of in records for t in trials)


def running_elsewhere(trials: list[FrozenTrial]) -> int:
    return sum(1 for t in trials if t.state == TrialState.RUNNING)


def reap_dead(study: optuna.Study, retries: int, grace: float = GRACE_S, watch: Watch | None = None) -> list[int]:
    """Fail the running trials whose worker died and enqueue each again; the numbers failed.

    ``watch``: the reaper's memory of the heartbeats it saw (:class:`.liveness.Watch`), kept from one call
    to the next by a search so that another host's clock skew is tolerated; None judges by this look alone.
    """
    watch, now, failed = watch or Watch(), time.time(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if is_dead(t, now, grace, watch, HOST) and reap(study, t, retries):
            watch.forget(t._trial_id)
            failed.append(t.number)
    return failed


def reap(study: optuna.Study, t: FrozenTrial, retries: int) -> bool:
    """Fail a running trial as interrupted and enqueue it again (its ``attempt``-th retry, up to ``retries``);
    False when another worker reaped it first, or its owner finished it meanwhile. Its point is the one it
    drew, or, for a queued trial interrupted before drawing it, the one it was queued with (Optuna's
    ``fixed_params``); a sampled trial interrupted before drawing has none and is not run again."""
    storage = study._storage
    try:
        fail_interrupted(storage, t._trial_id, REAPED)
        if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False  # another worker reaped it first
    rec = TrialRecord.read(t)
    attempt = rec.attempt + 1
    params = t.params or t.system_attrs.get("fixed_params") or {}
    if attempt <= retries and params:
        Retry(t.number, attempt, rec.extra_attrs()).enqueue(study, params)  # an extra run stays one
    return True
