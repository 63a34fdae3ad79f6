"""Whether a running trial's worker still lives: its claim, its heartbeat, and how a reaper judges both.

A worker claims each trial it runs (:func:`claim`, a :class:`.record.Claim`): its host, pid, the kernel's
boot id, its pid namespace, its start time (``/proc/PID/stat`` field 22) and a random worker id, and it
refreshes the trial's heartbeat every :data:`HEARTBEAT_S` from a thread (:class:`Heartbeat`). A database
error does not stop that thread: it retries, 0.5 s doubling up to the beat period, for as long as the
trial runs. When the heartbeat finds its trial finished by someone else (another worker reaped it), it
sets :attr:`Heartbeat.lost`: the runner kills the trial's process and the search goes on (:mod:`.search`).

A reaper (:func:`.study.reap_dead`) finds a trial dead (:func:`is_dead`):

- fast, on the claimant's own machine -- same host name, same boot id, same pid namespace, so its pid
  means the same process here: another worker's claim with this process's pid (a restart that got the
  same pid), a pid that is gone, or a live pid whose start time differs (reused) is dead. A claim from
  another boot or namespace (a reboot, a restarted container, a machine with the same name) is not judged
  by its pid at all. An old claim (host and pid only) of this host whose pid is gone is dead, as before;
- everywhere, as the backstop (also for a live, matching pid whose heartbeat stopped): a stale heartbeat.

Clock skew: heartbeats are the claimant's wall clock. A reaper judges one by whether it CHANGED within
``grace`` seconds of its own monotonic clock (:class:`Watch`), so once it has watched a trial any skew is
tolerated. A reaper that has seen a heartbeat only at one value also finds it stale when its wall-clock
age passes ``grace + MAX_SKEW_S`` (``grace`` alone on the claimant's own machine, one clock): the bound is
that hosts' clocks differ by less than :data:`MAX_SKEW_S` (60 s). May import: optuna, :mod:`.record`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from .record import REAPED, Claim, TrialRecord

HEARTBEAT_S = 5.0  # a worker refreshes its trials' heartbeats this often
BACKOFF_S = 0.5  # after a failed beat, the next try comes this soon, doubling up to HEARTBEAT_S
MAX_SKEW_S = 60.0  # hosts' clocks differ by less: a heartbeat seen at one value is stale past grace + this
HOST = socket.gethostname()

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ identity
def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks after boot (``/proc/PID/stat`` field 22); None if unreadable.
    With the pid it names one process for the whole boot: a reused pid has another start time."""
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[19]) if stat else None  # fields after the name start at 3
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


_IDENTITY: dict[int, tuple[str | None, int | None, str | None, str]] = {}  # by pid: a forked child is another


def identity(now: float | None = None) -> Claim:
    """This worker process as a claim (heartbeat ``now``): read once per process, its worker id drawn then."""
    pid = os.getpid()
    if pid not in _IDENTITY:
        boot = _read("/proc/sys/kernel/random/boot_id")
        _IDENTITY[pid] = (boot, start_time(pid), _pid_namespace(), uuid.uuid4().hex)
    boot, start, ns, worker = _IDENTITY[pid]
    return Claim(HOST, pid, time.time() if now is None else now, boot, start, ns, worker)


def claim(trial: optuna.Trial) -> None:
    """Mark a trial as this worker's, so others can tell when it died with it."""
    identity().write(trial)


# ------------------------------------------------------------------------------------ heartbeat
class Heartbeat:
    """Refreshes a running trial's heartbeat from a thread while this worker runs it.

    A failed write (the database unreachable, locked, restarting) is retried sooner, :data:`BACKOFF_S`
    doubling up to the beat period, and never ends the thread: a heartbeat that stopped while its trial
    ran would let another worker reap it and train it twice. A trial found finished (reaped elsewhere) ends
    it, with :attr:`lost` set (the runner then kills the trial's run: :class:`.runner.TrialReaped`).

    The block runs the trial. Left on an error because the trial was reaped (any write to it fails then),
    the error is swallowed and :attr:`reaped` set: the trial is not this worker's any more, and the worker
    goes on. Likewise, with :attr:`taken` set, a write refused because another worker finished the trial:
    on SQLite Optuna can hand one queued trial to two workers at once (it pops it without a lock there).
    Any other error, or Ctrl-C, passes.
    """

    def __init__(self, storage: optuna.storages.BaseStorage, trial_id: int, period: float | None = None) -> None:
        self.storage, self.trial_id = storage, trial_id
        self.period = HEARTBEAT_S if period is None else period
        self.lost = threading.Event()  # set: the trial was finished by someone else while this worker ran it
        self.reaped = False  # the block ended because another worker reaped the trial
        self.taken = False  # the block ended because another worker ran the trial too and finished it first
        self.beats = self.failures = 0  # beats written; failed tries (for the tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-{trial_id}")

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self._stop.set()
        self._thread.join()
        self.reaped = isinstance(exc, Exception) and was_reaped(self.storage, self.trial_id)
        self.taken = not self.reaped and isinstance(exc, UpdateFinishedTrialError)
        return self.reaped or self.taken

    def _beat(self) -> None:
        wait, failing = self.period, 0
        while not self._stop.wait(wait):
            try:
                Claim.beat(self.storage, self.trial_id)
            except UpdateFinishedTrialError:
                self.lost.set()
                return
            except Exception as e:
                failing += 1
                self.failures += 1
                if failing == 1:  # once per outage, not once per try
                    _log.debug("heartbeat of trial id %s failed, retrying: %s", self.trial_id, type(e).__name__)
                wait = min(self.period, BACKOFF_S * 2 ** (failing - 1))
                continue
            self.beats += 1
            wait, failing = self.period, 0


def workers_here(studies: Iterable[optuna.Study]) -> int:
    """Other worker processes of this machine running trials of ``studies`` now (by their claims): they
    share its cores with this one's trials (:meth:`.search.Search._threads`)."""
    pids: set[int] = set()
    for study in studies:
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            w = TrialRecord.read(t).worker
            if isinstance(w, dict) and w.get("host") == HOST:
                pids.add(int(w.get("pid", -1)))
    return len(pids - {os.getpid()})


def was_reaped(storage: optuna.storages.BaseStorage, trial_id: int) -> bool:
    """The trial was failed by another worker that judged its worker dead (:func:`.study.reap_dead`); False
    where the storage cannot say."""
    try:
        t = storage.get_trial(trial_id)
    except Exception:
        return False
    return t.state == TrialState.FAIL and TrialRecord.read(t).fail_reason == REAPED


def reaped_line(number: int) -> str:
    """What the owner of a reaped trial says when it finds out."""
    return f"trial {number} was reaped by another worker (its heartbeat was judged stale); this worker goes on"


def taken_line(number: int) -> str:
    """What a worker says when another one ran the same queued trial and finished it first."""
    return f"trial {number} was also taken from the queue by another worker, which finished it; this worker goes on"


# ------------------------------------------------------------------------------------ judging
class Watch:
    """A reaper's memory of the heartbeats it has seen: per trial, the last value and since when (on its own
    monotonic clock), so another host's heartbeat is judged by whether it changes, whatever that host's clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[int, tuple[float, float, bool]] = {}  # trial id -> (value, seen since, came as a change)

    def stale(self, trial_id: int, beat: float, now: float, grace: float, skew: float) -> bool:
        """No sign of life for ``grace``: the heartbeat unchanged for ``grace`` of watching, or, seen at one
        value only, older than ``grace + skew`` on the wall clock (``now``)."""
        mono = self.clock()
        seen = self._seen.get(trial_id)
        if seen is None or seen[0] != beat:
            self._seen[trial_id] = seen = (beat, mono, seen is not None)
        _, since, changed = seen
        if mono - since >= grace:
            return True
        return not changed and now - beat > grace + skew

    def forget(self, trial_id: int) -> None:
        self._seen.pop(trial_id, None)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    return False


def _gone(c: Claim, me: Claim, host: str) -> tuple[bool, bool]:
    """The fast path: (dead for sure, on this machine). Only a claim of this very kernel and pid namespace is
    judged by its pid; an old claim (no boot id) only by a pid that is gone."""
    if c.host != host:
        return False, False
    if c.boot is None:
        return c.pid > 0 and c.pid != me.pid and _pid_gone(c.pid), False
    if me.boot is None or c.boot != me.boot or me.pidns is None or c.pidns != me.pidns:
        return False, False
    if c.worker == me.worker:
        return False, True  # this process's own: alive while its heartbeat is (the backstop)
    if c.pid == me.pid or _pid_gone(c.pid):
        return True, True  # our pid is not the claimant: a process before us had it
    start = start_time(c.pid)
    return start is not None and c.start is not None and start != c.start, True


def is_dead(t: FrozenTrial, now: float, grace: float, watch: Watch, host: str = HOST) -> bool:
    """A running trial whose worker died (module docstring); ``host``: this machine's name."""
    c = TrialRecord.read(t).claim
    if c is None:  # claimed right after ask: an unclaimed running trial died in between
        if t.datetime_start is None:
            return False
        return watch.stale(t._trial_id, t.datetime_start.timestamp(), now, grace, MAX_SKEW_S)
    dead, here = _gone(c, identity(), host)
    if dead:
        return True
    beat = c.heartbeat
    if math.isnan(beat):  # claimed, its heartbeat not yet written: it died in between
        beat = t.datetime_start.timestamp() if t.datetime_start is not None else now
    return watch.stale(t._trial_id, beat, now, grace, 0.0 if here else MAX_SKEW_S)
