"""Trial runners: turn one configuration into a training run and watch it.

:class:`SubprocessRunner` is the real one: the trial's training in a child process
(:mod:`.child`; its own process group, tied to this process's life, through
:class:`paci_tune.base.processes.Child`), streaming its records through an events file. The
parent reads them as they come, reports each validation on the clock grid (``on_eval``), and
kills the child when the pruner says so, when the loss goes non-finite or blows up, when it
falls silent (a hang) or runs past its timeout, once it cannot rank (:mod:`.capping`), or once another
worker has reaped the trial (:class:`TrialReaped`, :mod:`.liveness`). Its exit
code and log tail classify a crash (out of memory, a configuration the machine refuses, anything
else). In a search the child is forked from a server that has done the imports once
(:func:`fork_server`, :mod:`paci_tune.base.zygote`): most of a short trial's start was imports. A child
that died with its server (killed, its own exit status unknown) is run again as a plain subprocess, never
told as a crash: the point would be lost.

A runner is pluggable (:class:`TrialRunner`): the benchmark replays recorded curves through the
same search loop with a table runner. May import: :mod:`paci_tune.base` and the tune layer's
:mod:`.objective`, :mod:`.capping` and :mod:`.space`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from ..base.files import write_yaml
from ..base.processes import Child, child_environment, follow
from ..base.zygote import Forked, Zygote
from .capping import capped
from .objective import Progress, grid_step
from .point import TrialParams

OnEval = Callable[[int, Progress], bool]  # (grid step, progress so far) -> prune now?
OnRecord = Callable[[dict[str, Any]], None]

FORKED = "paci_tune.tune.child:forked"  # what a trial's child runs when a fork server starts it
PRELOAD = "paci_tune.tune.child:preload"  # the fork server's one-time imports

DIVERGENCE_FACTOR = 2.0  # a train loss above this many times the first one is a divergence


@dataclass
class TrialJob:
    """Everything a runner needs: the point, the complete run document, where to write."""

    params: TrialParams
    run_doc: dict[str, Any]
    workdir: Path
    budget: float
    grid: int
    target: float
    threads: int | None = None  # CPU threads for the trial (None: torch's default, or the user's OMP_NUM_THREADS)
    timeout_factor: float = 1.0  # the runner's timeout is scaled by this (a transfer check's long run: its factor)
    scored_every: int | None = None  # a shared curve's step grid (:mod:`.sharing`): only validations on it score
    cancel: threading.Event | None = None  # set: the worker is stopping (:mod:`.lanes`); the run is killed, untold
    lost: threading.Event | None = None  # set: another worker reaped the trial (:mod:`.liveness`); killed, untold
    server: Zygote | None = None  # the search's fork server: the child forked with its imports done (:mod:`.child`)
    cap: float | None = None  # the clock past which it cannot rank (:mod:`.capping`): stopped there, pruned


class TrialCancelled(Exception):
    """A trial's run was killed because its worker is stopping (Ctrl-C, or a trial beside it crashed the
    worker): the trial is left running in the storage, as one interrupted alone is, for a resume to retry."""


class TrialReaped(Exception):
    """A trial's run was killed because another worker judged it dead and failed it (:mod:`.liveness`): the
    trial is not this worker's any more; nothing is written to it."""


def _check_still_ours(job: TrialJob) -> None:
    """Raise when the job's run must end untold: its worker is stopping, or another worker reaped its trial."""
    if job.cancel is not None and job.cancel.is_set():
        raise TrialCancelled(f"{job.params.label()}: its worker is stopping")
    if job.lost is not None and job.lost.is_set():
        raise TrialReaped(f"{job.params.label()}: reaped by another worker")


@dataclass
class TrialResult:
    status: Literal["complete", "pruned", "failed"]
    progress: Progress
    reason: str | None = None
    pruned_step: int | None = None
    summary: dict[str, Any] | None = None
    wall_seconds: float = 0.0
    evals: list[tuple[float, float]] = field(default_factory=list)
    by_step: list[tuple[int, float]] = field(default_factory=list)  # the scored validations: (step, val_loss)
    capped_at: float | None = None  # pruned by adaptive capping (:mod:`.capping`): the cap it passed


class TrialRunner(Protocol):
    def run(self, job: TrialJob, on_eval: OnEval, on_record: OnRecord | None = None) -> TrialResult: ...


class _Watch:
    """Folds a trial's records: the progress, the grid reports, the divergence check."""

    def __init__(self, job: TrialJob, on_eval: OnEval, on_record: OnRecord | None) -> None:
        self.job, self.on_eval, self.on_record = job, on_eval, on_record
        self.progress = Progress(job.target, job.budget)
        self.evals: list[tuple[float, float]] = []
        self.by_step: list[tuple[int, float]] = []
        self.first_loss: float | None = None
        self.trained = False  # a train record was seen
        self.summary: dict[str, Any] | None = None
        self.stop: tuple[Literal["pruned", "failed"], str, int | None] | None = None
        self.capped_at: float | None = None  # the cap it was stopped at (:mod:`.capping`)

    def feed(self, rec: dict[str, Any]) -> None:
        if self.on_record is not None:
            self.on_record(rec)
        kind = rec.get("event")
        if kind == "train":
            self.trained = True
            loss = float(rec["loss"])
            if not math.isfinite(loss):
                self.stop = ("failed", f"diverged: loss {loss} at step {rec.get('step')}", None)
            elif self.first_loss is None:
                self.first_loss = loss
            elif loss > DIVERGENCE_FACTOR * self.first_loss:
                self.stop = (
                    "failed",
                    f"diverged: loss {loss:.3g} at step {rec.get('step')} > {DIVERGENCE_FACTOR:g}x the first "
                    f"({self.first_loss:.3g})",
                    None,
                )
        elif kind == "eval":
            every = self.job.scored_every
            if every is not None and (int(rec["step"]) % every or (rec.get("drained") and self.trained)):
                # Off the shared step grid, or the run's closing validation (at a point the run skipped, far
                # from the target): recorded, not scored. A run that trained no batch scores its start's.
                return
            clock, val = float(rec["clock"]), float(rec["val_loss"])
            if not math.isfinite(val):
                self.stop = ("failed", f"diverged: validation loss {val} at clock {clock:.3g}s", None)
                return
            self.evals.append((clock, val))
            self.by_step.append((int(rec["step"]), val))
            self.progress.add_eval(clock, val)
            step = grid_step(clock, self.job.budget, self.job.grid)
            if self.on_eval(step, self.progress) and self.progress.reached_at is None:
                self.stop = ("pruned", f"pruned at grid step {step} (clock {clock:.3g}s)", step)
            elif capped(self.progress, cap := self.job.cap):
                self.stop = ("pruned", f"capped at grid step {step}: clock {clock:.3g}s, past {cap:.3g}s", step)
                self.capped_at = cap
        elif kind == "summary":
            self.summary = rec


class SubprocessRunner:
    """Each trial is ``paci-tune train`` in its own process group (module docstring)."""

    def __init__(self, stall_seconds: float = 300.0, timeout: float | None = None, poll_s: float = 0.1) -> None:
        self.stall_seconds, self.timeout, self.poll_s = stall_seconds, timeout, poll_s
        self.last_pid: int | None = None  # the latest trial's process (and process group) id

    def run(self, job: TrialJob, on_eval: OnEval, on_record: OnRecord | None = None) -> TrialResult:
        job.workdir.mkdir(parents=True, exist_ok=True)
        config, events, log = job.workdir / "trial.yaml", job.workdir / "events.jsonl", job.workdir / "trial.log"
        write_yaml(config, job.run_doc)
        cmd = [
            sys.executable,
            "-m",
            "paci_tune.tune.child",
            str(os.getpid()),
            str(config),
            str(events),
            str(job.workdir / "metrics.jsonl"),
        ]
        env = dict(os.environ)
        if job.threads is not None and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(job.threads)
        watch = _Watch(job, on_eval, on_record)
        timeout = None if self.timeout is None else self.timeout * job.timeout_factor
        t0 = last_activity = time.monotonic()

        def feed(rec: dict[str, Any]) -> None:
            if watch.stop is None:
                watch.feed(rec)

        def stop(active: bool) -> bool:
            nonlocal last_activity
            _check_still_ours(job)
            now = time.monotonic()
            if active:
                last_activity = now
            if watch.stop is None and now - last_activity > self.stall_seconds:
                watch.stop = ("failed", f"hang: no progress for {self.stall_seconds:g}s", None)
            elif watch.stop is None and timeout is not None and now - t0 > timeout:
                watch.stop = ("failed", f"timeout: still running after {timeout:g}s", None)
            return watch.stop is not None

        fork = None
        if (server := job.server) is not None:
            args = cmd[4:]
            fork = lambda env, log: server.spawn(FORKED, args, env, log)  # noqa: E731
        with Child(cmd, log=log, events=events, env=env, fork=fork) as child:
            self.last_pid = child.pid
            follow(child, feed, poll_s=self.poll_s, stop=stop)
            returncode = child.returncode
        if watch.stop is None and isinstance(child.proc, Forked) and child.proc.lost:
            # The fork server died under it (its exit status unknown, :attr:`.zygote.Forked.lost`): not the
            # trial's failure. Run again from the start the ordinary way (unless the worker stops or lost the
            # trial meanwhile); validations already reported are not reported twice (the search's on_eval
            # skips them).
            _check_still_ours(job)
            return self.run(replace(job, server=None), on_eval, on_record)
        wall = time.monotonic() - t0
        if watch.stop is not None:
            status, reason, step = watch.stop
            return TrialResult(
                status, watch.progress, reason, step, watch.summary, wall, watch.evals, watch.by_step, watch.capped_at
            )
        if returncode != 0:
            return TrialResult(
                "failed",
                watch.progress,
                crash_reason(returncode or 0, log),
                None,
                watch.summary,
                wall,
                watch.evals,
                watch.by_step,
            )
        return TrialResult("complete", watch.progress, None, None, watch.summary, wall, watch.evals, watch.by_step)


def crash_reason(returncode: int, log: Path) -> str:
    """Name why a trial's process failed, from its exit code and the last lines it printed."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    text = "\n".join(lines[-40:]).lower()
    last = lines[-1] if lines else ""
    if "out of memory" in text or "outofmemoryerror" in text or "a size whose stages fit" in text:
        return f"oom: {last[:200]}"
    if returncode < 0:
        return f"crash: killed by signal {-returncode}"
    if returncode == 2 and last.startswith("error:"):
        return f"rejected: {last[len('error:') :].strip()[:200]}"
    if last.startswith("error: pipeline worker rank"):  # one rank of a distributed trial died first
        return f"crash: {last[len('error: pipeline worker ') :].split('; the other ranks')[0][:200]}"
    return f"crash: exit code {returncode}: {last[:200]}"


def fork_server(workdir: Path) -> Zygote:
    """The search's fork server for its trials (started on the first trial; its own errors in WORKDIR/trials)."""
    return Zygote(PRELOAD, child_environment(os.environ), workdir / "trials" / "fork-server.log")
