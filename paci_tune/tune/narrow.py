"""Narrowing a bound space: the points memory, staleness, shared parameters or a recipe pair rule out.

Each function takes a :class:`~.space.SearchSpace` and returns it less some points, every one listed
with its reason in ``dropped`` (a proposal of one is answered unrun, :meth:`~.space.SearchSpace.why_not`);
one that would leave a study nothing is a ConfigError naming the key that did it. May import:
:mod:`paci_tune.config`, :mod:`paci_tune.schedule`, :mod:`paci_tune.errors` and the tune layer's
:mod:`.space`, :mod:`.point` and :mod:`.recipes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..config import derive_run
from ..config.memory import format_bytes
from ..errors import ConfigError
from ..schedule import SYNCHRONOUS, drift_bound, schedule_of
from .point import MemoryDrop, TrialParams
from .recipes import recipe_overrides
from .space import SearchSpace


def restrict(space: SearchSpace, why_not: Callable[[TrialParams], str | None]) -> SearchSpace:
    """``space`` less the points ``why_not`` refuses (it returns the reason; None keeps the point).

    The setup's memory check uses it; a check that leaves nothing is a ConfigError on
    ``hardware.devices`` listing every reason. A point is asked with the space's first schedule the
    runtimes run (not one only the simulator times: their memory is the simulator's) and,
    for PACI, its lightest ``backward_weights`` (``current`` holds no weight copy when it is a choice):
    a point stays when it fits one way; a heavier choice that does not fit is refused by its trial's
    own check.
    """
    schedule = next((s for s in space.schedules if schedule_of(s).own_program), space.schedules[0])
    bws = space.backward_weights_of(schedule)
    bw = "current" if "current" in bws else bws[0]
    kept, dropped = set(), list(space.dropped)
    for p, a, b in sorted(space.points):
        reason = why_not(TrialParams(schedule, p, a, b, 1.0, space.data_parallel(p), bw))
        if reason is None:
            kept.add((p, a, b))
        else:
            dropped.append(reason)
    if not kept:
        raise ConfigError(
            "hardware.devices",
            space.devices,
            "a budget that leaves a point of the space; none is left: " + "; ".join(dropped),
        )
    return dataclasses.replace(
        space,
        points=frozenset(kept),
        dropped=tuple(dropped),
        stages=tuple(sorted({p for p, _, _ in kept})),
        microbatch_size=tuple(sorted({b for _, _, b in kept})),
    )


def drop_over_memory(
    space: SearchSpace, predict: Callable[[TrialParams], MemoryDrop], cap: int, written: Any
) -> SearchSpace:
    """``space`` less what ``hardware.memory`` (``cap`` bytes; ``written`` as the file says it) rules out.

    ``predict`` gives a point's predicted peak (a :class:`~.point.MemoryDrop` whether or not it fits).
    Every schedule's variants of every point are asked (backward weights, chunks, optimizer and staleness
    recipes: each changes what a stage holds). A variant over the cap is answered unrun
    (:meth:`SearchSpace.why_not`) and listed in ``dropped``; a point no schedule can run leaves the
    space, so no sampler proposes it. A synchronous schedule left with nothing leaves the search (listed in
    ``dropped``: the shipped spaces name every schedule, and one that holds more per device may fit nowhere);
    PACI left with nothing, or every synchronous schedule, is a ConfigError on ``hardware.memory`` naming
    the smallest predicted peak of its points (what the budget would have to hold).
    """
    over: list[MemoryDrop] = []
    fits: set[tuple[int, int, int]] = set()
    left_out: dict[str, MemoryDrop] = {}
    for schedule in space.schedules:
        variants = [q for q in space.grid_variants(schedule) if space.why_not(q) is None]
        predicted = [predict(q) for q in variants]
        if predicted and all(d.peak_bytes > cap for d in predicted):
            left_out[schedule] = min(predicted, key=lambda d: d.peak_bytes)
        over += [d for d in predicted if d.peak_bytes > cap]
        fits |= {(d.params.stages, d.params.window, d.params.microbatch_size) for d in predicted if d.peak_bytes <= cap}
    sync = [s for s in space.schedules if s in SYNCHRONOUS]
    for schedule, least in left_out.items():
        if schedule not in SYNCHRONOUS or all(s in left_out for s in sync):  # no PACI, or no baseline left
            raise ConfigError(
                "hardware.memory",
                written,
                f"at least {format_bytes(least.peak_bytes)}, the smallest "
                f"predicted peak of {schedule}'s points ({least.params.label()}, stage {least.stage}); "
                f"none of them fits {format_bytes(cap)}",
            )
    gone = tuple(
        f"{s}: left out of the search, none of its points fits {format_bytes(cap)} (its leanest, "
        f"{d.params.label()}, is predicted at {format_bytes(d.peak_bytes)} on stage {d.stage})"
        for s, d in left_out.items()
    )
    points = {(p, a, b) for p, a, b in space.points if (p, a, b) in fits} if space.points else fits
    return dataclasses.replace(
        space,
        points=frozenset(points),
        over_memory=tuple(over),
        memory_bytes=cap,
        schedules=tuple(s for s in space.schedules if s not in left_out),
        dropped=space.dropped + tuple(d.reason() for d in over) + gone,
        stages=tuple(sorted({p for p, _, _ in points})),
        microbatch_size=tuple(sorted({b for _, _, b in points})),
    )


def skip_stale(space: SearchSpace, max_drift: int | None) -> SearchSpace:
    """``space`` with PACI skipping its points whose drift bound ceil((P-1)/a) exceeds ``max_drift``.

    Why: where a map of the regime (``bench/stat_map.py``) shows that above some staleness PACI needs
    more steps to a loss than the bubble it removes can pay for, a trial there is a trial wasted.
    Flush has no staleness and keeps every point; the skipped ones are listed in ``dropped`` and a
    proposal of one is answered unrun (:meth:`SearchSpace.why_not`). ``None`` (the default: the
    project's own map found no such bound) keeps every point. A bound that leaves PACI nothing is a
    ConfigError naming the key.
    """
    if max_drift is None or space.paci is None:
        return space
    bounds = [drift_bound(0, p, a) for p, a, _ in space.points]
    if bounds and min(bounds) > max_drift:
        raise ConfigError(
            "search.paci_max_drift",
            max_drift,
            f"null, or at least {min(bounds)}: every PACI point of the space has a larger drift bound",
        )
    out = dataclasses.replace(space, paci_max_drift=max_drift)
    stale = [(p, a, b) for p, a, b in sorted(space.points) if out._stale(p, a)]
    dropped = [f"{space.paci} P={p} D={space.data_parallel(p)} a={a} b={b}: {out._stale(p, a)}" for p, a, b in stale]
    return dataclasses.replace(out, dropped=space.dropped + tuple(dropped))


def skip_untimed(space: SearchSpace, wall_emulated: bool) -> SearchSpace:
    """A shipped space without the schedules only the simulator times (built as torch's classes order them) where
    the trials run on the wall clock on the emulated runtime: there they have no time of their own. A shipped
    space names every synchronous schedule the layers support; a user's own space that names them there is
    refused when the file is read (:func:`paci_tune.config.tune.check_timed_schedules`)."""
    timed = [s for s in space.schedules if not schedule_of(s).own_program]
    if not wall_emulated or not timed:
        return space
    why = (
        f"{' and '.join(timed)}: no trial of theirs runs on the wall clock on the emulated runtime (the "
        "simulator times them on the sim and rst clocks; they run for real on the distributed runtime)"
    )
    kept = tuple(s for s in space.schedules if s not in timed)
    return dataclasses.replace(space, schedules=kept, dropped=(*space.dropped, why))


def skip_tied(space: SearchSpace, tied: str | None) -> SearchSpace:
    """``space`` with PACI skipping its points of two or more stages when the model's units share ``tied``.

    ``tied`` names a trainable parameter held by more than one unit (None: none is). PACI refuses a
    cut that splits one across stages (:func:`paci_tune.pipeline.checks.check_shared_parameters`);
    a trial's cut is chosen when it starts (``partition: auto``), so every PACI point that has a cut
    at all is skipped up front rather than refused mid-search. Flush sums a tied parameter's gradient
    across stages and keeps every point. A space that leaves PACI no point (no P = 1) is a ConfigError.
    """
    if tied is None or space.paci is None:
        return space
    out = dataclasses.replace(space, paci_tied=tied)
    if all(p >= 2 for p in space.stages):
        raise ConfigError(
            "space.schedules",
            list(space.schedules),
            f"schedules without paci, or stages including 1: "
            f"{out._tied(2)}, and every point of the space has 2 or more stages",
        )
    dropped = [f"{space.paci} P={p} D={space.data_parallel(p)}: {out._tied(p)}" for p in space.stages if p >= 2]
    return dataclasses.replace(out, dropped=space.dropped + tuple(dropped))


def skip_incompatible(space: SearchSpace, run_doc: dict[str, Any]) -> SearchSpace:
    """``space`` with PACI skipping the optimizer and staleness recipe pairs its run refuses: a stage
    momentum that is not above the optimizer's own first-moment coefficient (it would lower it). The
    run's own validation decides, so the rule is the config's. A space whose every pair is refused is a
    ConfigError naming ``space.staleness``."""
    paci = space.paci
    if paci is None or not space.staleness:
        return space
    refused: dict[tuple[str | None, str], str] = {}
    as_paci = {"pipeline.schedule": paci, "pipeline.torch_schedule": False, "pipeline.chunks": None}
    for opt in space.optimizers_of(paci):
        for stale in space.staleness:
            try:
                derive_run(run_doc, {**as_paci, **recipe_overrides(opt, stale)})
            except ConfigError as e:
                refused[(opt, stale)] = f"{e.key}: {e.allowed}"
    if len(refused) == len(space.optimizers_of(paci)) * len(space.staleness):
        raise ConfigError(
            "space.staleness",
            list(space.staleness),
            "recipes the run accepts with some optimizer "
            "of the space; every pair was refused: " + "; ".join(refused.values()),
        )
    dropped = [f"{paci} [{o or 'its own optimizer'}] +{s}: {why}" for (o, s), why in refused.items()]
    return dataclasses.replace(space, incompatible=frozenset(refused), dropped=space.dropped + tuple(dropped))
