"""Decisions made before a run starts: the stage cut, and whether the stages fit in memory.

With a cost profile (``training.profile``), ``partition: auto`` uses the measured, memory-aware
partitioner, and the run's predicted peak memory per stage is checked against the device: a
configuration that will not fit is refused with the numbers, not discovered by an OOM; PACI's
weight copies under ``pipeline.backward_weights: forward`` are part of that prediction. Without
one, the cut balances FLOP estimates and no prediction is made. ``paci-tune simulate`` cuts with the
same function, per schedule.

Data parallelism changes what one device holds only through the micro-batch: each of the P x D
devices holds one stage of one replica at micro-batch ``b``, so the cut and the per-device check
are those of one replica (the partitioner also weighs each stage's gradient all-reduce). The
emulated runtime holds all D replicas in one process, so its one-device check counts D copies of
every stage.

A schedule whose ranks hold several chunks cuts the model into ``v * P`` pieces in model order
(:func:`interleaved_cut`), placed as the schedule says (the registry's ``virtual_stage``: interleaved
1F1B's stage ``s`` holds pieces ``s, s + P, ...``, ZB-V's and DualPipeV's rank ``s`` pieces ``s`` and
``2P - 1 - s``): balanced on the profile's forward plus backward per unit, as ``paci-tune simulate``
cuts it, or on the FLOP estimates without a profile.
May import: :mod:`paci_tune.sim`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`,
:mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from ..config.layout import Layout
from ..config.memory import format_bytes
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..schedule import (
    Program,
    Schedule,
    balanced_partition,
    check_partition,
    resolve_partition,
    schedule_of,
    stage_actions,
    stage_units,
)
from ..sim.memory import (
    DEFAULT_OVERHEAD_BYTES,
    GIB,
    WEIGHT_BYTES,
    StageMemory,
    action_peak,
    chunked_activations,
    eval_transient,
    stage_copies,
    stage_memory,
    step_transient,
    train_transient,
)
from ..sim.partitioner import PartitionModel
from ..sim.partitioner import partition as profile_partition
from ..sim.profile import Profile
from ..sim.tied import TiedGroup
from .links import eval_chunk, eval_outputs_held, posted_buffers, torch_links
from .staleness import prediction_steps


def check_profile(
    profile: Profile, n_units: int, seq_len: int, key: str, where: str, tied: Sequence[TiedGroup] | None = None
) -> Profile:
    """A profile is only good for the model it was measured on: its units and its sequence length.

    ``tied``: the model's own tied groups (:func:`.tied.tied_groups`), which replace the profile's in the
    profile returned. Which units share a parameter is a fact of the model in hand, not of the machine
    the costs were measured on, and the model is what will run: an old profile without ``tied``, or one
    of an earlier version of the model, must not time the holders' all-reduce as free (or charge one that
    no longer exists). So the model wins, silently; the profile's record serves where no model is at hand.
    """
    if profile.n_units != n_units:
        raise ConfigError(key, where, f"a profile of this model's {n_units} units (it has {profile.n_units})")
    if profile.seq_len != seq_len:
        raise ConfigError(
            key,
            where,
            f"a profile measured at this model's sequence length {seq_len} (it was measured at {profile.seq_len})",
        )
    return profile if tied is None else dataclasses.replace(profile, tied=list(tied))


def load_profile(cfg: RunConfig, n_units: int, seq_len: int, tied: Sequence[TiedGroup] | None = None) -> Profile | None:
    """The run's cost profile (``training.profile``), checked against the model it is used for (its tied
    groups the model's: :func:`check_profile`)."""
    path = cfg.training.profile
    if not path:
        return None
    profile = check_profile(
        Profile.load(path, key="training.profile"), n_units, seq_len, "training.profile", path, tied
    )
    return profile.for_optimizer(cfg.optimizer.timing_key, "training.profile", str(path))  # charged its own step


def memory_available(device: torch.device, processes_here: int) -> float:
    """Bytes one stage process may use: the GPU's memory, or this machine's free RAM shared out."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(free) / max(processes_here, 1)


def predicted_memory(cfg: RunConfig, profile: Profile, sizes: Sequence[int]) -> list[int]:
    """Peak bytes per stage (per device: one stage of one replica) a budget must hold: weights, gradients,
    optimizer state, in-flight activations, under PACI with ``pipeline.backward_weights: forward`` the
    weight copies, with ``pipeline.predict_weights`` the fp32 copy of the trained weights, the largest
    temporaries of an action (where the profile measured them) and the device reserve.

    An upper bound of :func:`predicted_stage_memory`'s peak: the copies and the temporaries are counted
    on top of the most micro-batches in flight, whether or not they coincide. ``sizes`` is the run's cut:
    ``v * P`` pieces when a rank holds ``v`` chunks (:func:`stage_pieces`), whose activations are counted
    chunk by chunk off the stage's own action list (:func:`~paci_tune.sim.memory.chunked_activations`),
    as the simulator does.
    """
    p = cfg.pipeline
    v, spec = p.layout.chunks, schedule_of(p.schedule)
    pieces = [list(r) for r in stage_units(sizes)]
    out = []
    for s in range(p.stages):
        inflight = spec.inflight_cap(s, p.stages, p.window, p.inflight)
        activations = None
        if v > 1:
            lst = stage_actions(p.schedule, s, p.stages, p.window, 0, 2, chunks=v)
            activations = chunked_activations(profile, pieces, s, p.stages, p.microbatch_size, lst, spec.placement)
        copies = stage_copies(p.schedule, s, p.stages, p.window, p.inflight, backward_weights=p.backward_weights)
        units = [u for piece in stage_pieces(spec, pieces, s, p.stages) for u in piece]
        mem = stage_memory(
            profile,
            units,
            p.microbatch_size,
            inflight,
            last=s == p.stages - 1,
            optimizer=cfg.optimizer.name,
            copies=copies,
            activations=activations,
            masters=prediction_steps(p, s) > 0,
            transient=max(
                train_transient(profile, units, p.microbatch_size),
                step_transient(profile, units),
                eval_transient(profile, units, eval_chunk(cfg)),
            ),
        )
        out.append(mem.total)
    return out


def stage_pieces(spec: Schedule, pieces: Sequence[Sequence[int]], stage: int, stages: int) -> list[Sequence[int]]:
    """The pieces (each a list of units) ``stage`` holds under ``spec``'s placement, by chunk."""
    return [pieces[spec.virtual_stage(stage, c, stages)] for c in range(len(pieces) // stages)]


def predicted_stage_memory(cfg: RunConfig, profile: Profile, sizes: Sequence[int]) -> list[StageMemory]:
    """Each stage's (each rank's, all its chunks, where it holds several) predicted memory at its peak, the
    moment of its action list that holds the most (:func:`~paci_tune.sim.memory.action_peak`; the links
    between ranks: :mod:`.links`): what :attr:`~paci_tune.sim.memory.StageMemory.allocated` predicts is
    what ``torch.cuda.max_memory_allocated`` (or the CPU meter, :mod:`.meter`) measures of that stage's
    process. Evaluations at ``training.eval_microbatch_size`` count: mid-run ones after a step, and the
    drained last one.
    """
    p, t = cfg.pipeline, cfg.training
    spec = schedule_of(p.schedule)
    pieces = [list(r) for r in stage_units(sizes)]
    eval_mid_run = t.steps is None or t.eval_every < t.steps
    # the schedules built as torch's classes order them run those classes wherever they really run (the
    # emulated runtime trains their numbers as flush's and times them by the simulator): a device budget
    # holds them to torch's
    torch_run = not spec.own_program or spec.runs_torch(p.runtime, bool(p.torch_schedule))
    out = []
    for s in range(p.stages):
        units = [u for piece in stage_pieces(spec, pieces, s, p.stages) for u in piece]
        acts = stage_actions(p.schedule, s, p.stages, p.window, 0, 3, p.inflight, chunks=p.layout.chunks)
        if eval_mid_run and not torch_run:  # paci-tune's programs place evaluations themselves (PACI's undrained)
            acts = list(Program(p.schedule, s, p.stages, p.window, 0, 2, inflight=p.inflight, eval_at=lambda k: k == 1))
        base = stage_memory(
            profile,
            units,
            p.microbatch_size,
            0,
            last=s == p.stages - 1,
            optimizer=cfg.optimizer.name,
            masters=prediction_steps(p, s) > 0,
        )
        forward = spec.asynchronous and p.backward_weights == "forward"
        # torch's stages hold their own links (:func:`.links.torch_links`); paci-tune's transport posts ahead
        buffers, input_grads = torch_links(profile, pieces, s, p) if torch_run else (None, None)
        copy_bytes = sum(profile.units[i].trained_bytes for i in units) * WEIGHT_BYTES[profile.dtype] // 4
        peak = action_peak(
            profile,
            pieces,
            s,
            p.stages,
            p.microbatch_size,
            acts,
            copy_bytes=copy_bytes,
            grad_bytes=base.grads,
            forward_copies=forward,
            eval_size=eval_chunk(cfg),
            eval_after_step=eval_mid_run and torch_run,
            keeps_logits=torch_run,
            placement=spec.placement,
            input_grads=input_grads,
            eval_held=eval_outputs_held(cfg, profile, pieces, s) if torch_run else 0,
        )
        out.append(
            dataclasses.replace(
                base,
                activations=peak.activations,
                weight_copies=peak.copies * copy_bytes,
                transient=peak.transient,
                grads=base.grads if peak.grads else 0,
                buffers=posted_buffers(profile, pieces, s, p) if buffers is None else buffers,
            )
        )
    return out


def plan_partition(
    cfg: RunConfig,
    unit_costs: Sequence[float],
    profile: Profile | None,
    *,
    schedule: str | None = None,
    memory_bytes: float | None = None,
) -> list[int]:
    """Stage sizes: pinned by hand, profile-optimal within ``memory_bytes`` per device, or FLOP-balanced.

    ``schedule`` overrides the config's (the simulator cuts each schedule it compares).
    """
    p = cfg.pipeline
    name = schedule or p.schedule
    chunks = p.layout.chunks if name == p.schedule else schedule_of(name).chunks_of(None)  # p.chunks is its own
    layout = dataclasses.replace(p.layout, schedule=name, chunks=chunks)
    if isinstance(p.partition, list):
        return check_partition(p.partition, layout.virtual_stages, len(unit_costs))
    if layout.chunks > 1:
        return interleaved_cut(layout, unit_costs, profile)
    if profile is None:
        return resolve_partition("auto", unit_costs, p.stages)
    return profile_partition(
        profile, layout, memory_bytes=memory_bytes, optimizer=cfg.optimizer.name, backward_weights=p.backward_weights
    ).sizes


def interleaved_cut(layout: Layout, unit_costs: Sequence[float], profile: Profile | None) -> list[int]:
    """The ``v * P`` pieces of an interleaved layout, balanced on the profile's forward plus backward per
    unit at the layout's micro-batch size (on ``unit_costs`` without a profile); refused naming
    ``pipeline.chunks`` when the model has fewer units than pieces."""
    n, pieces = len(unit_costs), layout.virtual_stages
    if pieces > n:
        raise ConfigError(
            "pipeline.chunks",
            layout.chunks,
            f"at most {n // layout.stages}: {layout.stages} stages x chunks pieces of the model's {n} units",
        )
    if profile is not None:
        unit_costs = [c.forward_s + c.backward_s for c in profile.at(layout.microbatch_size)]
    return balanced_partition(unit_costs, pieces)


def choose_partition(
    cfg: RunConfig, unit_costs: Sequence[float], profile: Profile | None, device: torch.device, distributed: bool
) -> list[int]:
    """The run's cut, with its predicted memory checked against ``hardware.memory`` (:func:`check_budget`)
    and this machine: under a budget the fastest cut that fits it (:func:`budget_fit`), else
    :func:`plan_partition`'s, the fastest that fits this machine."""
    if profile is not None and cfg.hardware.memory is not None:
        sizes = check_budget(cfg, profile)  # the fastest cut under the budget
    else:
        limit = memory_available(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if distributed else None
        sizes = plan_partition(cfg, unit_costs, profile, memory_bytes=limit)
    if profile is not None:
        check_memory(cfg, profile, sizes, device, distributed)
    return sizes


def budget_reserve(profile: Profile) -> int:
    """What a device budget holds beyond the tensors the allocator counts (``StageMemory.overhead``): on a
    GPU the CUDA context and the caching allocator's fragmentation (:data:`~paci_tune.sim.memory.
    DEFAULT_OVERHEAD_BYTES`); nothing on a CPU profile's device, whose budget stands for the tensors a
    device would hold (what the CPU meter measures, :mod:`.meter`)."""
    return 0 if profile.device.lower().startswith("cpu") else DEFAULT_OVERHEAD_BYTES


def budget_cut(cfg: RunConfig, profile: Profile) -> list[int]:
    """The cut ``cfg``'s run would use under its ``hardware.memory``: the fastest that fits the budget, or,
    when none does, the one that needs the least memory (its peak is what the budget would have to hold);
    without a budget the fastest. A cut pinned by hand or an interleaved one is taken as it is. The cut is
    chosen on the partitioner's per-stage sum plus :func:`budget_reserve`."""
    p = cfg.pipeline
    cap = cfg.hardware.memory_bytes
    if isinstance(p.partition, list) or p.layout.chunks > 1 or cap is None:
        return plan_partition(cfg, [1.0] * profile.n_units, profile)
    model = PartitionModel(
        profile,
        p.layout,
        optimizer=cfg.optimizer.name,
        backward_weights=p.backward_weights,
        overhead_bytes=budget_reserve(profile),
    )
    try:
        return model.fastest(cap).sizes
    except ConfigError:
        return model.leanest().sizes


def budget_fit(cfg: RunConfig, profile: Profile) -> tuple[list[int], list[int]]:
    """(cut, predicted peak bytes per stage) of ``cfg`` under its ``hardware.memory``: :func:`budget_cut`, and
    each stage's peak by the validated model (:func:`budget_peaks`)."""
    sizes = budget_cut(cfg, profile)
    return sizes, budget_peaks(cfg, profile, sizes)


def budget_peaks(cfg: RunConfig, profile: Profile, sizes: Sequence[int]) -> list[int]:
    """Per stage on cut ``sizes``, the figure a device budget is held to: the validated model's allocated
    peak walked over each stage's actions (:func:`predicted_stage_memory`) plus the device's reserve
    (:func:`budget_reserve`). A cut of a schedule of ``v`` chunks a rank is ``v * P`` pieces (:func:`stage_pieces`)."""
    reserve = budget_reserve(profile)
    return [int(st.allocated + reserve) for st in predicted_stage_memory(cfg, profile, sizes)]


def unit_refusal(profile: Profile, cap: int) -> str | None:
    """Why no cut can fit ``cap`` bytes: the largest unit's weights alone exceed it (None when they do not)."""
    per = WEIGHT_BYTES[profile.dtype]
    sizes = [u.param_bytes * per // 4 for u in profile.units]
    i = max(range(len(sizes)), key=sizes.__getitem__)
    if sizes[i] <= cap:
        return None
    name = profile.units[i].name
    return f"at least the largest unit's weights, {format_bytes(sizes[i])} (unit {i} {name!r}): no stage holds less"


def check_budget(cfg: RunConfig, profile: Profile) -> list[int]:
    """The run's cut under ``hardware.memory`` (:func:`budget_fit`); refused, naming the key and what it
    would have to be, when the largest unit's weights or some stage's predicted peak exceed it."""
    cap = cfg.hardware.memory_bytes
    assert cap is not None, "check_budget needs a run with hardware.memory"
    if too_small := unit_refusal(profile, cap):
        raise ConfigError("hardware.memory", cfg.hardware.memory, too_small)
    sizes, peaks = budget_fit(cfg, profile)
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    if peaks[worst] > cap:
        p = cfg.pipeline
        raise ConfigError(
            "hardware.memory",
            cfg.hardware.memory,
            (
                f"at least {format_bytes(peaks[worst])} for {p.schedule} at P={p.stages} b={p.microbatch_size}: its "
                f"stage {worst} is predicted that on the leanest cut {sizes}; more stages, a smaller micro-batch or "
                "a schedule with fewer micro-batches in flight need less"
            ),
        )
    return sizes


def memory_refusal(
    cfg: RunConfig, profile: Profile, device: torch.device, *, distributed: bool, processes: int
) -> str | None:
    """Why :func:`choose_partition` would refuse ``cfg`` on this machine with ``processes`` here; None if it fits.

    A search asks before its trials start, so the points that cannot run are dropped from its space.
    """
    limit = memory_available(device, processes) if distributed else None
    try:
        sizes = plan_partition(cfg, [1.0] * profile.n_units, profile, memory_bytes=limit)
        check_memory(cfg, profile, sizes, device, distributed, processes=processes)
    except ConfigError as e:
        return e.allowed
    return None


def check_memory(
    cfg: RunConfig,
    profile: Profile,
    sizes: Sequence[int],
    device: torch.device,
    distributed: bool,
    processes: int | None = None,
) -> None:
    """Refuse a run whose predicted peak memory exceeds what this machine has for it.

    ``processes``: stage processes on this machine (default: torchrun's ``LOCAL_WORLD_SIZE``).
    """
    need = predicted_memory(cfg, profile, sizes)
    if distributed:
        here = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = memory_available(device, here)
        worst = max(range(len(need)), key=lambda s: need[s])
        if need[worst] > have:
            raise ConfigError(
                "pipeline.microbatch_size",
                cfg.pipeline.microbatch_size,
                f"a size whose stages fit: stage {worst} is predicted {need[worst] / GIB:.2f} GiB vs "
                f"{have / GIB:.2f} GiB available per stage process",
            )
        return
    have, d = memory_available(device, 1), cfg.pipeline.data_parallel
    if sum(need) * d > have:
        copies = f"all {len(need)} stages" + (f" x {d} replicas" if d > 1 else "")
        raise ConfigError(
            "pipeline.microbatch_size",
            cfg.pipeline.microbatch_size,
            f"a size that fits one device with {copies} (emulated): predicted "
            f"{sum(need) * d / GIB:.2f} GiB vs {have / GIB:.2f} GiB available",
        )
