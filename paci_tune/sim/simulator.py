"""Discrete-event simulation of a pipeline schedule from a cost profile.

The simulator runs nothing new: it takes the very action lists the runtimes execute
(:func:`paci_tune.schedule.build`) and places them in time with the same replay the
emulated runtime uses to report its bubble (:func:`paci_tune.schedule.replay`). Only the
durations differ: here they come from a :class:`~paci_tune.sim.profile.Profile` instead of a
stopwatch. A schedule change therefore changes the runtimes and the prediction together.

Durations: a forward (backward) is the sum of the stage's units' forward (backward) times at the
micro-batch size; an optimizer step is the sum of the units' ``optimizer_s``; a transfer between
stages ``s`` and ``s+1`` (activation forward, gradient backward: the same size) costs
``latency + activation_bytes / bandwidth`` of stage ``s``'s last unit.

**Data parallelism** (``data_parallel = D``): D replicas of the P-stage pipeline, on P x D devices,
each fed ``b`` sequences per micro-batch. Replicas run the same schedule on the same costs, so they
stay in lock step, and one replica's timeline is the whole layout's once each stage's optimizer
step also pays the all-reduce of its gradients inside its dp group (the D copies of that stage):
a step costs ``optimizer_s + AllReduceCost.ring_s(gradient bytes, D)``, the ring formula of
:mod:`.profile`. Stages still never wait for each other at a step (PACI's point); the all-reduce
is not overlapped with the backward (the runtimes all-reduce at the step). With ``sync_steps``
(flush with global-norm clipping) the all-reduce is counted after the cross-stage barrier, though a
runtime may run it before: a little pessimistic for that one case. D = 1 adds exactly 0.
Memory is per device: each device holds one stage of one replica at micro-batch ``b``, so the
memory prediction does not depend on D. **Tied parameters** split across stages (the profile's
``tied``, :mod:`.tied`): each holder's step also pays the ring all-reduce among the holders, after its
dp all-reduce, and the holders' steps meet there (a collective); PACI refuses such a cut, as its runtime.

**Weight copies** (PACI with ``backward_weights="forward"``, :mod:`paci_tune.pipeline.versions`): a
stage clones its weights at a step that would overwrite a version an in-flight micro-batch still
references (copy on step). Which steps those are is read off the stage's own action list
(:func:`weight_copy_steps`, the same bookkeeping as the runtime's store): in steady state, every
step of a stage that holds two or more micro-batches in flight (all but the last stage at the
default cap), none at the steps of the final drain, none under a flush schedule or in ``current``
mode. Such a step costs ``optimizer_s + copy_s`` (the profile's clone time of the stage's weights,
0 for a profile that has none), and the stage's memory counts the most copies held at once
(``copies_bound`` once the run reaches its steady state). Pending evaluations that hold a version
are not modelled (the simulated lists have no evaluations).

**Stages with nothing to train** (every unit's ``trainable_bytes`` 0: frozen or parameter-free
units) take no step, all-reduce nothing, copy nothing and cross no update (drift and its bound 0);
their backward costs what the profile measured, 0 where nothing before them trains
(:mod:`.profile`), and where nothing before a cut trains the gradient sent back across it is empty
(the link's latency alone).

**The schedules built as torch's classes order them** (interleaved 1F1B, ZB-H1, ZB-V, DualPipeV:
:mod:`paci_tune.schedule.synchronous`, :mod:`paci_tune.schedule.vshape`) are timed from their own
lists. With several chunks the cut has ``v * P`` entries in model order, and the schedule's
placement says which a rank holds (the registry's ``virtual_stage``: looped, chunk ``c`` of stage
``s`` is piece ``c * P + s``; a V, rank ``s`` holds pieces ``s`` and ``2P - 1 - s``), each chunk with
that piece's forward and backward; a hop between virtual stages costs the link after the sending
piece (none between two chunks of one device: ``P = 1``, or a V's middle). A split backward's ``B``
costs the input-gradient half of the piece's backward and its ``W`` the weight-gradient half,
measured or derived (:mod:`.costs`; ``backward_split`` in the JSON says which). Their memory is
counted off the lists (:mod:`.memory`), every chunk a rank holds.

PACI never drains inside a segment: it is simulated over at least ``4 * P`` global batches, and the
steady-state step time (between optimizer steps mid-run) is reported next to the average. What it
predicts is a :class:`~.results.SimResult`. May import: :mod:`.memory`, :mod:`.profile`,
:mod:`.results`, :mod:`.tied`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config` (the layout and the
backward-weights values), :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..config.layout import Layout
from ..config.schema import BACKWARD_WEIGHTS
from ..errors import ConfigError
from ..schedule import NAMES, Action, Op, build, check_partition, drift_bound, schedule_of, stage_units
from ..schedule.replay import StageTimes, Timeline, drift_per_microbatch, peak_inflight, replay
from .memory import DEFAULT_OVERHEAD_BYTES, chunked_activations, stage_memory
from .profile import Profile
from .results import SimResult, StageResult  # what it predicts (re-exported: callers import them from here)
from .tied import tied_steps


def weight_copy_steps(actions: Sequence[Action]) -> tuple[set[int], int]:
    """Forward mode on one stage's action list: the steps (their global batch) that copy, and the most copies held.

    The runtime's bookkeeping (:class:`paci_tune.pipeline.versions.WeightVersions`) replayed on the
    list: a forward holds the current version until its backward; a step whose current version is
    still held (and not yet copied) copies it; a copy is freed with the last backward holding it.
    """
    version, peak = 0, 0
    at_forward: dict[int, int] = {}
    holders: Counter[int] = Counter()
    copies: set[int] = set()
    steps: set[int] = set()
    for act in actions:
        if act.op is Op.FORWARD:
            at_forward[act.mb] = version
            holders[version] += 1
        elif act.op is Op.BACKWARD:
            v = at_forward.pop(act.mb)
            holders[v] -= 1
            if not holders[v]:
                del holders[v]
                copies.discard(v)
        elif act.op is Op.STEP:
            if holders[version] and version not in copies:
                copies.add(version)
                steps.add(act.mb)
                peak = max(peak, len(copies))
            version += 1
    return steps, peak


def simulated_batches(schedule: str, stages: int, n_batches: int) -> int:
    """Global batches actually simulated: PACI needs a run long enough to reach its steady state."""
    return max(n_batches, 4 * stages) if schedule_of(schedule).asynchronous else n_batches


def simulate(
    layout: Layout,
    profile: Profile,
    n_batches: int = 4,
    *,
    optimizer: str = "adamw",
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    extend: bool = True,
    sync_steps: bool = False,
    backward_weights: str = "forward",
) -> SimResult:
    """Predict one layout's step time, throughput, bubble, memory and drift (module docstring).

    The layout names its cut (``layout.partition``). ``extend=False`` simulates exactly
    ``n_batches`` even for PACI (for pictures of a short run). ``sync_steps``: every stage's step
    waits for all stages' backwards of its batch, as the runtimes do for a flush schedule that clips
    the whole model's gradient norm. ``layout.data_parallel``: D replicas, each step adding the
    stage's gradient all-reduce (module docstring). ``backward_weights``: PACI's
    ``pipeline.backward_weights``; ``forward`` adds the weight copies' time and memory (module
    docstring), ``current`` (and every flush schedule) none.
    """
    if backward_weights not in BACKWARD_WEIGHTS:
        raise ConfigError("pipeline.backward_weights", backward_weights, "one of: " + ", ".join(BACKWARD_WEIGHTS))
    schedule, stages, window = layout.schedule, layout.stages, layout.window
    microbatch_size, data_parallel, inflight = layout.microbatch_size, layout.data_parallel, layout.inflight
    if schedule not in NAMES:
        raise ConfigError("pipeline.schedule", schedule, "one of: " + ", ".join(NAMES))
    spec = schedule_of(schedule)
    layout.check()
    chunks = layout.chunks
    spec.check(stages, window, chunks)
    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise ConfigError("batches", n_batches, "a positive integer")
    if layout.partition is None:
        raise ConfigError("pipeline.partition", None, "the stage cut to simulate (units per stage)")
    if layout.virtual_stages > profile.n_units >= stages:
        raise ConfigError(
            "pipeline.chunks",
            chunks,
            f"at most {profile.n_units // stages}: "
            f"{stages} stages x chunks pieces of the model's {profile.n_units} units",
        )
    sizes = check_partition(list(layout.partition), layout.virtual_stages, profile.n_units)
    layout = layout.with_partition(sizes)
    pieces = stage_units(sizes)  # per virtual stage, in model order
    held = [[pieces[spec.virtual_stage(s, c, stages)] for c in range(chunks)] for s in range(stages)]
    ranges = [range(r[0].start, r[-1].stop) if chunks == 1 else r[0] for r in held]  # one chunk: the stage
    units = [[i for r in rs for i in r] for rs in held]
    n = simulated_batches(schedule, stages, n_batches) if extend else n_batches
    lists = build(schedule, stages, window, 0, n, inflight, chunks)

    costs = profile.at(microbatch_size)
    split = profile.backward_split(microbatch_size)
    fwd = [sum(costs[i].forward_s for i in r) for r in pieces]
    bwd = [sum(costs[i].backward_s for i in r) for r in pieces]
    if spec.split_backward:  # B is the input gradient alone, W the weight gradient
        bwd = [sum(split[i][0] for i in r) for r in pieces]
    wgt = [sum(split[i][1] for i in r) for r in pieces]
    trains = [profile.trains(u) for u in units]  # else: no step, nothing to reduce, copy or drift
    reduce = [
        profile.allreduce.ring_s(profile.gradient_bytes(u), data_parallel) if t else 0.0
        for u, t in zip(units, trains, strict=True)
    ]
    tied = tied_steps(profile.tied, units)  # holder stages -> bytes they sum at each step
    if tied and spec.asynchronous:
        raise ConfigError(
            "pipeline.schedule",
            schedule,
            f"1f1b or gpipe for this cut {sizes}: stages {list(tied)} "
            "hold units sharing trainable parameters (the profile's tied), whose copies PACI's "
            "unsynchronised steps would let diverge; or a cut keeping them on one stage",
        )
    tied_s = [sum(profile.allreduce.ring_s(b, len(h)) for h, b in tied.items() if s in h) for s in range(stages)]
    opt = [
        sum(profile.units[i].optimizer_s for i in u) + ar + t for u, ar, t in zip(units, reduce, tied_s, strict=True)
    ]
    link = [profile.p2p.transfer_s(costs[r[-1]].activation_bytes) for r in pieces]
    # Across the cut after piece j a real gradient goes back only if a unit up to j trains.
    grad_link = [link[j] if profile.trains(range(r.stop)) else profile.p2p.transfer_s(0) for j, r in enumerate(pieces)]
    per_piece = {Op.FORWARD: fwd, Op.BACKWARD: bwd, Op.WEIGHT: wgt}
    copy = [profile.weight_copy_s(u) for u in units]
    kept = [
        weight_copy_steps(acts) if backward_weights == "forward" and t and spec.asynchronous else (set(), 0)
        for acts, t in zip(lists, trains, strict=True)
    ]

    def duration(s: int, act: Action) -> float:
        if act.op is Op.STEP:
            return opt[s] + (copy[s] if act.mb in kept[s][0] else 0.0)
        return per_piece[act.op][spec.virtual_stage(s, act.chunk, stages)]

    def latency(src: int, dst: int, act: Action) -> float:
        if src == dst:
            return 0.0  # two chunks of one device
        j = spec.virtual_stage(dst, act.chunk, stages)  # the receiving piece; the cut is after the one sending forward
        return grad_link[j] if act.op is Op.BACKWARD else link[j - 1]

    timeline = replay(
        lists,
        duration,
        latency,
        sync_steps=window if sync_steps else None,
        chunks=chunks,
        step_groups=list(tied),
        lead=lambda s, _: reduce[s] if tied_s[s] else 0.0,
        placement=spec.placement,
    )
    span = timeline.makespan
    if span <= 0:
        raise ConfigError("profile", "all costs zero", "a profile with some positive forward or backward time")
    steady_step, windows = _steady_state(timeline, n)

    out: list[StageResult] = []
    for s, (st, r) in enumerate(zip(timeline.stages, ranges, strict=True)):
        drift = drift_per_microbatch(lists[s]) if trains[s] else {}
        peak = peak_inflight(lists[s])
        t1, t2 = windows[s]
        activations = None
        if chunks > 1:
            activations = chunked_activations(profile, pieces, s, stages, microbatch_size, lists[s], spec.placement)
        out.append(
            StageResult(
                stage=s,
                units=r,
                busy_s=st.busy,
                idle_s=max(span - st.busy, 0.0),
                bubble_fraction=timeline.bubble(s),
                steady_bubble_fraction=_idle_share(st, t1, t2),
                peak_inflight=peak,
                memory=stage_memory(
                    profile,
                    units[s],
                    microbatch_size,
                    peak,
                    last=s == stages - 1,
                    optimizer=optimizer,
                    overhead_bytes=overhead_bytes,
                    copies=kept[s][1],
                    activations=activations,
                ),
                max_drift=max(drift.values(), default=0),
                mean_drift=sum(drift.values()) / len(drift) if drift else 0.0,
                drift_bound=drift_bound(s, stages, window) if spec.asynchronous and trains[s] else 0,
                drift_histogram=dict(Counter(drift.values())),
                allreduce_s=reduce[s],
                tied_allreduce_s=tied_s[s],
                weight_copies_made=len(kept[s][0]),
                weight_copies_peak=kept[s][1],
                copy_s=copy[s],
                chunk_units=tuple(held[s]),
            )
        )
    return SimResult(
        layout=layout,
        seq_len=profile.seq_len,
        n_batches=n,
        makespan_s=span,
        step_time_s=span / n,
        steady_step_time_s=steady_step,
        bubble_fraction=timeline.bubble_fraction,
        steady_bubble_fraction=sum(x.steady_bubble_fraction for x in out) / len(out),
        per_stage=out,
        timeline=timeline,
        backward_weights=backward_weights,
        backward_split=("measured" if profile.split_measured else "derived") if spec.split_backward else None,
        mean_costs=(sum(fwd) / stages, sum(bwd) / stages, sum(wgt) / stages),
    )


def _steady_state(timeline: Timeline, n_batches: int) -> tuple[float, list[tuple[float, float]]]:
    """Steady-state step time, and each stage's measuring window (whole optimizer-step periods).

    Each stage is measured between the ends of its optimizer steps ``k1 = n/4`` and
    ``k2 = n - 1 - n/4``, which leaves out the fill at the start and the drain at the end; every
    stage steps once per global batch, so each period is one global batch. With too few batches
    for two distinct steps, the whole run is the window.
    """
    k1, k2 = n_batches // 4, n_batches - 1 - n_batches // 4
    windows: list[tuple[float, float]] = []
    periods: list[float] = []
    for st in timeline.stages:
        ends = [end for act, _, end in st.intervals if act.op is Op.STEP]
        if k2 > k1 and len(ends) == n_batches:
            t1, t2 = ends[k1], ends[k2]
            periods.append((t2 - t1) / (k2 - k1))
        else:
            t1, t2 = 0.0, timeline.makespan
            periods.append(timeline.makespan / max(n_batches, 1))
        windows.append((t1, t2))
    return max(periods), windows


def _idle_share(st: StageTimes, t1: float, t2: float) -> float:
    """Share of ``[t1, t2]`` the stage spends not computing."""
    if t2 <= t1:
        return 0.0
    busy = sum(max(0.0, min(end, t2) - max(start, t1)) for _, start, end in st.intervals)
    return max(0.0, 1.0 - busy / (t2 - t1))
