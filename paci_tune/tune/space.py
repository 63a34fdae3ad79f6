"""Search spaces: ``search_spaces/*.yaml`` parsed, constrained and handed to Optuna.

A space lists the pipeline depth P (``stages``), the micro-batch size and, when the global batch
is ``free``, the window ``a``; optionally an LR scale. Each is a list of choices or a range
(``{low, high}``, ``step``, or ``log: true`` for powers of two / a log-uniform float). PACI's
``backward_weights`` (``pipeline.backward_weights``: ``forward`` or ``current``) is a list of choices
too: two make a categorical dimension of the PACI study, one fixes it for every PACI trial, absent
leaves the run's own value; flush studies never get it (it changes nothing under a flush).

``schedules`` names the studies: any of the schedule registry's (:mod:`paci_tune.schedule`; default
``[paci, 1f1b]``). Those paci-tune does not run itself train 1F1B-flush's numbers on the emulated
runtime, timed by the simulator (sim and rst clocks only), and run for real on the distributed runtime
through torch's classes (:mod:`paci_tune.config.tune` refuses what cannot run). A schedule that leaves
v to the config (interleaved) adds ``chunks`` (a list of integers >= 2, default ``[2]``), a dimension
of its own study only. A point a schedule cannot run is not a point of its study: the registry's
refusal (rounds that must divide the window, too few micro-batches), torch's on the distributed
runtime, and more pieces than the model's units (:meth:`SearchSpace.why_not`).

Constraints are applied once, when the space is bound to a run, so the sampler only ever sees
feasible values and the grid is finite:

- ``global_batch: fixed`` -- a * micro-batch size = the run's global batch: the micro-batch size
  must divide it and the window follows from it (or the other way round);
- ``global_batch: free`` -- a and micro-batch size are searched independently; the LR follows the
  batch through ``lr_schedule.reference_batch`` scaling;
- P <= the model's units (a stage holds at least one);
- **a fixed device budget** (``hardware.devices = N``): every trial uses all N devices, as D = N / P
  data-parallel replicas of a P-stage pipeline; P must divide N, and with a fixed global batch
  a = global_batch / (D * b) must be whole. The other points are dropped, each with its reason
  (:attr:`SearchSpace.dropped`), and so are those whose devices would not hold their stage (:mod:`.setup`);
  a pair outside the feasible set is answered without training (:meth:`SearchSpace.why_not`). Without
  a budget D = 1. P = 1 is plain data parallelism under every schedule: where the space pipelines, only
  flush's study searches it (:meth:`SearchSpace.stages_of`). PACI may skip points too stale to win
  (:func:`skip_stale`), and P >= 2 for a model whose units share a parameter (:func:`skip_tied`).
Values are parsed by :mod:`.choices`; a bound space is narrowed by :mod:`.narrow`. May import: optuna,
:mod:`paci_tune.base`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.errors` and the tune
layer's :mod:`.budget`, :mod:`.choices`, :mod:`.recipes` and :mod:`.point` (its TrialParams re-exported).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from ..base.files import read_mapping
from ..base.shipped import resolve_path, shipped, shipped_names
from ..config.layout import Layout
from ..errors import ConfigError
from ..schedule import DEFAULT_CHUNKS, FLUSH, NAMES, SYNCHRONOUS, drift_bound, schedule_of
from .budget import budget_points
from .choices import backward_weights_choices, chunks_choices, int_choices, keep, lr_space
from .point import MemoryDrop, TrialParams
from .recipes import optimizer_recipes, staleness_recipes

SCHEDULES = NAMES
"""A space's schedules: every schedule in the registry, PACI and the synchronous baselines
(:data:`~paci_tune.schedule.SYNCHRONOUS`, best.yaml's baseline is the best of those searched)."""
DEFAULT_SCHEDULES = (*(n for n in NAMES if not schedule_of(n).synchronous), FLUSH)
_KEYS = ("description", "schedules", "global_batch", "stages", "microbatch_size", "window", "lr_scale",
         "backward_weights", "chunks", "optimizer", "staleness")  # fmt: skip


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
            return (f"P={params.stages} D={d} b={params.microbatch_size}: a = {self.fixed_batch}/({d}*"
                    f"{params.microbatch_size}) is not a whole number")  # fmt: skip
        return f"{params.label()} was dropped when the space was bound (see the search's dropped points)"

    def without_unrunnable(self) -> SearchSpace:
        """This space with the points a schedule cannot run listed in ``dropped`` (a proposal of one is
        answered unrun); a schedule left with none is a ConfigError: its study could run nothing."""
        dropped: list[str] = []
        for s in self.schedules:
            points = [TrialParams(s, p, a, b, 1.0, self.data_parallel(p), None, v)
                      for p, a, b in sorted(self.points) for v in self.chunks_of(s)]  # fmt: skip
            refused = [f"{q.label()}: {why}" for q in points if (why := self._unrunnable(q))]
            if len(refused) == len(points):
                tuned = self.tunes_chunks(s)
                key, value = ("space.chunks", list(self.chunks)) if tuned else ("space.stages", self.stages)
                raise ConfigError(key, value, f"values that leave {s} a point it can run; none is left: "
                                  + "; ".join(refused))  # fmt: skip
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
            return (f"{params.stages} stages x {params.chunks} chunks = {pieces} pieces, more than the model's "
                    f"{self.n_units} units")  # fmt: skip
        return None

    def _stale(self, stages: int, window: int) -> str | None:
        bound = drift_bound(0, stages, window)
        if self.paci_max_drift is None or bound <= self.paci_max_drift:
            return None
        return (f"drift bound ceil(({stages}-1)/{window}) = {bound} > search.paci_max_drift = {self.paci_max_drift} "
                "(PACI skips points this stale; flush keeps the point)")  # fmt: skip

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
        return (f"at P = 1 every schedule is plain data parallelism (PACI has nothing in flight): {owner}'s study "
                "searches this layout, and the verdict compares it with PACI's pipelined points")  # fmt: skip

    def _tied(self, stages: int) -> str | None:
        if self.paci_tied is None or stages < 2:
            return None
        return (f"{self.paci_tied} are one trainable parameter, which PACI refuses to split across stages "
                "(flush keeps the point)")  # fmt: skip

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
        named = ((self.backward_weights_of(q.schedule), "backward_weights", q.backward_weights),
                 (self.optimizers_of(q.schedule), "optimizer", q.optimizer),
                 (self.staleness_of(q.schedule), "staleness", q.staleness))  # fmt: skip
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
        dims = itertools.product(self.backward_weights_of(schedule), self.chunks_of(schedule),
                                 self.optimizers_of(schedule), self.staleness_of(schedule))  # fmt: skip
        for bw, v, o, st in dims:
            out += [TrialParams(schedule, p, a, b, 1.0, self.data_parallel(p), bw, v, o, st)
                    for p, a, b in sorted(self.points) if p in self.stages_of(schedule)]  # fmt: skip
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


def resolve_space_path(name: str) -> Path:
    """A space by file path, or by name from the shipped spaces (package data, :mod:`paci_tune.base.shipped`)."""
    p = resolve_path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        return p
    found = shipped("search_spaces", name)
    if found is not None:
        return found
    names = ", ".join(shipped_names("search_spaces"))
    raise ConfigError("search.space", name, f"a YAML file or one of the shipped spaces: {names}")


def load_space(
    name: str,
    *,
    global_batch: int,
    n_units: int,
    max_stages: int | None,
    devices: int | None = None,
    distributed: bool = False,
) -> SearchSpace:
    """Read a space file and bind it to a run: apply every constraint, refuse an empty dimension.

    ``devices``: the search's device budget (module docstring); a budget that leaves no point is a
    ConfigError on ``hardware.devices`` listing why each went. ``distributed``: the trials run on the
    distributed runtime, where zb-h1 is torch's own class and a window it cannot run is dropped.
    """
    path = resolve_space_path(name)
    doc = read_mapping(path, "search.space", "keys " + ", ".join(_KEYS))
    for k, v in doc.items():
        if k not in _KEYS:
            raise ConfigError(f"space.{k}", v, "one of: " + ", ".join(_KEYS))
    if not isinstance(doc.get("description", ""), str):
        raise ConfigError("space.description", doc["description"], "a string")
    schedules = doc.get("schedules", list(DEFAULT_SCHEDULES))
    if (not isinstance(schedules, list) or not schedules or any(s not in SCHEDULES for s in schedules)
            or len(set(schedules)) < len(schedules)):  # fmt: skip
        raise ConfigError("space.schedules", schedules, "a non-empty list without repeats of: " + ", ".join(SCHEDULES))
    chunks = chunks_choices(doc.get("chunks"))
    mode = doc.get("global_batch", "fixed")
    if mode not in ("fixed", "free"):
        raise ConfigError("space.global_batch", mode, "fixed (a * micro-batch size = training.global_batch) or free")

    stages = int_choices("space.stages", doc.get("stages"))
    cap = n_units if max_stages is None else min(n_units, max_stages)
    why = f"at most {n_units} (the model's units)" + (
        f" and at most hardware.devices={max_stages} on the wall clock" if max_stages is not None else ""
    )
    stages = keep("space.stages", stages, lambda p: p <= cap, why)
    windows_given: list[int] = []

    if mode == "fixed":
        if "window" in doc and "microbatch_size" in doc:
            raise ConfigError(
                "space.window", doc["window"], "absent when global_batch is fixed and microbatch_size is given "
                "(a = global_batch / micro-batch size); or set global_batch: free"
            )  # fmt: skip
        if "window" in doc:
            windows = int_choices("space.window", doc["window"])
            windows = keep("space.window", windows, lambda a: global_batch % a == 0, f"divisors of {global_batch}")
            sizes = [global_batch // a for a in windows]
            windows_given = windows
        else:
            sizes = int_choices("space.microbatch_size", doc.get("microbatch_size"))
            sizes = keep(
                "space.microbatch_size", sizes, lambda b: global_batch % b == 0,
                f"divisors of training.global_batch={global_batch}",
            )  # fmt: skip
        windows = []
        fixed: int | None = global_batch
    else:
        sizes = int_choices("space.microbatch_size", doc.get("microbatch_size"))
        windows = int_choices("space.window", doc.get("window"))
        fixed = None

    lr, lr_range = lr_space(doc.get("lr_scale"))
    backward_weights = backward_weights_choices(doc.get("backward_weights"))
    optimizers, staleness = optimizer_recipes(doc.get("optimizer")), staleness_recipes(doc.get("staleness"))
    given_windows = windows_given if mode == "fixed" and "window" in doc else None
    points, dropped = budget_points(stages, sorted(set(sizes)), windows, fixed, devices, given_windows)
    if not points:
        raise ConfigError("hardware.devices", devices, "a budget that leaves a point of the space; none is left: "
                          + "; ".join(dropped))  # fmt: skip
    return SearchSpace(
        name=path.stem,
        schedules=tuple(schedules),
        fixed_batch=fixed,
        stages=tuple(sorted({p for p, _, _ in points})),
        microbatch_size=tuple(sorted({b for _, _, b in points})),
        window=tuple(windows),
        lr_scale=lr,
        lr_is_range=lr_range,
        devices=devices,
        points=frozenset(points),
        dropped=tuple(dropped),
        backward_weights=backward_weights,
        chunks=chunks,
        n_units=n_units,
        distributed=distributed,
        optimizers=optimizers,
        staleness=staleness,
    ).without_unrunnable()
