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
Values are parsed by :mod:`.choices`; the bound space is a :class:`~.bound.SearchSpace` (:mod:`.bound`),
narrowed by :mod:`.narrow`. May import: :mod:`paci_tune.base`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.errors` and the tune layer's :mod:`.bound`, :mod:`.budget`, :mod:`.choices`, :mod:`.recipes`
and :mod:`.point` (SearchSpace and TrialParams re-exported).
"""

from __future__ import annotations

from pathlib import Path

from ..base.files import read_mapping
from ..base.shipped import resolve_path, shipped, shipped_names
from ..errors import ConfigError
from ..schedule import FLUSH, NAMES, schedule_of
from .bound import SearchSpace  # the space a file binds to (re-exported: callers import it from here)
from .budget import budget_points
from .choices import backward_weights_choices, chunks_choices, int_choices, keep, lr_space
from .point import TrialParams
from .recipes import optimizer_recipes, staleness_recipes

__all__ = ["DEFAULT_SCHEDULES", "SearchSpace", "TrialParams", "load_space", "resolve_space_path"]

DEFAULT_SCHEDULES = (*(n for n in NAMES if not schedule_of(n).synchronous), FLUSH)
_KEYS = (
    "description",
    "schedules",
    "global_batch",
    "stages",
    "microbatch_size",
    "window",
    "lr_scale",
    "backward_weights",
    "chunks",
    "optimizer",
    "staleness",
)


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
    if (
        not isinstance(schedules, list)
        or not schedules
        or any(s not in NAMES for s in schedules)
        or len(set(schedules)) < len(schedules)
    ):
        raise ConfigError("space.schedules", schedules, "a non-empty list without repeats of: " + ", ".join(NAMES))
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
                "space.window",
                doc["window"],
                "absent when global_batch is fixed and microbatch_size is given "
                "(a = global_batch / micro-batch size); or set global_batch: free",
            )
        if "window" in doc:
            windows = int_choices("space.window", doc["window"])
            windows = keep("space.window", windows, lambda a: global_batch % a == 0, f"divisors of {global_batch}")
            sizes = [global_batch // a for a in windows]
            windows_given = windows
        else:
            sizes = int_choices("space.microbatch_size", doc.get("microbatch_size"))
            sizes = keep(
                "space.microbatch_size",
                sizes,
                lambda b: global_batch % b == 0,
                f"divisors of training.global_batch={global_batch}",
            )
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
        raise ConfigError(
            "hardware.devices",
            devices,
            "a budget that leaves a point of the space; none is left: " + "; ".join(dropped),
        )
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
