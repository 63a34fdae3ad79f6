"""Runs of the schedules the simulator times: interleaved 1F1B and ZB-H1 train 1F1B-flush's numbers.

Every synchronous schedule computes exactly 1F1B-flush's gradients -- plain gradient accumulation
over the window, every stage stepping together after the drain -- and differs from it only in when
each stage does its work (:mod:`paci_tune.schedule.synchronous`). So a run of one is two layouts:

- the **timing layout**, the run's own config: the schedule, its chunks, and its own cut (``v * P``
  pieces for interleaved, stage ``s`` holding pieces ``s, s + P, ...``; ZB-H1's cut by the
  memory-aware partitioner with its own in-flight count). The profile clock simulates its action
  lists (:class:`~paci_tune.train.clock.ProfileClock`), so time to target, the LR schedule over a
  budget in seconds and evaluation points on the clock's grid all follow the schedule's timeline.
  Records, summaries, checkpoints' fingerprints and best.yaml name it.
- the **numerics layout** (:func:`numerics_config`): 1f1b on the same P, D, a, b, the runtime's
  stages cut contiguously -- for interleaved, numerics stage ``s`` holds the ``v`` consecutive
  pieces ``s*v .. s*v+v-1`` of the timing cut (any contiguous cut gives flush's numbers). The
  emulated runtime is built from it (:func:`numerics_run`).

The losses of such a run therefore equal a 1f1b run's of the same (P, D, a, b), seed and data on
a budget in steps; only the clock differs. That is the emulated runtime's case. On the distributed
runtime both run for real, through torch's own schedule classes on their own cut -- interleaved's
``v * P`` pieces, ``v`` to a rank (:mod:`paci_tune.pipeline.torch_schedules`): both layouts are then
the run's own, so any clock -- the wall clock too -- times the schedule that ran. May import:
:mod:`paci_tune.pipeline`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`,
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

import dataclasses

from ..config.memory import RunHardware
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..pipeline.factory import ResolvedRun, resolve_pieces, unit_costs
from ..pipeline.planning import check_budget, plan_partition
from ..schedule import FLUSH, schedule_of

NUMERICS = FLUSH
"""The schedule whose numerics a timed schedule trains."""


def is_timed(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s schedule is timed by the simulator while 1f1b computes its numbers."""
    return not schedule_of(cfg.pipeline.schedule).own_program


def trains_flush_for(cfg: RunConfig) -> bool:
    """Whether the runtime trains 1f1b's numbers for ``cfg``'s schedule while the clock times its own
    list: a timed schedule, except ZB-H1 on the distributed runtime (torch's class runs it for real)."""
    return is_timed(cfg) and not cfg.pipeline.runs_torch_schedule


def numerics_config(cfg: RunConfig) -> RunConfig:
    """The config the runtime runs for ``cfg``: ``cfg`` itself (a schedule the runtime runs for real,
    ZB-H1 on the distributed runtime included), or for a timed schedule 1f1b on the same P, D, a, b,
    its pinned cut merged ``v`` pieces to a stage (module docstring)."""
    if not trains_flush_for(cfg):
        return cfg
    p = cfg.pipeline
    partition = p.partition
    if isinstance(partition, list):
        v = p.layout.chunks
        partition = [sum(partition[s * v : (s + 1) * v]) for s in range(p.stages)]
    return dataclasses.replace(
        cfg, pipeline=dataclasses.replace(p, schedule=NUMERICS, chunks=None, partition=partition)
    )


def numerics_run(run: ResolvedRun) -> ResolvedRun:
    """``run`` as the runtime builds it: its config's numerics layout (:func:`numerics_config`)."""
    numerics = numerics_config(run.config)
    return run if numerics is run.config else dataclasses.replace(run, config=numerics)


def resolve_timed(cfg: RunConfig) -> ResolvedRun:
    """The resolved run of a timed schedule: its config with the timing cut pinned, every check of the
    numerics run it trains passed (data, model, profile, memory) on the cut the runtime will use.

    Refuses, naming the key, a layout the schedule cannot run (``pipeline.chunks``, ``pipeline.window``)
    and an interleaved model with fewer units than ``v * P`` pieces.
    """
    p = cfg.pipeline
    layout = p.layout
    schedule_of(p.schedule).check(p.stages, p.window, layout.chunks)
    # The device budget is the timed schedule's (checked here); the 1F1B numerics run stands in for it.
    unbudgeted = RunHardware()
    auto = dataclasses.replace(cfg, pipeline=dataclasses.replace(p, partition="auto"), hardware=unbudgeted)
    first = resolve_pieces(numerics_config(auto), distributed=False)  # the model, data and profile
    if first.profile is None:  # the config requires one for rst; resolve_run measures sim's first
        raise ConfigError("training.profile", None, f"a cost profile to time schedule {p.schedule} on")
    if cfg.hardware.memory is not None:
        sizes = check_budget(cfg, first.profile)  # the fastest cut under the budget
    else:
        sizes = plan_partition(cfg, unit_costs(first.model), first.profile)
    timed = dataclasses.replace(cfg, pipeline=dataclasses.replace(p, partition=sizes))
    run = resolve_pieces(numerics_config(dataclasses.replace(timed, hardware=unbudgeted)), distributed=False)
    return ResolvedRun(timed, run.source, run.model, run.profile)
