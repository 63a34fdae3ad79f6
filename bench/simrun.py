"""What the time-to-target benches share: one run on the sim clock, and where a curve reaches a target.

A run's numerics are the configured layout's on the emulated runtime (exact: the distributed
runtime's, tested equal); only its clock is simulated, from a profile measured on this machine, so
every configuration is timed as P x D devices of its own however few cores run it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from paci_tune.base.processes import die_with_parent
from paci_tune.config import derive_run
from paci_tune.config.schema import RunConfig
from paci_tune.pipeline.planning import plan_partition
from paci_tune.sim.profile import Profile
from paci_tune.sim.simulator import simulate
from paci_tune.train.run import resolve_run, run_training
from paci_tune.tune.curves import numerics_key
from paci_tune.tune.sharing import layout_clock, replay_points


def run_pool(
    tasks: list[dict[str, Any]],
    fn: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    log: Path,
    jobs: int,
    depends: Any,
    describe: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """``fn(task)`` for every task, in ``jobs`` processes of one thread each; the results in task order.

    Small models are bound by per-op overhead, not arithmetic, so on a 2-core machine two one-thread
    runs side by side finish sooner than one two-thread run after another; the sim clock is
    unaffected by what shares the cores. Each finished run is appended to ``log`` under a key of
    the task and everything else it depends on (``depends``: the base config, the profile, the
    budget), so a killed bench resumes where it stopped and a changed one does not reuse stale runs.
    """
    done: dict[str, dict] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            done[rec["key"]] = rec
    for t in tasks:
        t["key"] = hashlib.sha256(json.dumps([depends, t], sort_keys=True, default=str).encode()).hexdigest()[:16]
    todo = [t for t in tasks if t["key"] not in done]
    print(f"{len(tasks)} runs, {len(tasks) - len(todo)} already in {log}", file=sys.stderr)
    t0 = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker, initargs=(os.getpid(),)) as pool,
        log.open("a") as out,
    ):
        futures = [pool.submit(_timed, fn, t) for t in todo]
        for i, fut in enumerate(as_completed(futures), 1):
            rec = fut.result()
            out.write(json.dumps(rec) + "\n")
            out.flush()
            done[rec["key"]] = rec
            print(f"  [{i}/{len(todo)}] {describe(rec)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return [done[t["key"]] for t in tasks]


def _timed(fn: Callable[[dict[str, Any]], dict[str, Any]], task: dict[str, Any]) -> dict[str, Any]:
    """``fn(task)`` with the seconds it took (``wall_s``), so a resumed bench can still say what its
    runs cost on this machine."""
    t0 = time.perf_counter()
    rec = fn(task)
    return {"wall_s": round(time.perf_counter() - t0, 1), **rec}


def _worker(parent: int) -> None:
    """One thread per run; and the run dies with the bench (a killed bench leaves no worker training)."""
    import torch

    die_with_parent(parent=parent)
    torch.set_num_threads(1)


def warm_checkpoint(
    base: dict[str, Any],
    steps: int,
    folder: Path,
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """The checkpoint of ``base`` trained ``steps`` global batches on 1F1B-flush (P = 1), trained once into
    ``folder`` (found there afterwards): a warm-up past the loss plateau, as a warm-started search trains it
    (:func:`paci_tune.tune.warm.warm_up_run`, LR held at its peak after its ramp). Each run then starts from
    it with ``warm_overrides``, so a bench measures the long middle of a run, not the plateau escape."""
    from paci_tune.config import derive_doc
    from paci_tune.tune.warm import ensure, warm_up_run

    doc = derive_doc(
        base, {"pipeline.stages": 1, "pipeline.partition": "auto", "hardware.memory": None, **(overrides or {})}
    )  # P = 1: a bench's warm-up holds no device budget
    ramp = doc["lr_schedule"].get("warmup_fraction", 0.0)
    done = ensure(warm_up_run(doc, steps, folder, "emulated", ramp), "--warm-start", log)
    return str(done["checkpoint"])


def warm_overrides(checkpoint: str | None) -> dict[str, Any]:
    """What a run started from a warm checkpoint changes: it starts there, at its LR peak (no second ramp)."""
    return {} if checkpoint is None else {"training.init_from": checkpoint, "lr_schedule.warmup_fraction": 0.0}


def first_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The (linearly interpolated) x -- step or clock -- where a validation curve first reaches ``target``."""
    prev = None
    for x, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(x)
            (x0, l0) = prev
            return x0 + (x - x0) * (l0 - target) / (l0 - loss)
        prev = (x, loss)
    return None


def _sim_overrides(
    base: dict[str, Any],
    profile: str,
    schedule: str,
    p: int,
    d: int,
    a: int,
    seconds: float,
    grid: int,
    overrides: dict[str, Any] | None,
) -> dict[str, Any]:
    """A (schedule, P, D, a) run on ``seconds`` of the sim clock validating ``grid`` times (the base's batch)."""
    b = base["training"]["global_batch"] // (d * a)
    return {
        "pipeline.schedule": schedule,
        "pipeline.stages": p,
        "pipeline.window": a,
        "training.clock": "sim",
        "training.profile": profile,
        "training.seconds": seconds,
        "training.steps": None,
        "training.eval_every_seconds": seconds / grid,
        "training.eval_every": 10**9,
        "training.target_val_loss": None,
        "pipeline.data_parallel": d,
        "pipeline.microbatch_size": b,
        **(overrides or {}),
    }


def _planned(base: dict[str, Any], profile: str, over: dict[str, Any]) -> tuple[RunConfig, Profile]:
    """The run with its stage cut planned on the profile, as a search's would be, and the profile its
    optimizer's step is charged on."""
    probe = derive_run(base, over)
    prof = Profile.load(profile).for_optimizer(probe.optimizer.timing_key)  # charged its own optimizer's step
    sizes = plan_partition(probe, [1.0] * prof.n_units, prof)
    return derive_run(base, {**over, "pipeline.partition": sizes}), prof


def _row(cfg: RunConfig, prof: Profile, curve: list[tuple[float, float]], steps: Any, t0: float) -> dict[str, Any]:
    """A bench's row of one run: its layout, its validation curve on its clock, its simulated step time."""
    pc = cfg.pipeline
    sizes = list(cfg.layout.partition or ())
    sim = simulate(cfg.layout, prof, 8, backward_weights=pc.backward_weights)
    return {
        "schedule": pc.schedule,
        "stages": pc.stages,
        "data_parallel": pc.data_parallel,
        "window": pc.window,
        "microbatch_size": pc.microbatch_size,
        "partition": sizes,
        "curve": curve,
        "best_val_loss": min((v for _, v in curve), default=None),
        "steps": steps,
        "step_time_s": sim.steady_step_time_s,
        "allreduce_fraction": sim.allreduce_fraction,
        "wall_s": round(time.time() - t0, 1),
    }


def train_sim(
    base: dict[str, Any],
    profile: str,
    schedule: str,
    p: int,
    d: int,
    a: int,
    *,
    seconds: float,
    grid: int,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train one (schedule, P, D, a) for ``seconds`` of the sim clock, validating ``grid`` times.

    The global batch is fixed (b = global_batch / (D a)); the stage cut is planned for D replicas at
    micro-batch b on the profile, as a search would; the LR decays over the clock's budget.
    Returns the validation curve on the clock, the steps run, and the simulated steady step time.
    """
    cfg, prof = _planned(base, profile, _sim_overrides(base, profile, schedule, p, d, a, seconds, grid, overrides))
    evals: list[tuple[float, float]] = []

    def on_record(rec: dict[str, Any]) -> None:
        if rec.get("event") == "eval":
            evals.append((float(rec["clock"]), float(rec["val_loss"])))

    t0 = time.time()
    summary = run_training(resolve_run(cfg), on_record=on_record) or {}
    return _row(cfg, prof, evals, summary.get("steps"), t0)


Layout = tuple[str, int, int, int, dict[str, Any]]
"""(schedule, P, D, a, the layout's own overrides): one member of a class of runs with one curve."""


def curve_class(
    base: dict[str, Any],
    profile: str,
    layout: Layout,
    *,
    seconds: float,
    grid: int,
    overrides: dict[str, Any] | None = None,
) -> str | None:
    """The numerics key of a layout's run as :func:`train_shared` trains it (:func:`paci_tune.tune.curves.numerics_key`
    at a common horizon): the layouts of one key train one curve."""
    schedule, p, d, a, own = layout
    over = _sim_overrides(base, profile, schedule, p, d, a, seconds, grid, {**(overrides or {}), **own})
    cfg, _ = _planned(base, profile, over)
    return numerics_key(derive_run(cfg.to_doc(), {**SHARED, "lr_schedule.horizon_steps": 1}))


SHARED = {"data.draw": "sequence", "training.eval_every_seconds": None}
"""What makes a run's curve its numerics' alone (:mod:`paci_tune.tune.sharing`), besides a horizon in steps."""


def train_shared(
    base: dict[str, Any],
    profile: str,
    layouts: list[Layout],
    *,
    seconds: float,
    grid: int,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train the one curve of ``layouts`` (one :func:`curve_class`) once, and read each layout's own sim clock
    against it: a row per layout, as :func:`train_sim` gives, the way a search answers shared trials.

    The LR decays over the class horizon in steps (the most steps a layout fits in ``seconds``), the data
    are drawn sequence by sequence, and the layout with the most steps trains, validating every
    ``horizon // grid`` steps; each layout then reads the validations of the steps its budget holds at
    its own clock (:func:`paci_tune.tune.sharing.replay_points`). One layout alone is a run with its LR
    over its own steps.
    """
    t0 = time.time()
    runs = []
    for schedule, p, d, a, own in layouts:
        cfg, prof = _planned(
            base, profile, _sim_overrides(base, profile, schedule, p, d, a, seconds, grid, {**(overrides or {}), **own})
        )
        runs.append((cfg, prof, layout_clock(cfg, prof)[1]))
    horizon = max(1, max(n for _, _, n in runs))
    every = max(1, horizon // grid)
    shared = {**SHARED, "lr_schedule.horizon_steps": horizon, "training.eval_every": every}
    runs = [(derive_run(cfg.to_doc(), shared), prof, n) for cfg, prof, n in runs]
    keys = {numerics_key(derive_run(cfg.to_doc(), {"lr_schedule.horizon_steps": 1})) for cfg, _, _ in runs}
    if len(keys) != 1:
        raise ValueError(f"layouts of {len(keys)} curves given as one class: {layouts}")
    lead, prof, _ = max(runs, key=lambda r: r[2])
    by_step: dict[int, float] = {}
    first: list[int] = []

    def on_record(rec: dict[str, Any]) -> None:
        if rec.get("event") == "start":
            first.append(int(rec["resumed_at"]))
        elif rec.get("event") == "eval" and rec["step"] % every == 0 and not rec.get("drained"):
            by_step[int(rec["step"])] = float(rec["val_loss"])

    run_training(resolve_run(lead), on_record=on_record)
    rows = []
    for cfg, prof, _ in runs:
        replay = replay_points(cfg, prof, first[0], every)
        curve = [(clock, by_step[step]) for step, clock in replay.points if step in by_step]
        rows.append(
            {
                **_row(cfg, prof, curve, first[0] + replay.steps, t0),
                "horizon_steps": horizon,
                "eval_every": every,
                "trained": cfg is lead,
            }
        )
    return rows
