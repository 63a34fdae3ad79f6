"""The bound search space: one run's feasible points, and what the search asks of them.

A :class:`SearchSpace` is a space file bound to one run (:func:`.space.load_space`, whose module
docstring gives the file's values and constraints): every integer dimension a finite list of
feasible choices. It says whether a point is one of the space's and why not (:meth:`SearchSpace.why_not`:
the registry's and torch's refusals, more pieces than units, the device budget, memory, PACI's
staleness and tied-parameter limits, P = 1 searched by one study only), which dimensions each
schedule's study has, draws a point from Optuna (:meth:`SearchSpace.suggest`), enumerates the grid,
and describes itself for the search's provenance. May import: optuna, :mod:`paci_tune.config`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.errors` and the tune layer's :mod:`.point`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import optuna

from ..config.layout import Layout
from ..errors import ConfigError
from ..schedule import DEFAULT_CHUNKS, FLUSH, SYNCHRONOUS, drift_bound, schedule_of
from .point import MemoryDrop, TrialParams


@dataclass(frozen=True)
class SearchSpace:
    """A space bound to one run: every integer dimension is a finite, feasible list of choices."""

    name: str
    schedules: tuple[str, ...]
    fixed_batch: int | None  # the global batch when fixed, else None
    stages: tuple[int, ...]
    microbatch_size: tuple[int, ...]
    window: tuple[int, ...]  # empty when fixed: derived from the micro-batch size
    lr_scale: tuple[float, ...] | tuple[float, float, bool] | None  # choices, (low, high, log) or None
    lr_is_range: bool = False
    devices: int | None = None  # the device budget N (every point uses P x D = N); None: D = 1
    points: frozenset[tuple[int, int, int]] = frozenset()  # feasible (P, a, b); empty: the whole product
    dropped: tuple[str, ...] = ()  # why the other points went, for the user
    paci_max_drift: int | None = None  # PACI skips the points whose drift bound is above it (:func:`skip_stale`)
    backward_weights: tuple[str, ...] = ()  # PACI's choices, in BACKWARD_WEIGHTS order; empty: the run's own
    paci_tied: str | None = None  # the model's units share this parameter: PACI skips P >= 2 (:func:`skip_tied`)
    chunks: tuple[int, ...] = (DEFAULT_CHUNKS,)  # interleaved's v choices (its study's dimension)
    n_units: int | None = None  # the model's units: an interleaved point needs v * P of them at most
    distributed: bool = False  # trials on the distributed runtime: zb-h1 runs torch's class, and its rule
    optimizers: tuple[str, ...] = ()  # optimizer recipes (:mod:`.recipes`), every schedule's; empty: the run's own
    staleness: tuple[str, ...] = ()  # PACI's staleness recipes; empty: the run's own controls
    incompatible: frozenset[tuple[str | None, str]] = frozenset()  # PACI (optimizer, staleness) pairs refused
    over_memory: tuple[MemoryDrop, ...] = ()  # (schedule, point)s predicted above hardware.memory
    memory_bytes: int | None = None  # hardware.memory, once the space has been checked against it

    @property
    def paci(self) -> str | None:
        """The space's asynchronous schedule (PACI), or None when it compares baselines only."""
        return next((s for s in self.schedules if schedule_of(s).asynchronous), None)

    def optimizers_of(self, schedule: str) -> list[str | None]:  # the same for every schedule
        """The optimizer recipes every schedule's points take (module docstring of :mod:`.recipes`), or [None]."""
        return list(self.optimizers) or [None]

    def staleness_of(self, schedule: str) -> list[str | None]:
        """PACI's staleness recipes, or [None] (the run's own; a synchronous schedule never gets one)."""
        return list(self.staleness) if schedule_of(schedule).asynchronous and self.staleness else [None]

    def chunks_of(self, schedule: str) -> list[int]:
        """The v values ``schedule``'s points take: the space's choices if it leaves v open, else its own."""
        return list(self.chunks) if self.tunes_chunks(schedule) else [schedule_of(schedule).chunks_of(None)]

    def tunes_chunks(self, schedule: str) -> bool:
        """Whether ``schedule``'s study has the ``chunks`` dimension (it leaves v to the config)."""
        return schedule_of(schedule).chunks is None

    def backward_weights_of(self, schedule: str) -> list[str | None]:
        """The values ``schedule``'s points take: the space's choices for PACI, else [None] (the run's own)."""
        return list(self.backward_weights) if schedule_of(schedule).asynchronous and self.backward_weights else [None]

    def tunes_backward_weights(self, schedule: str) -> bool:
        """Whether ``schedule``'s study has the ``backward_weights`` dimension (PACI, two choices)."""
        return len(self.backward_weights_of(schedule)) > 1

    def data_parallel(self, stages: int) -> int:
        """D of a point with ``stages`` stages: the budget shared out, or 1 without a budget."""
        return Layout.data_parallel_for(self.devices, stages)

    def window_of(self, stages: int, microbatch_size: int) -> int:
        """a of a fixed-batch point: global_batch / (D * b), or 0 when that is not a whole number."""
        assert self.fixed_batch is not None
        return Layout.window_for(self.fixed_batch, self.data_parallel(stages), microbatch_size)

    def why_not(self, params: TrialParams) -> str | None:
        """None for a feasible point; else why it is not one (a pair Optuna may propose, see the module)."""
        key = (params.stages, params.window, params.microbatch_size)
        stale = schedule_of(params.schedule).asynchronous
        if stale and params.window and (why := self._stale(params.stages, params.window)):
            return f"{params.label()}: {why}"
        if stale and (why := self._tied(params.stages)):
            return f"{params.label()}: {why}"
        if why := self._single_stage(params.schedule, params.stages):
            return f"{params.label()}: {why}"
        if params.window and (why := self._unrunnable(params)):
            return f"{params.label()}: {why}"
        if drop := next((d for d in self.over_memory if d.matches(params)), None):
            return drop.reason()
        if params.staleness is not None and (params.optimizer, params.staleness) in self.incompatible:
            return f"{params.label()}: the run refuses this optimizer with this staleness recipe (see dropped points)"
        if not self.points or key in self.points:
            return None
        if params.window == 0:
            d = params.data_parallel
            return (
                f"P={params.stages} D={d} b={params.microbatch_size}: a = {self.fixed_batch}/({d}*"
                f"{params.microbatch_size}) is not a whole number"
            )
        return f"{params.label()} was dropped when the space was bound (see the search's dropped points)"

    def without_unrunnable(self) -> SearchSpace:
        """This space with the points a schedule cannot run listed in ``dropped`` (a proposal of one is
        answered unrun); a schedule left with none is a ConfigError: its study could run nothing."""
        dropped: list[str] = []
        for s in self.schedules:
            points = [
                TrialParams(s, p, a, b, 1.0, self.data_parallel(p), None, v)
                for p, a, b in sorted(self.points)
                for v in self.chunks_of(s)
            ]
            refused = [f"{q.label()}: {why}" for q in points if (why := self._unrunnable(q))]
            if len(refused) == len(points):
                tuned = self.tunes_chunks(s)
                key, value = ("space.chunks", list(self.chunks)) if tuned else ("space.stages", self.stages)
                raise ConfigError(
                    key, value, f"values that leave {s} a point it can run; none is left: " + "; ".join(refused)
                )
            dropped += refused
        return dataclasses.replace(self, dropped=self.dropped + tuple(dropped)) if dropped else self

    def _unrunnable(self, params: TrialParams) -> str | None:
        """Why ``params.schedule`` cannot run this layout (the simulator's and the run's own refusals), or None."""
        spec = schedule_of(params.schedule)
        refused = spec.refusal(params.stages, params.window, params.chunks)
        if refused is not None:
            return refused[1]
        if self.distributed and spec.runs_torch("distributed", False):  # what torch's own class refuses besides
            torch_refused = spec.torch_refusal(params.stages, params.window)
            if torch_refused is not None:
                return torch_refused
        pieces = params.layout.virtual_stages
        if self.n_units is not None and pieces > self.n_units:
            return (
                f"{params.stages} stages x {params.chunks} chunks = {pieces} pieces, more than the model's "
                f"{self.n_units} units"
            )
        return None

    def _stale(self, stages: int, window: int) -> str | None:
        bound = drift_bound(0, stages, window)
        if self.paci_max_drift is None or bound <= self.paci_max_drift:
            return None
        return (
            f"drift bound ceil(({stages}-1)/{window}) = {bound} > search.paci_max_drift = {self.paci_max_drift} "
            "(PACI skips points this stale; flush keeps the point)"
        )

    def stages_of(self, schedule: str) -> list[int]:
        """The depths ``schedule``'s study samples: where the space pipelines, P = 1 only in one study (flush's)."""
        if self._single_stage(schedule, 1) is None:
            return list(self.stages)
        return [p for p in self.stages if p >= 2]

    def _single_stage(self, schedule: str, stages: int) -> str | None:
        sync = [s for s in self.schedules if s in SYNCHRONOUS]
        owner = FLUSH if FLUSH in sync else (sync[0] if sync else self.schedules[0])
        tied_paci = schedule_of(schedule).asynchronous and self.paci_tied is not None
        if stages != 1 or schedule == owner or tied_paci:
            return None
        if not any(p >= 2 for p in self.stages):
            return None
        return (
            f"at P = 1 every schedule is plain data parallelism (PACI has nothing in flight): {owner}'s study "
            "searches this layout, and the verdict compares it with PACI's pipelined points"
        )

    def _tied(self, stages: int) -> str | None:
        if self.paci_tied is None or stages < 2:
            return None
        return (
            f"{self.paci_tied} are one trainable parameter, which PACI refuses to split across stages "
            "(flush keeps the point)"
        )

    def suggest(self, trial: optuna.trial.BaseTrial, schedule: str) -> TrialParams:
        """Ask Optuna for one point; ``schedule`` is fixed by the study the trial belongs to."""
        stages = int(trial.suggest_categorical("stages", self.stages_of(schedule)))
        b = int(trial.suggest_categorical("microbatch_size", list(self.microbatch_size)))
        if self.fixed_batch is not None:
            a = self.window_of(stages, b)
        else:
            a = int(trial.suggest_categorical("window", list(self.window)))
        lr = 1.0
        if self.lr_scale is not None:
            if self.lr_is_range:
                low, high, log = self.lr_scale  # type: ignore[misc]
                lr = float(trial.suggest_float("lr_scale", float(low), float(high), log=bool(log)))
            else:
                lr = float(trial.suggest_categorical("lr_scale", list(self.lr_scale)))
        (bw, *more) = self.backward_weights_of(schedule)
        if more:
            bw = str(trial.suggest_categorical("backward_weights", [bw, *more]))
        (v,) = self.chunks_of(schedule)[:1]
        if self.tunes_chunks(schedule):  # one choice too: the trial's params then name its v
            v = int(trial.suggest_categorical("chunks", self.chunks_of(schedule)))
        (opt, *more_opts) = self.optimizers_of(schedule)
        if more_opts:
            opt = str(trial.suggest_categorical("optimizer", [opt, *more_opts]))
        (stale, *more_stale) = self.staleness_of(schedule)
        if more_stale:
            stale = str(trial.suggest_categorical("staleness", [stale, *more_stale]))
        return TrialParams(schedule, stages, a, b, lr, self.data_parallel(stages), bw, v, opt, stale)

    def params_of(self, q: TrialParams) -> dict[str, Any]:
        """The Optuna parameters :meth:`suggest` records for point ``q`` (to queue it as a trial)."""
        out: dict[str, Any] = {"stages": q.stages, "microbatch_size": q.microbatch_size}
        if self.fixed_batch is None:
            out["window"] = q.window
        if self.lr_scale is not None:
            out["lr_scale"] = q.lr_scale
        named = (
            (self.backward_weights_of(q.schedule), "backward_weights", q.backward_weights),
            (self.optimizers_of(q.schedule), "optimizer", q.optimizer),
            (self.staleness_of(q.schedule), "staleness", q.staleness),
        )
        out |= {name: value for choices, name, value in named if len(choices) > 1}
        if self.tunes_chunks(q.schedule):
            out["chunks"] = q.chunks
        return out

    def grid(self, schedule: str | None = None) -> list[TrialParams]:
        """Every feasible point (of one schedule, or all); a continuous LR range has no grid."""
        if self.lr_is_range:
            raise ConfigError("lr_scale", "a range", "a list of choices for a grid search")
        lrs = list(self.lr_scale) if self.lr_scale is not None else [1.0]
        out = []
        for s in [schedule] if schedule else self.schedules:
            dims = itertools.product(
                self.stages,
                self.microbatch_size,
                lrs,
                self.backward_weights_of(s),
                self.chunks_of(s),
                self.optimizers_of(s),
                self.staleness_of(s),
            )
            for p, b, lr, bw, v, o, st in dims:
                windows = [self.window_of(p, b)] if self.fixed_batch is not None else list(self.window)
                points = [TrialParams(s, p, a, b, float(lr), self.data_parallel(p), bw, v, o, st) for a in windows]
                out += [q for q in points if self.why_not(q) is None]
        return out

    def grid_variants(self, schedule: str) -> list[TrialParams]:
        """``schedule``'s points at LR x1, every variant of what a point can change in memory (backward
        weights, chunks, optimizer and staleness recipes), feasible or not: what a memory check asks."""
        out = []
        dims = itertools.product(
            self.backward_weights_of(schedule),
            self.chunks_of(schedule),
            self.optimizers_of(schedule),
            self.staleness_of(schedule),
        )
        for bw, v, o, st in dims:
            out += [
                TrialParams(schedule, p, a, b, 1.0, self.data_parallel(p), bw, v, o, st)
                for p, a, b in sorted(self.points)
                if p in self.stages_of(schedule)
            ]
        return out

    def grid_params(self, schedule: str = "paci") -> dict[str, list[Any]]:
        """``schedule``'s study space in the form ``optuna.samplers.GridSampler`` takes (only PACI's has
        ``backward_weights``, and only with two choices; only interleaved's has ``chunks``)."""
        if self.lr_is_range:
            raise ConfigError("search.sampler", "grid", "a space whose lr_scale is a list of choices, not a range")
        out: dict[str, list[Any]] = {"stages": self.stages_of(schedule), "microbatch_size": list(self.microbatch_size)}
        if self.fixed_batch is None:
            out["window"] = list(self.window)
        if self.lr_scale is not None:
            out["lr_scale"] = list(self.lr_scale)
        if self.tunes_backward_weights(schedule):
            out["backward_weights"] = list(self.backward_weights)
        if self.tunes_chunks(schedule):
            out["chunks"] = self.chunks_of(schedule)
        if len(self.optimizers) > 1:
            out["optimizer"] = list(self.optimizers)
        if len(self.staleness_of(schedule)) > 1:
            out["staleness"] = list(self.staleness)
        return out

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "schedules": list(self.schedules),
            "global_batch": self.fixed_batch if self.fixed_batch is not None else "free",
            "stages": list(self.stages),
            "microbatch_size": list(self.microbatch_size),
        }
        if self.paci_max_drift is not None:
            out["paci_max_drift"] = self.paci_max_drift
        if self.paci_tied is not None and any(schedule_of(s).asynchronous for s in self.schedules):
            out["paci_single_stage"] = self.paci_tied
        if self.devices is not None:
            out["devices"] = self.devices
            out["layouts"] = [[p, self.data_parallel(p)] for p in self.stages]  # (P, D)
            out["points"] = sorted([list(x) for x in self.points])  # feasible (P, a, b)
        if self.fixed_batch is None:
            out["window"] = list(self.window)
        if self.lr_scale is not None:
            keys = ("low", "high", "log")
            lr = self.lr_scale
            out["lr_scale"] = dict(zip(keys, lr, strict=True)) if self.lr_is_range else list(lr)
        if self.backward_weights:
            out["backward_weights"] = list(self.backward_weights)
        if any(self.tunes_chunks(s) for s in self.schedules):  # absent otherwise: an older search's fingerprint stays
            out["chunks"] = list(self.chunks)
        if self.optimizers:
            out["optimizer"] = list(self.optimizers)
        if self.staleness:
            out["staleness"] = list(self.staleness)
        return out
