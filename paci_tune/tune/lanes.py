"""Side by side: one search worker runs up to ``search.jobs`` trials at once (:func:`.setup.side_by_side`).

A study's sampler and pruner read that study's own finished trials, so each study's search trials
run one after another, as with one job: a search seed proposes the same trials whatever the jobs.
What runs beside a study's search trial is another study's (each schedule has its own) or a queued
extra run (a confirmation seed, a transfer check: fixed points, whose order changes nothing). A
study's confirmations start as soon as its own search is over, beside the other studies' searches.

The trials run in threads of this process, each training in its own child process (:mod:`.runner`),
and split the cores among the trials started together (OpenMP threads past the cores spin). On any
exception in the worker (Ctrl-C, a crash beside) the running trials' children are killed and the
trials are left running in the storage, as a lone interrupted trial is, for a resume to retry. With
one job nothing is threaded: a trial runs in the caller's thread. May import: :mod:`paci_tune.base`
and the tune layer's :mod:`.runner`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from types import TracebackType

from ..base.processes import threads_per_process
from .runner import TrialCancelled


class Lanes:
    """Up to ``jobs`` trials at once; ``busy``: the schedules whose search trial runs here now."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self.cancel = threading.Event()  # set on the way out of an exception: every running trial stops
        self._pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="trial") if self.jobs > 1 else None
        self._running: dict[Future[None], tuple[str, bool]] = {}
        self._shares: dict[int, int] = {}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free(self) -> int:
        return self.jobs - len(self._running)

    @property
    def busy(self) -> set[str]:
        return {schedule for schedule, searching in self._running.values() if searching}

    def start(self, schedule: str, searching: bool, trial_id: int, share: int, run: Callable[[], None]) -> None:
        """Run ``run`` (one trial) beside the running ones; ``share``: the trials that split the cores
        with it. With one job it runs here and now."""
        self._shares[trial_id] = share
        if self._pool is None:
            run()
            return
        self._running[self._pool.submit(run)] = (schedule, searching)

    def threads(self, trial_id: int, elsewhere: int = 0) -> int | None:
        """CPU threads for a trial: the cores split among its share and ``elsewhere`` other processes'
        trials on this machine; None (torch's default) for a trial alone."""
        n = self._shares.get(trial_id, 1) + elsewhere
        return None if n == 1 else threads_per_process(n)

    def wait_one(self, timeout: float) -> None:
        """Until a trial ends or ``timeout`` passes; a trial's exception is raised here."""
        done, _ = wait(self._running, timeout=timeout, return_when=FIRST_COMPLETED)
        for f in done:
            del self._running[f]
            f.result()

    def __enter__(self) -> Lanes:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Wait for every running trial; on an exception, stop them first (each runner kills its child
        at its next poll and raises :class:`TrialCancelled`). A trial's own error raises here."""
        if self._pool is None:
            return
        if exc is not None:
            self.cancel.set()
        failed: BaseException | None = None
        for f in list(self._running):
            try:
                f.result()
            except TrialCancelled:
                pass
            except Exception as e:  # a trial's thread broke: stop the others too
                self.cancel.set()
                failed = failed or e
        self._running.clear()
        self._pool.shutdown(wait=True)
        if exc is None and failed is not None:
            raise failed
