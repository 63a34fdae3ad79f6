"""The search loop: ask Optuna for a point, run it as a trial, report it on the clock grid, tell.

Everything here is storage-backed, so the loop can be killed at any moment and started again:
finished trials stay, the interrupted one is failed and retried (:mod:`.study`), and the loop
goes on until each schedule's study has its quota of trials. A trial another worker reaped while this
one ran it is dropped here, its run killed, nothing written to it (:mod:`.liveness`). A storage outage of a
few seconds (a database server restarted) is ridden out where the loop and its trials read and write (:mod:`.outage`).

A point already run is not trained again (:mod:`.repeats`). On the sim and rst clocks a trial
whose numerics another trial trained is answered from that curve, read on its own layout's clock
(:mod:`.sharing`), and the study's other points of that curve are queued and answered from it too
(:mod:`.siblings`). Several trials may run at once (:mod:`.lanes`). Each trial's end is told to its
study by :mod:`.tell`. May import: optuna, :mod:`paci_tune.pipeline` (predicted memory),
:mod:`paci_tune.sim`, :mod:`paci_tune.config`, :mod:`paci_tune.base` (the fork server),
:mod:`paci_tune.schedule`, :mod:`paci_tune.errors` and the tune layer's own modules.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from ..base.zygote import Zygote
from ..config import derive_doc, derive_run
from ..config.tune import TuneConfig
from ..errors import ConfigError
from ..schedule import sides
from . import extra, record, siblings
from .capping import cap_of
from .comparison import Design
from .curves import numerics_key
from .events import SearchEvent
from .extra import confirm_seeds
from .lanes import Lanes
from .liveness import Heartbeat, Watch, claim, reaped_line, taken_line, workers_here
from .objective import Progress
from .outage import retrying
from .planner import Plan, Planner
from .point import TrialParams
from .record import PointAttrs, TrialRecord
from .repeats import answer_repeat, wait_for_earlier
from .rounds import confirmed_schedules, current_round
from .runner import OnEval, TrialJob, TrialResult, TrialRunner, fork_server
from .sharing import Horizons, StepGrid, applies, replay_points, stored_curve, walk
from .space import SearchSpace
from .study import counted, exhausted, reap_dead, retry_waiting, running_elsewhere
from .tell import curve_result, refuse, tell
from .trialdoc import plain_doc
from .warm import WarmStart


@dataclass
class Search:
    """One worker's part of a search (see the module docstring)."""

    tune: TuneConfig
    space: SearchSpace
    studies: dict[str, optuna.Study]
    runner: TrialRunner
    workdir: Path
    profile: str | None
    on_event: Callable[[SearchEvent], None] = lambda e: None
    poll_s: float = 2.0
    ran: list[int] = field(default_factory=list)
    warm: WarmStart | None = None  # every trial starts from this checkpoint (:mod:`.warm`)
    _profile: Any = field(default=None, repr=False)
    _horizons: Horizons | None = field(default=None, repr=False)
    jobs: int = 1  # trials at once (search.jobs, :func:`.setup.side_by_side`)
    _lanes: Lanes = field(default_factory=lambda: Lanes(1), repr=False)
    _points: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)  # each schedule's, by _exhausted
    _server: Zygote | None = field(default=None, repr=False)  # trials are forked from it (:func:`.runner.fork_server`)
    _watch: Watch = field(default_factory=Watch, repr=False)  # the heartbeats seen, from one reaping to the next
    _planner: Planner | None = field(default=None, repr=False)  # search.strategy: predict (:mod:`.planner`)

    @property
    def quota(self) -> int:
        return self.tune.search.trials

    def run(self) -> None:
        """Run trials until every schedule's study holds its quota of finished trials, then confirm, then
        run the transfer check (:mod:`.extra`: it decides nothing, so the confirmation comes first).
        Up to ``jobs`` trials at once, each study's search trials in order (:mod:`.lanes`)."""
        # The lanes inside the fork server: on an error they stop their trials (left running, for a retry)
        # before the server closes; the other way round it killed them first, and they were told crashes.
        with fork_server(self.workdir) as self._server, Lanes(self.jobs) as lanes:
            self._lanes = lanes
            while True:
                retrying(self._reap, "reaping dead workers' trials")
                batch = retrying(lambda: self._fill(lanes), "asking for trials")
                share = lanes.running + len(batch)
                for schedule, trial, params, searching in batch:
                    run = functools.partial(self.run_trial, schedule, (trial, params))
                    lanes.start(schedule, searching, trial._trial_id, share, run)
                if lanes.running:
                    lanes.wait_one(self.poll_s)
                    continue
                if batch:
                    continue
                if not retrying(
                    lambda: any(running_elsewhere(s.get_trials(deepcopy=False)) for s in self.studies.values()),
                    "waiting",
                ):
                    return
                self.on_event(SearchEvent("wait", "", -1))
                time.sleep(self.poll_s)  # other workers' last trials: wait for them or for their death

    def _reap(self) -> None:
        for study in self.studies.values():
            reap_dead(study, self.tune.search.retries, self.tune.search.heartbeat_grace, self._watch)

    def _fill(self, lanes: Lanes) -> list[tuple[str, optuna.Trial, TrialParams, bool]]:
        """The trials to start now, asked and claimed here: as many as ``lanes`` has room for; a study
        whose search trial runs in this worker gets no second one (its sampler would not have seen the first)."""
        busy, batch = lanes.busy, []
        while lanes.free > len(batch):
            schedule = self._next_schedule(busy)
            searching = schedule is not None
            schedule = schedule or self._next_confirmation() or self._next_transfer()
            if schedule is None:
                break
            trial, params = self._begin(schedule)
            if searching:
                busy.add(schedule)
            batch.append((schedule, trial, params, searching))
        return batch

    def _next_schedule(self, busy: set[str] | frozenset[str] = frozenset()) -> str | None:
        """The schedule furthest from its quota (a space all run is done), or with a layout of a curve or a dead
        worker's trial queued (its retry runs even past the quota), not one of ``busy`` (ties: the space's order)."""
        counts = {s: counted(st.get_trials(deepcopy=False), self.quota) for s, st in self.studies.items()}
        if self.tune.search.strategy == "predict":
            searching = {s for s in self.studies if self._plan(s) == "queued"}
        else:
            searching = {s for s in self.studies if counts[s] < self.quota and not self._exhausted(s)}
        owed = {s for s, st in self.studies.items() if siblings.waiting(st) or retry_waiting(st)}
        open_ = [s for s in self.studies if (s in searching or s in owed) and s not in busy]
        return min(open_, key=lambda s: counts[s]) if open_ else None

    def _searched(self, study: optuna.Study) -> bool:
        """The study's search is over: its quota is met (``predict``: its planner is done), none of its search
        trials runs still, here or in another worker, and no layout of a curve waits (its best points are known)."""
        schedule = next(s for s, st in self.studies.items() if st is study)
        if self.tune.search.strategy == "predict":
            over = self._plan(schedule) == "done"
        else:
            over = counted(study.get_trials(deepcopy=False), self.quota) >= self.quota or self._exhausted(schedule)
        return over and not extra.search_trials(study, (TrialState.RUNNING,)) and not siblings.waiting(study)

    def _plan(self, schedule: str) -> Plan:
        """Queue the schedule's next planned trial (:class:`.planner.Planner`); where its study stands."""
        if self._planner is None:
            first, target = self.warm.step if self.warm else 0, self.tune.target.value or 0.0
            z = self.tune.search.verify_z
            self._planner = Planner(self.space, self.trial_doc, self.loaded_profile(), first, target, z, self.quota)
        return self._planner.plan(self.studies, schedule)

    def _exhausted(self, schedule: str) -> bool:
        """Every feasible point of the schedule's space has run (:func:`.study.exhausted`; an LR range never has)."""
        if schedule not in self._points:  # the space is fixed: its points are enumerated once
            try:
                self._points[schedule] = [self.space.params_of(q) for q in self.space.grid(schedule)]
            except ConfigError:
                self._points[schedule] = []
        return exhausted(self.studies[schedule].get_trials(deepcopy=False), self._points[schedule])

    def _next_confirmation(self) -> str | None:
        """Plan and queue the confirmations of the compared studies whose search is over (PACI's as soon as its
        own is; the strongest synchronous one's once every synchronous search is over, :func:`.rounds.
        confirmed_schedules`); a schedule with one waiting."""
        c = self.tune.search.confirm
        if not c.enabled:
            return None
        base = self.tune.run.training.seed
        seeds = confirm_seeds(base, current_round(self.studies, base, Design(c.seeds, c.cap, c.tolerance)).seeds)
        paci, sync = sides(self.studies)  # the baseline's confirmation waits for every synchronous search
        wanted = confirmed_schedules(self.studies) if all(self._searched(self.studies[s]) for s in sync) else {paci}
        for schedule, study in self.studies.items():
            if schedule in wanted and self._searched(study):
                extra.enqueue_confirmations(study, extra.confirm_plan(study, c.top), seeds)
        return next((s for s, study in self.studies.items() if extra.waiting(study)), None)

    def _next_transfer(self) -> str | None:
        """Once every study's search is over and no confirmation waits: plan and queue the transfer check's runs."""
        tc = self.tune.search.transfer_check
        if not tc.enabled or not all(self._searched(s) for s in self.studies.values()):
            return None
        for study in self.studies.values():
            extra.enqueue_transfers(study, extra.transfer_plan(study, tc.top), tc.factor)
        return next((s for s, study in self.studies.items() if extra.transfer_queued(study)), None)

    # ------------------------------------------------------------------------- one trial
    def _begin(self, schedule: str) -> tuple[optuna.Trial, TrialParams]:
        """Ask the schedule's study for its next trial (a queued one first), claim it and draw its point (each
        retried alone through a storage outage: asked again, an unclaimed trial would be lost, :mod:`.outage`)."""
        trial = self.studies[schedule].ask()
        retrying(lambda: claim(trial), "claiming a trial")
        return trial, retrying(lambda: self.space.suggest(trial, schedule), "drawing a trial's point")

    def run_trial(self, schedule: str, begun: tuple[optuna.Trial, TrialParams] | None = None) -> None:
        """Run one trial; one another worker reaped or finished meanwhile (:mod:`.liveness`) is dropped, its run
        killed."""
        trial, params = begun or self._begin(schedule)
        with Heartbeat(self.studies[schedule]._storage, trial._trial_id) as beat:
            self._run_trial(schedule, trial, params, beat.lost)
        if beat.reaped or beat.taken:
            line = reaped_line(trial.number) if beat.reaped else taken_line(trial.number)
            self.on_event(SearchEvent("end", schedule, trial.number, params, state="reaped", reason=line))

    def _run_trial(self, schedule: str, trial: optuna.Trial, params: TrialParams, lost: threading.Event) -> None:
        study = self.studies[schedule]
        rec = TrialRecord.read(trial)
        seed, factor = rec.seed, rec.factor if rec.factor is not None else 1.0
        tag = f" seed {seed}" if seed is not None else (f" x{factor:g} budget" if factor != 1.0 else "")
        # backward_weights: PACI with the space's backward_weights (a fixed one is no param); else not written.
        # The optimizer and staleness recipes likewise (the stored trial names what it trained with).
        PointAttrs(
            params.label() + tag,
            params.data_parallel,
            params.devices,
            params.backward_weights,
            params.optimizer,
            params.staleness,
        ).write(trial)
        transfer = f"transfer check, {factor:g}x the budget" if factor != 1.0 else None
        note = f"confirmation, seed {seed}" if seed is not None else transfer
        self.on_event(SearchEvent("start", schedule, trial.number, params, reason=note))
        if (why := self.space.why_not(params)) is not None:
            self._refuse(study, trial, params, why)
            return
        answered = not rec.is_extra and self._reuse(study, trial, params, lost)  # an extra run is never a repeat
        if not (answered or (factor == 1.0 and self._share(study, trial, params, seed))):
            self._run_fresh(study, trial, params, seed, factor, lost=lost)
        if not (answered or rec.is_extra or rec.sibling_of is not None):
            self._queue_siblings(study, trial.number, params)
        self.ran.append(trial.number)

    def _refuse(self, study: optuna.Study, trial: optuna.Trial, params: TrialParams, why: str) -> None:
        """A proposal outside the device budget's feasible points: answered unrun (:func:`.tell.refuse`)."""
        self.on_event(refuse(study, trial, params, why))
        self.ran.append(trial.number)

    def _run_fresh(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        params: TrialParams,
        seed: int | None,
        factor: float = 1.0,
        *,
        cover: bool = True,
        lost: threading.Event | None = None,
    ) -> None:
        b = self.tune.budget
        budget, grid = extra.long_budget(float(b.seconds or 0.0), b.grid, factor)
        job = TrialJob(
            params=params,
            run_doc=self.trial_doc(params, seed, factor),
            workdir=self.workdir / "trials" / study.study_name / f"trial-{trial.number:04d}",
            budget=budget,
            grid=grid,
            target=float(self.tune.target.value or 0.0),
            threads=self._threads(trial),
            cancel=self._lanes.cancel,
            lost=lost,  # the trial reaped by another worker: its run is killed (:class:`.liveness.Heartbeat`)
            server=self._server,
            timeout_factor=factor,  # search.trial_timeout is a short trial's: a long run gets factor x as long
        )
        grid_of = self.step_grid(params) if factor == 1.0 else None
        # A search trial of a class with other layouts trains the class's whole curve (to its horizon or the
        # target, never pruned on the way), then is answered from it like any other (:mod:`.sharing`).
        cover = cover and grid_of is not None and grid_of.members > 1 and seed is None
        job.cap = None if cover or seed is not None or factor != 1.0 else cap_of(study, self.tune.search, budget)
        key = numerics_key(derive_run(job.run_doc)) if grid_of is not None else None  # the run as its own budget has it
        if grid_of is not None:
            job.scored_every = grid_of.every
        if cover:
            first = self.warm.step if self.warm else 0
            job.run_doc = derive_doc(job.run_doc, {"training.seconds": None, "training.steps": first + grid_of.horizon})  # type: ignore[union-attr]
        on_eval = self._reporter(study, trial, params, seed, factor, report=not cover)
        schedule = params.schedule

        def on_record(rec: dict[str, Any]) -> None:
            self.on_event(SearchEvent("record", schedule, trial.number, params, record=rec))

        result = self.runner.run(job, on_eval, on_record)
        record.keep_metrics(trial, job.workdir / "metrics.jsonl", self.workdir / "artifacts")
        if key is not None and result.status != "failed" and result.by_step:
            record.write_numerics(trial, key, grid_of.every, result.by_step)  # type: ignore[union-attr]
        if cover and result.status != "failed":
            if self._share(study, trial, params, seed, trained=result):
                return
            # Its own run needs a validation the class's curve has not got (its budget holds no batch, so it
            # validates its start): trained as itself.
            self._run_fresh(study, trial, params, seed, factor, cover=False, lost=lost)
            return
        self._tell(study, trial, params, result)

    def _reporter(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        params: TrialParams,
        seed: int | None,
        factor: float,
        *,
        report: bool = True,
    ) -> OnEval:
        """Report each validation on the clock grid; True when the pruner stops the trial there (``report``
        False: show progress only, as a run training a shared curve does)."""
        # Steps already reported (a curve replayed by _reuse or _share) are not reported twice.
        reported = set(study._storage.get_trial(trial._trial_id).intermediate_values)

        def on_eval(step: int, progress: Progress) -> bool:
            self.on_event(SearchEvent("eval", params.schedule, trial.number, params, step, progress))
            if factor != 1.0 or not report:
                return False  # a transfer check's long run: not reported, never pruned (.extra)
            if step in reported:
                return False
            reported.add(step)
            retrying(lambda: trial.report(progress.value, step), "reporting a validation")
            # A confirmation is never pruned: its whole run is the evidence.
            return seed is None and progress.reached_at is None and retrying(trial.should_prune, "pruning")

        return on_eval

    def _threads(self, trial: optuna.Trial) -> int | None:
        """Split this machine's cores among the trials running on it now, this worker's side by side
        (:mod:`.lanes`) and other workers' here (:func:`.liveness.workers_here`): oversubscribed OpenMP threads
        spin (trials ran ten times slower). One trial alone keeps torch's default."""
        others = retrying(lambda: workers_here(self.studies.values()), "counting the trials running here")
        return self._lanes.threads(trial._trial_id, others)

    def _tell(self, study: optuna.Study, trial: optuna.Trial, params: TrialParams, result: TrialResult) -> None:
        predicted = self._predicted_memory(params, result.summary.get("partition")) if result.summary else None
        self.on_event(retrying(lambda: tell(study, trial, params, result, predicted), "telling a trial's end"))

    def _predicted_memory(self, params: TrialParams, partition: Any) -> list[int] | None:
        """Predicted peak bytes per stage, beside the measured ones and in best.yaml's candidates: the figure
        a device budget is held to (:func:`paci_tune.pipeline.planning.budget_peaks`)."""
        if not self.profile or not isinstance(partition, list):
            return None
        from ..pipeline.planning import budget_peaks

        try:
            return budget_peaks(derive_run(self.trial_doc(params)), self.loaded_profile(), partition)
        except Exception:
            return None

    def loaded_profile(self) -> Any:
        """The search's cost profile, read once per search, not per trial."""
        from ..sim.profile import Profile

        if self._profile is None:
            assert self.profile is not None
            self._profile = Profile.load(self.profile)
        return self._profile

    # -------------------------------------------------------------------- shared curves
    def step_grid(self, params: TrialParams) -> StepGrid | None:
        """The point's shared-curve grid (:mod:`.sharing`); None when the search does not share curves."""
        if not applies(self.tune, self.profile):
            return None
        if self._horizons is None:
            self._horizons = Horizons(self.tune, self.space.grid, self._plain_doc, self.loaded_profile())
        return self._horizons.grid(params)

    def _share(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        params: TrialParams,
        seed: int | None,
        trained: TrialResult | None = None,
    ) -> bool:
        """Answer a trial from the stored curve of its numerics, read on its own layout's clock
        (:mod:`.sharing`); False when it must train: no curve stored, or one that stops short of a step it needs.
        ``trained``: the trial's own run of the class's curve, answered the same way."""
        grid_of = self.step_grid(params)
        cfg = derive_run(self.trial_doc(params, seed)) if grid_of is not None else None
        key = numerics_key(cfg) if cfg is not None else None
        found = stored_curve(self.studies.values(), key) if key is not None else None
        if trained is not None:
            curve = dict(trained.by_step) | (found[0] if found is not None else {})
            found = (curve, study.study_name, trial.number)
        if found is None or cfg is None or grid_of is None:
            return False
        curve, source_study, source = found
        b = self.tune.budget
        budget, target = float(b.seconds or 0.0), float(self.tune.target.value or 0.0)
        first = self.warm.step if self.warm else 0
        replay = replay_points(cfg, self.loaded_profile(), first, grid_of.every)
        if (read := walk(replay, curve, target, grid_of)) is None:
            return False
        on_eval = self._reporter(study, trial, params, seed, 1.0)
        cap = None if seed is not None else cap_of(study, self.tune.search, budget)  # as its own run's (.capping)
        how = f"curve of {source_study} trial {source}" if trained is None else "its class's curve trained"
        result = curve_result(
            read,
            replay,
            on_eval,
            target=target,
            budget=budget,
            grid=b.grid,
            cap=cap,
            first=first,
            how=how,
            trained=trained,
        )
        if trained is None:
            record.mark_shared(trial, source_study, source)
        self._tell(study, trial, params, result)
        return True

    def _queue_siblings(self, study: optuna.Study, number: int, params: TrialParams) -> None:
        """Queue the study's other points of the trial's curve (:mod:`.siblings`), with shared curves on."""
        s, first, target = self.tune.search, self.warm.step if self.warm else 0, float(self.tune.target.value or 0)
        if self.step_grid(params) is not None and s.every_layout and s.sampler != "grid" and self._horizons:
            queue = siblings.Siblings(self.space, self._horizons, self.trial_doc, self.loaded_profile(), first, target)
            queue.queue(study, self.studies.values(), number, params)

    # -------------------------------------------------------------------- repeated points
    def _reuse(self, study: optuna.Study, trial: optuna.Trial, params: TrialParams, lost: threading.Event) -> bool:
        """Answer a repeated point from its earlier trial, once another worker's run of it has ended
        (:mod:`.repeats`); False when it must be trained."""
        wait_for_earlier(study, trial, self.tune.search.heartbeat_grace, lost)
        if (told := answer_repeat(study, trial)) is not None:
            end = SearchEvent("end", params.schedule, trial.number, params, told.step, state=told.state)
            self.on_event(dataclasses.replace(end, reason=told.reason, value=told.value))
        return told is not None

    # ------------------------------------------------------------------------- configs
    def trial_doc(self, params: TrialParams, seed: int | None = None, factor: float = 1.0) -> dict[str, Any]:
        """The complete run document of one trial (:meth:`_plain_doc`), its curve made its numerics' alone
        when the search shares curves (:class:`.sharing.StepGrid`; never a transfer check's long run)."""
        doc = self._plain_doc(params, seed, factor)
        grid_of = self.step_grid(params) if factor == 1.0 else None
        return doc if grid_of is None else derive_doc(doc, grid_of.overrides())

    def _plain_doc(self, params: TrialParams, seed: int | None = None, factor: float = 1.0) -> dict[str, Any]:
        """The run document of one trial without curve sharing (:func:`.trialdoc.plain_doc`)."""
        return plain_doc(self.tune, self.profile, self.warm, params, seed, factor)
