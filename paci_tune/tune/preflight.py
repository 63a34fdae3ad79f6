"""Before a search starts: every trial it can run, checked as the trial itself would check it.

A trial that refuses its configuration fails after the study has started (and a search of such
trials ends with "no finished trial" after all of them). So the search derives the run of every
point the bound space can produce -- every schedule, depth, micro-batch size and window, each LR
scale of a list or both ends of a range, each of PACI's ``backward_weights``, on the search's seed
and every confirmation seed, and at a transfer check's longer budget -- and validates it like a
trial does: the schema, the data it must draw from, the device and backend, and a given profile
against the model. A grid too large to walk is checked at its corners. The output paths are
checked too, so nothing is measured or trained for a result that cannot be written. May import:
:mod:`paci_tune.pipeline`, :mod:`paci_tune.data`, :mod:`paci_tune.model`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`,
:mod:`paci_tune.train` (a checkpoint to start from), :mod:`paci_tune.base`, :mod:`paci_tune.errors` and the tune
layer's :mod:`.space`, :mod:`.search`, :mod:`.extra`, :mod:`.study`.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

from ..base.files import check_writable
from ..config import RunConfig, derive_run
from ..config.tune import TuneConfig
from ..errors import ConfigError, shown
from .extra import confirm_seeds
from .point import TrialParams
from .search import Search
from .space import SearchSpace
from .study import storage_file

MAX_POINTS = 20_000
"""Points validated one by one; beyond this, the corners of the grid (each dimension's ends)."""


def trial_points(space: SearchSpace) -> list[TrialParams]:
    """Every point of ``space`` (an LR range at both its ends), or its corners when there are too many."""
    lr = space.lr_scale
    if space.lr_is_range:
        low, high, _ = lr  # type: ignore[misc]
        space = dataclasses.replace(space, lr_scale=(float(low), float(high)), lr_is_range=False)
    n_lr, n_bw = len(space.lr_scale or (1.0,)), max(len(space.backward_weights), 1)
    n = len(space.schedules) * len(space.stages) * len(space.microbatch_size) * max(len(space.window), 1) * n_lr * n_bw
    if n <= MAX_POINTS:
        return space.grid()

    def ends(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(sorted({min(values), max(values)})) if values else values

    corners = dataclasses.replace(
        space,
        stages=ends(space.stages),
        microbatch_size=ends(space.microbatch_size),
        window=ends(space.window),
        lr_scale=ends(space.lr_scale) if space.lr_scale else None,
    )
    return corners.grid()


def check_trials(tune: TuneConfig, space: SearchSpace, profile: str | None) -> list[RunConfig]:
    """Derive and validate every trial's run (module docstring); the first refusal names its point."""
    from ..data import load_source
    from ..data.limits import check_fits_data
    from ..model import load_model
    from ..pipeline.backend import choose_backend, visible_gpus
    from ..pipeline.checks import check_model_and_data
    from ..pipeline.factory import resolve_device
    from ..pipeline.planning import check_profile
    from ..sim.profile import Profile

    check_model_and_data(tune.run)  # the run as written (each study's first point), as `train` checks it
    check_start_checkpoints(tune)
    c = tune.search.confirm
    seeds: list[int | None] = [None, *(confirm_seeds(tune.run.training.seed, c.seeds) if c.enabled else [])]
    search = Search(tune, space, {}, None, Path("."), profile or tune.budget.profile)  # type: ignore[arg-type]
    runs: list[RunConfig] = []
    for params, seed in itertools.product(trial_points(space), seeds):
        try:
            runs.append(derive_run(search.trial_doc(params, seed)))
        except ConfigError as e:
            raise _blame(e, params, seed, space) from None
    tc = tune.search.transfer_check
    for params in trial_points(space) if tc.enabled else []:
        try:
            derive_run(search.trial_doc(params, None, tc.factor))
        except ConfigError as e:
            got = f"{e.key}: got {shown(e.value)}; allowed: {e.allowed}"
            trial = f"{got} (the trial {params.label()} at {tc.factor:g}x)"
            why = f"a factor whose long runs pass: {trial}"
            raise ConfigError("search.transfer_check.factor", tc.factor, why) from None
    first = runs[0]
    source = load_source(first.data, first.model.get("vocab_size"))
    meta = load_model(first.model, source.vocab_size, first.training.seed, indices=[])
    for params, run in zip(trial_points(space), runs[:: len(seeds)], strict=True):
        try:
            check_fits_data(
                source,
                meta.block_size,
                run.training.global_batch,
                run.pipeline.microbatch_size,
                run.training.eval_sequences,
            )
        except ConfigError as e:
            raise _blame(e, params, None, space) from None
    p = first.pipeline
    resolve_device(p.device)
    if p.runtime == "distributed":
        choose_backend(p.backend, p.device, max(space.stages), visible_gpus())
    if tune.budget.profile:
        prof = Profile.load(tune.budget.profile, "budget.profile")
        check_profile(prof, meta.n_units, meta.block_size, "budget.profile", tune.budget.profile)
        for key in sorted({r.optimizer.timing_key for r in runs}):  # every optimizer a trial trains with, timed
            prof.for_optimizer(key, "budget.profile", tune.budget.profile)
    return runs


def check_start_checkpoints(tune: TuneConfig) -> None:
    """The checkpoints the trials start from (``training.init_from``, ``search.warm_start.checkpoint``)
    exist and hold nothing but data (:func:`~paci_tune.train.checkpoint.check_files`): refused here, as
    `train` refuses them, not in every trial in turn."""
    from ..train.checkpoint import INIT_FROM, check_files, find

    if tune.run.training.init_from:
        check_files(find(Path(tune.run.training.init_from)), INIT_FROM)
    key = "search.warm_start.checkpoint"
    if tune.search.warm_start.checkpoint is not None:
        check_files(find(Path(tune.search.warm_start.checkpoint), key), key)


_FROM_POINT = {
    "optimizer.lr": "lr_scale",
    "pipeline.stages": "stages",
    "pipeline.window": "window",
    "pipeline.microbatch_size": "microbatch_size",
    "training.global_batch": "microbatch_size",
    "pipeline.backward_weights": "backward_weights",
}
"""The space's dimension behind each run key a point sets (the run as written already passed)."""


def _blame(e: ConfigError, params: TrialParams, seed: int | None, space: SearchSpace) -> ConfigError:
    """The refusal of a trial's run, named by what produced it: the space's dimension, or the seed."""
    where = f"the trial {params.label()} of space {space.name}"
    trial = f"{e.key}: got {shown(e.value)}; allowed: {e.allowed} ({where})"
    if e.key == "training.seconds":  # a search's budget: the trial's run reads it as training.seconds
        return ConfigError("budget.seconds", e.value, f"{e.allowed} (in {where})")
    if seed is not None and e.key == "training.seed":
        return ConfigError("search.confirm.seeds", seed, f"seeds whose trials pass: {trial}")
    dim = _FROM_POINT.get(e.key)
    if dim is None:
        return ConfigError(e.key, e.value, f"{e.allowed} (in {where})")
    if e.key == "training.global_batch" and space.fixed_batch is None:
        dim = "window x microbatch_size"
    value = params.lr_scale if dim == "lr_scale" else getattr(params, dim.split(" ")[-1])
    return ConfigError(f"space.{dim}", value, f"values whose trials pass: {trial}")


def check_outputs(out: str | Path | None, workdir: Path, storage_url: str) -> None:
    """The recommendation, the work folder and a SQLite or journal storage can be written (or refuse now)."""
    if out is not None:
        check_writable(out, "--out")
    check_writable(workdir / "trials", "--workdir", folder=True)
    file = storage_file(storage_url)
    if file is not None:
        check_writable(file, "--storage")
