"""Assemble a runtime from a run configuration: data, model units, partition, stages.

Both runtimes are built here from the same pieces, so the only thing that differs between them
is the transport. Under ``distributed`` each rank builds only its own stage's units; the built-in
GPT's units are seeded per unit, so they come out identical to the emulated runtime's. With D
data-parallel replicas each rank builds the stage its place in the mesh (:mod:`.mesh`) names, and
the emulated runtime copies every stage D times; replica r reads its own micro-batches. May import:
the pipeline layer's modules, :mod:`paci_tune.model`, :mod:`paci_tune.data`, :mod:`paci_tune.sim`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config.layout import Layout
from ..config.schema import RunConfig
from ..data import MicroBatchStream, TokenSource, ValidationSet
from ..data.stream import DEFAULT_DRAW
from ..errors import ConfigError
from ..model import LoadedModel, input_grads, load_model
from ..schedule import schedule_of, stage_units
from ..sim.profile import Profile
from .checks import check_model_and_data, check_shared_parameters
from .emulated import EmulatedRuntime
from .mesh import check_world
from .planning import choose_partition, load_profile
from .stage import Stage, compute_dtype
from .staleness import prediction_steps, stage_lr, stage_optimizer
from .tied import tied_across_stages, tied_groups, untie


@dataclass
class Setup:
    """A ready runtime and the facts about the run the training loop and reports need."""

    runtime: EmulatedRuntime | object
    source: TokenSource
    n_units: int
    unit_names: list[str]
    partition: list[int]
    device: torch.device
    precision: str
    seq_len: int
    flops_per_token: float | None
    profile: Profile | None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("pipeline.device", "cuda", "cpu or auto (no CUDA device is visible)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto``: bf16 on a GPU, fp32 on a CPU; ``fp32`` and ``bf16`` mean themselves on any device."""
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


def unit_costs(model: LoadedModel) -> list[float]:
    """Per-unit cost estimates for a cut without a profile: forward FLOPs per token (the built-in GPT's formula,
    or counted on a sample by :func:`.checks.check_units` for any other model), else parameter counts."""
    if model.flops is not None:
        return list(model.flops)
    if len(model.units) < model.n_units:  # built per rank and checked by the launcher: the cut comes pinned
        return [1.0] * model.n_units
    return [float(sum(p.numel() for p in u.parameters())) + 1.0 for _, u in sorted(model.units.items())]


@dataclass(frozen=True)
class ResolvedRun:
    """A run as it will execute, resolved once per process (:func:`paci_tune.train.run.resolve_run`).

    ``config`` has its profile named and its stage cut pinned, so every rank of a distributed run,
    and a later resume, runs the same cut; ``source``, ``model`` and ``profile`` are what resolving
    loaded, so nothing downstream loads them again. ``model`` holds the units' metadata (count,
    names, sequence length, FLOPs); its units are built only for a user entry model, and
    :func:`build_setup` builds fresh ones for the stages of its process.
    """

    config: RunConfig
    source: TokenSource
    model: LoadedModel
    profile: Profile | None

    @property
    def layout(self) -> Layout:
        """The run's layout, its cut pinned."""
        return self.config.layout


def resolve_pieces(cfg: RunConfig, *, distributed: bool, checked: bool = False) -> ResolvedRun:
    """Data source, the model's metadata, the profile and the stage cut of ``cfg``, loaded once.

    Every check that can refuse a run (data, model, depth, partition, memory, parameters shared
    across the cut) happens here, so
    the distributed launcher can run it once before starting any worker. The cut (``partition:
    auto``) is chosen here and pinned in the returned run's config. ``checked``: a worker of a launch
    that ran them on this config, its cut pinned (:func:`.checks.check_model_and_data`).
    """
    source, meta = check_model_and_data(cfg, checked=checked)  # every stage is built on this machine
    profile = load_profile(cfg, meta.n_units, meta.block_size, tied_groups(meta))
    sizes = choose_partition(cfg, unit_costs(meta), profile, resolve_device(cfg.pipeline.device), distributed)
    chunked = cfg.pipeline.runs_torch_schedule and cfg.layout.chunks > 1  # several pieces to a rank
    check_shared_parameters(meta, sizes, cfg.pipeline.schedule, chunked)
    if cfg.pipeline.partition != sizes:
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, partition=sizes))
    return ResolvedRun(cfg, source, meta, profile)


def build_setup(
    run: ResolvedRun,
    lr_at: Callable[[int], float],
    *,
    distributed: bool = False,
    progress: Callable[[int], float] | None = None,
) -> Setup:
    """Build the runtime named by the run's ``pipeline.runtime`` for this process: fresh units for its stages.

    ``lr_at(k)``: the LR of a stage's k-th step; ``progress(k)``: how far through the budget that step
    is (needed by ``pipeline.stale_lr``, :mod:`.staleness`, which scales each stage's LR by it).
    """
    cfg = run.config
    p, t = cfg.pipeline, cfg.training
    if distributed:
        import torch.distributed as dist

        from .distributed import DistributedRuntime

        check_world(dist.get_world_size(), p.stages, p.data_parallel)
        replica, stage = divmod(dist.get_rank(), p.stages)  # the mesh's layout: rank = replica * P + stage
        replicas = [replica]
        device = resolve_device(p.device, int(os.environ.get("LOCAL_RANK", "0")))
        # several chunks to a rank (torch's classes): its pieces where the schedule places them (:mod:`.distributed`)
        spec = schedule_of(p.schedule)
        mine = [spec.virtual_stage(stage, c, p.stages) for c in range(p.layout.chunks)]
    else:
        device = resolve_device(p.device)
        mine = list(range(p.stages))
        replicas = list(range(p.data_parallel))
    precision = resolve_precision(p.precision, device)
    source, sizes, profile = run.source, list(run.layout.partition or ()), run.profile
    ranges = stage_units(sizes)
    # whole: an entry function that builds only the units asked for (keyword ``units``) builds this process's
    model = load_model(cfg.model, source.vocab_size, t.seed, [i for s in mine for i in ranges[s]], whole=run.model)
    needs_grad = input_grads(model.trainable)  # per unit: whether a unit before it trains
    streams = [
        MicroBatchStream(
            source.train,
            model.block_size,
            p.microbatch_size,
            t.seed,
            replicas=p.data_parallel,
            replica=r,
            draw=cfg.data.get("draw", DEFAULT_DRAW),
        )
        for r in replicas
    ]
    val = ValidationSet(source.val, model.block_size, t.eval_sequences, t.eval_microbatch_size)
    dtype = compute_dtype(precision)

    # Tied parameters: a copy per holding stage (a rank builds its own; one process unties them), then
    # the emulated runtime's extra replicas are copies, made before any stage converts or hooks its units.
    tied = tied_across_stages(run.model, sizes)  # the whole model's ties (a rank may hold only its own units)
    built = {s: [model.units[i] for i in ranges[s]] for s in mine}
    untie(built, tied)
    unit_copies = {r: built if r == replicas[0] else copy.deepcopy(built) for r in replicas}

    def make_stage(s: int, replica: int) -> Stage:
        return Stage(
            s,
            len(ranges),  # P, or the v * P pieces of a multi-chunk cut run for real
            unit_copies[replica][s],
            window=p.window,
            optimizer=stage_optimizer(cfg.optimizer, p, s),  # its own momentum under pipeline.stage_momentum
            lr_at=stage_lr(lr_at, progress, p, s),
            device=device,
            dtype=dtype,
            backward_weights=p.backward_weights,
            input_grad=needs_grad[ranges[s].start],
            hidden=[0 < i < model.n_units - 1 for i in ranges[s]],  # Muon's units: all but the first and last
            predict=prediction_steps(p, s),
        )

    runtime: object
    if distributed:
        kind: type[DistributedRuntime] = DistributedRuntime
        if p.runs_torch_schedule:  # the schedule's torch class (the registry's runs_torch)
            from .torch_schedules import TorchScheduleRuntime

            kind = TorchScheduleRuntime
        runtime = kind(
            [make_stage(s, replicas[0]) for s in mine],
            ranges,
            streams[0],
            val,
            p.schedule,
            p.inflight,
            p.data_parallel,
            tied,
        )
    else:
        stages = [[make_stage(s, r) for s in mine] for r in replicas]
        runtime = EmulatedRuntime(stages, ranges, streams, val, p.schedule, p.inflight, tied)
    flops = None
    if model.gpt is not None:
        from ..model.gpt import model_flops_per_token

        flops = model_flops_per_token(model.gpt)
    return Setup(
        runtime, source, model.n_units, model.names, sizes, device, precision, model.block_size, flops, profile
    )
