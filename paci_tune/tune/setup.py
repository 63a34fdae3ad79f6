"""Binding a search file to this machine: its space, its sim-clock profile, its start points.

Shared by ``paci-tune search`` (:mod:`.session`) and the benchmark that replays searches against a
full grid. May import: :mod:`paci_tune.calibrate`, :mod:`paci_tune.pipeline`, :mod:`paci_tune.model`,
:mod:`paci_tune.data`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`
and the tune layer's :mod:`.space`, :mod:`.narrow`, :mod:`.point`, :mod:`.recipes` and :mod:`.study`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base.processes import cpu_count
from ..base.shipped import resolve_path
from ..config import derive_run
from ..config.tune import TuneConfig
from ..errors import ConfigError
from .point import MemoryDrop, TrialParams
from .space import SearchSpace

Log = Callable[[str], None]


def bind_space(tune: TuneConfig) -> SearchSpace:
    """The space file, constrained by this run's global batch, model depth and device budget.

    On the wall clock the budget's devices must exist here: each trial runs P x D processes.
    """
    from ..pipeline.factory import resolve_pieces
    from .narrow import skip_incompatible, skip_stale, skip_tied, skip_untimed
    from .space import load_space

    devices = tune.hardware.devices
    if devices is None:
        raise ConfigError("hardware.devices", None, "the device budget of every trial, a positive integer")
    if tune.budget.clock == "wall" and devices > (have := _devices(tune)):
        kind = "GPUs" if _uses_gpus(tune) else "CPU cores"
        raise ConfigError(
            "hardware.devices",
            devices,
            f"at most the {have} {kind} of this machine: on the wall "
            "clock every trial runs P x D = hardware.devices processes here (the sim clock "
            "simulates a larger budget)",
        )
    one_stage = derive_run(
        tune.run_doc, {"pipeline.stages": 1, "pipeline.data_parallel": 1, "pipeline.partition": "auto"}
    )
    meta = resolve_pieces(one_stage, distributed=True).model
    space = load_space(
        tune.search.space,
        global_batch=tune.run.training.global_batch,
        n_units=meta.n_units,
        max_stages=None,
        devices=devices,
        distributed=trial_runtime(tune) == "distributed",
    )
    space = skip_untimed(space, tune.budget.clock == "wall" and trial_runtime(tune) == "emulated")
    space = skip_tied(skip_stale(space, tune.search.paci_max_drift), _tied(meta))
    return skip_incompatible(space, tune.run_doc)


def _tied(meta: Any) -> str | None:
    """The first trainable parameter that units of the model share, named by every unit's name for it."""
    from ..model.loader import model_ties

    for tie in model_ties(meta):  # the built-in GPT ties nothing
        if tie.trainable:
            return " and ".join(f"unit {u}'s {n!r}" for u, n in zip(tie.units, tie.names, strict=True))
    return None


def untie_note(tune: TuneConfig) -> dict[str, str]:
    """``model.untie``'s cost (``untie: +N parameters (...)``) for best.yaml's provenance; nothing where it is off."""
    run = tune.run
    if not run.model.get("untie"):
        return {}
    from ..data import load_source
    from ..model import load_model

    source = load_source(run.data, run.model.get("vocab_size"))
    meta = load_model(run.model, source.vocab_size, run.training.seed, indices=[])
    return {"untie": meta.untied} if meta.untied else {}


def trial_runtime(tune: TuneConfig) -> str:
    """The runtime trials run on: the hardware section's, else distributed on the wall clock, emulated otherwise."""
    return tune.hardware.runtime or ("distributed" if tune.budget.clock == "wall" else "emulated")


def point_run(tune: TuneConfig, q: TrialParams, runtime: str) -> Any:
    """The run a point's trial makes on ``runtime``, as a memory check reads it: the cut left to the
    planner, the in-flight depth the schedule's own, on a profile clock where the search times its trials on
    one (zb-h1 and interleaved on the emulated runtime exist only there; memory does not read the clock)."""
    over = {**q.overrides(), "pipeline.partition": "auto", "pipeline.runtime": runtime, "pipeline.inflight": None}
    if tune.budget.clock != "wall":
        over["training.clock"] = "sim"
    return derive_run(tune.run_doc, over)


def drop_unfit(tune: TuneConfig, space: SearchSpace, profile_path: str | None) -> SearchSpace:
    """The space less the points the memory check would refuse (with the reasons kept in ``dropped``).

    The same check a trial's run makes before it starts (:func:`paci_tune.pipeline.planning.memory_refusal`):
    per device on the distributed runtime (P x D processes here), all stages of all D replicas in
    one process on the emulated one. Without a profile there is no prediction, and nothing is dropped.
    """
    if profile_path is None:
        return space
    from ..pipeline.factory import resolve_device
    from ..pipeline.planning import memory_refusal
    from ..sim.profile import Profile
    from .narrow import restrict

    profile = Profile.load(profile_path, "budget.profile")
    runtime = trial_runtime(tune)
    device = resolve_device(tune.hardware.device or tune.run.pipeline.device)

    def why_not(q: Any) -> str | None:
        cfg = point_run(tune, q, runtime)
        reason = memory_refusal(cfg, profile, device, distributed=runtime == "distributed", processes=q.devices)
        return None if reason is None else f"P={q.stages} D={q.data_parallel} b={q.microbatch_size}: {reason}"

    return restrict(space, why_not)


def drop_over_budget(tune: TuneConfig, space: SearchSpace, profile_path: str | None) -> SearchSpace:
    """The space less every (schedule, point) whose predicted peak exceeds ``hardware.memory``.

    Each is predicted on the cut its trial would run (:func:`paci_tune.pipeline.planning.budget_fit`: the
    fastest that fits, else the leanest), per device, whichever runtime trains it: the budget is the
    memory of the devices the pipeline stands for. A budget below the model's largest unit is refused
    first, naming the key (no cut can help). Without a budget nothing changes.
    """
    cap = tune.run.hardware.memory_bytes
    if cap is None or profile_path is None:
        return space
    from ..pipeline.planning import budget_fit, unit_refusal
    from ..sim.profile import Profile
    from .narrow import drop_over_memory

    profile = Profile.load(profile_path, "budget.profile")
    if too_small := unit_refusal(profile, cap):
        raise ConfigError("hardware.memory", tune.run.hardware.memory, too_small)
    runtime = trial_runtime(tune)

    def predict(q: TrialParams) -> MemoryDrop:
        sizes, peaks = budget_fit(point_run(tune, q, runtime), profile)
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        return MemoryDrop(q, peaks[worst], worst, tuple(sizes), cap)

    return drop_over_memory(space, predict, cap, tune.run.hardware.memory)


AUTO_JOBS = 4
"""``search.jobs: auto``'s most trials side by side: a small model's op uses a few threads well, not many."""


def side_by_side(tune: TuneConfig, space: SearchSpace | None = None, profile_path: str | None = None) -> int:
    """Trials one worker runs at once (``search.jobs``, ``auto`` by default; :mod:`.lanes`).

    ``auto`` runs several only where they cannot disturb each other's results or timing: on the sim and
    rst clocks, on the emulated runtime, on CPUs, one per core up to :data:`AUTO_JOBS`, and no more than
    this machine's free memory holds of the space's largest trial (:func:`trials_in_memory`). One trial's
    small ops leave cores idle that another trial can use: on the example's tiny GPT (2 cores), two
    one-thread runs side by side finished 1.28x as many runs per second as one two-thread run, and a
    one-thread trial spends less CPU time than a two-thread one. A wall-clock trial times itself
    (``search.jobs`` > 1 is refused there), trials on a GPU would share it, and a distributed trial is
    already P x D processes.
    """
    jobs = tune.search.jobs
    if jobs != "auto":
        return int(jobs)
    if tune.budget.clock == "wall" or trial_runtime(tune) != "emulated" or _uses_gpus(tune):
        return 1
    most = max(1, min(cpu_count(), AUTO_JOBS))
    if most > 1 and space is not None and profile_path is not None:
        most = min(most, trials_in_memory(tune, space, profile_path))
    return most


def trials_in_memory(tune: TuneConfig, space: SearchSpace, profile_path: str) -> int:
    """How many emulated trials of the space's largest point this machine's free RAM holds at once (at least 1).

    An emulated trial holds all P stages of all D replicas in one process: the prediction the memory
    check refuses one trial by (:func:`paci_tune.pipeline.planning.check_memory`), here for several.
    """
    import torch

    from ..pipeline.planning import memory_available, plan_partition, predicted_memory
    from ..sim.profile import Profile

    profile = Profile.load(profile_path, "budget.profile")
    worst = 0
    for schedule in space.schedules:
        for p, a, b in space.points:
            q = TrialParams(
                schedule,
                p,
                a,
                b,
                1.0,
                space.data_parallel(p),
                space.backward_weights_of(schedule)[0],
                space.chunks_of(schedule)[0],
            )
            if space.why_not(q) is not None:
                continue  # a point its study never runs
            cfg = point_run(tune, q, "emulated")
            sizes = plan_partition(cfg, [1.0] * profile.n_units, profile)
            worst = max(worst, sum(predicted_memory(cfg, profile, sizes)) * cfg.pipeline.data_parallel)
    return max(1, int(memory_available(torch.device("cpu"), 1) // max(worst, 1)))


def _uses_gpus(tune: TuneConfig) -> bool:
    from ..pipeline.backend import visible_gpus

    return tune.hardware.device != "cpu" and visible_gpus() > 0


def _devices(tune: TuneConfig) -> int:
    from ..pipeline.backend import visible_gpus

    n_gpus = visible_gpus()
    if tune.hardware.device != "cpu" and n_gpus:
        return n_gpus
    return cpu_count()


def profile_for(tune: TuneConfig, space: Any, work: Path, log: Log | None = None) -> str | None:
    """The cost profile every trial's sim/rst clock reads: given, or measured once per search.

    Measured at every micro-batch size of the space, with the step of every optimizer the space
    names, and kept in the work folder, so a resumed search times its trials exactly as before.
    """
    b = tune.budget
    if b.clock == "wall" and tune.run.hardware.memory is None:
        return None  # the wall clock times itself; a device budget still needs a prediction (its profile)
    if b.profile:
        found = resolve_path(b.profile)  # profiles/tiny-gpt.yaml: the shipped reference when not here
        if not found.is_file():
            raise ConfigError("budget.profile", b.profile, "an existing profile file (paci-tune calibrate)")
        return str(found.resolve())
    from ..calibrate.cache import measured_profile
    from .recipes import recipe_overrides

    optimizers = [derive_run(tune.run_doc, recipe_overrides(o, None)).optimizer for o in space.optimizers]
    _, path = measured_profile(
        tune.run,
        microbatch_sizes=list(space.microbatch_size),
        path=work / "profile.yaml",
        log=log,
        optimizers=optimizers,
    )  # every optimizer of the space timed
    return str(path)


def fingerprint(tune: TuneConfig, space: Any) -> dict[str, Any]:
    """What makes two runs of ``search`` the same search (a resume must match it)."""
    run = hashlib.sha256(json.dumps(tune.run_doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    out = {
        "run": run,
        "space": space.describe(),
        "target": tune.target.value,
        "budget": [tune.budget.clock, tune.budget.seconds, tune.budget.grid],
        "sampler": tune.search.sampler,
        "pruner": tune.search.pruner,
    }
    if tune.search.share_curves and tune.budget.clock != "wall" and tune.budget.seconds is not None:
        out["share_curves"] = True  # absent otherwise: a search from before sharing does not resume with it
        if tune.search.validate_near_target:  # likewise: stored curves were validated at every grid point
            out["validate_near_target"] = True
    if tune.search.strategy != "sample":  # absent otherwise: a sampled search's stored fingerprint stays the same
        out["strategy"] = [tune.search.strategy, tune.search.verify_z]
    if tune.search.warm_start.enabled:  # absent otherwise: a cold search's stored fingerprint stays the same
        out["warm_start"] = tune.search.warm_start.describe()
    return out


def enqueue_start_points(tune: TuneConfig, space: Any, studies: dict[str, Any]) -> None:
    """Start each new study from the configuration the user wrote, when it is in the space;
    a grid search queues its whole grid instead, and a planned one (``search.strategy: predict``) nothing:
    its planner picks every trained point (:mod:`.planner`)."""
    if tune.search.strategy == "predict":
        return
    if tune.search.sampler == "grid":
        from .study import enqueue_grid

        for schedule, study in studies.items():
            if not study.get_trials(deepcopy=False):
                enqueue_grid(study, space, schedule, tune.search.seed)
        return
    p = tune.run.pipeline
    point = {"stages": p.stages, "microbatch_size": p.microbatch_size}
    if space.fixed_batch is None:
        point["window"] = p.window
    if p.stages not in space.stages or p.microbatch_size not in space.microbatch_size:
        return
    if space.fixed_batch is None and p.window not in space.window:
        return
    from .point import TrialParams

    a = space.window_of(p.stages, p.microbatch_size) if space.fixed_batch is not None else p.window
    if space.lr_scale is not None:
        if not space.lr_is_range and 1.0 not in space.lr_scale:
            return
        point["lr_scale"] = 1.0
    for schedule, study in studies.items():
        # PACI's backward_weights: the file's when the study tunes it, the space's fixed one, or None (the run's)
        bws = space.backward_weights_of(schedule)
        bw = p.backward_weights if p.backward_weights in bws else bws[0]
        tuned = {"backward_weights": bw} if space.tunes_backward_weights(schedule) else {}
        vs = space.chunks_of(schedule)  # interleaved's v: the file's when the space has it, else the first
        v = p.layout.chunks if p.layout.chunks in vs else vs[0]
        tuned = {**tuned, "chunks": v} if space.tunes_chunks(schedule) else tuned
        # the recipes: one of the file's own optimizer when the space has one, else the first; staleness off
        opts, stale = space.optimizers_of(schedule), space.staleness_of(schedule)
        opt = next((o for o in opts if o is not None and o.split(" ")[0] == tune.run.optimizer.name), opts[0])
        st = "off" if "off" in stale else stale[0]
        tuned = {
            **tuned,
            **({"optimizer": opt} if len(opts) > 1 else {}),
            **({"staleness": st} if len(stale) > 1 else {}),
        }
        params = TrialParams(
            schedule, p.stages, a, p.microbatch_size, 1.0, space.data_parallel(p.stages), bw, v, opt, st
        )
        # not a point under the device budget, or (PACI) too stale: that study starts from the sampler
        if not study.get_trials(deepcopy=False) and space.why_not(params) is None:
            study.enqueue_trial({**point, **tuned}, skip_if_exists=True)
