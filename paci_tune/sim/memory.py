"""Predicted peak memory of a pipeline stage, from a cost profile.

**Two figures** (issue 38). :attr:`StageMemory.allocated` is what the allocator counts at the stage's
peak -- every tensor: weights, masters, gradients, optimizer state, in-flight activations, weight
copies, the transport's receive buffers and the temporaries of the action in progress -- and is what
``torch.cuda.max_memory_allocated`` measures of the stage's process (or, on a CPU, the runtime's meter,
:mod:`paci_tune.pipeline.meter`). :attr:`StageMemory.total` adds ``overhead``, a fixed device reserve
outside the allocator's count (:data:`DEFAULT_OVERHEAD_BYTES`: fragmentation, cached blocks; on a GPU
the CUDA context comes on top): what a device budget must hold. Per stage against measurement on the
distributed runtime, ``allocated`` is within 10% for the schedules of ``bench/memory_model.py``
(docs/benchmarks.md, "Memory model against measurement").

**The moment of the peak** (:func:`action_peak`, what :func:`paci_tune.pipeline.planning.predicted_stage_memory`
predicts): the stage's action list is walked, and at each action the parts that are live then are
added up -- micro-batches in flight, the window's gradients only from its first backward to its step
(the step frees them: a GPipe stage's forwards run with none), weight copies only while a micro-batch
forwarded on an older version is in flight, and the action's own temporaries: a training unit's
``transient_bytes`` at a forward or backward (the head's logits' gradient and softmax are the large
ones), the optimizer step's ``step_bytes`` at a step, an evaluation's ``eval_bytes`` at
``training.eval_microbatch_size`` after a step (or, at PACI's later stages, after a forward) and at
the drained end. The three are measured per unit by ``paci-tune calibrate``
(:func:`paci_tune.calibrate.units.measure_transients`); a profile without them counts none (as
before: the reserve was meant to hold them). The GPU check's finding (docs/gpu-check/gpu_check.log)
that GPT-2 small, P = 4 emulated on one H200 in bf16, peaked at the same 9.91 GiB under PACI and 1F1B
is this: its last, drained evaluation forwards 16 sequences of 1024 tokens through the head at once
(``eval_microbatch_size`` 32 > the 16 ``eval_sequences``), and the bf16 logits (16 x 1024 x 50304 x 2
bytes: 1.5 GiB), their fp32 copy for the loss (3.1 GiB) and its log-softmax (3.1 GiB) are 7.7 GiB over
the 1.6 GiB of bf16 weights, fp32 masters and AdamW state: ~9.3 GiB, the largest moment of both
schedules (a training micro-batch of 4 sequences makes a quarter of that), and none of it was in the
model.

The upper bound :func:`stage_memory` composes without the walk (``predicted_memory``'s budget) is the sum of

- its weights: fp32 (``param_bytes``, 4 bytes per parameter by the profile's convention), or in a
  bf16 profile bf16 weights (half of ``param_bytes``) *plus* fp32 master copies of the trainable
  ones (``trainable_bytes``) that the optimizer steps (:mod:`paci_tune.pipeline.optim`),
- the trainable weights' gradients, accumulated in fp32 in both precisions (``trainable_bytes``,
  kept between backwards of a window),
- the optimizer state, fp32 in both: AdamW keeps two moments per trainable parameter
  (2x ``trainable_bytes``), SGD with momentum one. Frozen parameters (``requires_grad=False``) have
  no gradient, no master and no optimizer state; ``trainable_bytes`` is ``param_bytes`` in a
  profile that does not give it (:mod:`.profile`),
- the activations of every micro-batch in flight (forward done, backward pending): autograd's
  saved tensors of the stage's units (``saved_bytes``), plus the stage's output, which the stage
  holds until its backward (it is the root the backward starts from; the last stage holds only a
  scalar loss, and a stage with no trainable unit up to its last runs no backward and holds none),
- the largest temporaries of an action (training, step or evaluation; 0 in a profile that did not
  measure them), and the device reserve (``overhead``, outside the allocator's count),
- under PACI with ``pipeline.backward_weights: forward``, the copies of its weights that in-flight
  micro-batches still need (``weight_copies``): each is one clone of the trainable weights the
  stage computes with (bf16 ones in a bf16 profile; the fp32 masters and frozen weights are never
  copied), and a stage holds
  at most :func:`paci_tune.schedule.copies_bound` of them, ``ceil((k-1)/a)`` with ``k`` in flight
  (:mod:`paci_tune.pipeline.versions`). Flush schedules never step with a micro-batch in flight,
  the last stage holds one micro-batch at a time, and ``current`` copies nothing: 0 there. The
  count comes from :func:`stage_copies`.

The in-flight count is what the schedule allows (:func:`paci_tune.schedule.inflight_cap`):
``P - s`` at stage ``s`` for 1F1B and PACI, the whole window for GPipe. That is why 1F1B-style
schedules need less memory than GPipe, and why the first stage is the most loaded. The
schedules built as torch's classes order them (the registry's builders) are counted off their lists:

- **ZB-H1** keeps a micro-batch's activations until its ``W`` (the weight gradient reads the layers'
  inputs), and every stage holds up to ``min(P, m)`` of them: the most over stages equals 1F1B's
  (its first stage's ``P``), while later stages hold more than under 1F1B. Counting the whole
  activation until ``W`` is an upper bound: after ``B`` only the layers' inputs and output gradients
  are needed.
- **interleaved** holds, at stage ``s``, micro-batches on each of its ``v`` chunks; a chunk's
  micro-batch pins that chunk's saved tensors and output (:func:`chunked_activations`, the largest
  sum over the stage's list). The count at the peak is the warm-up plus one, ``(v-1) r + 2 (P-1-s)
  + 1`` chunk activations (at most ``v m``), each about ``1/v`` of a stage's: with ``r = P`` stage 0
  holds about ``(1 + 1/v)`` times 1F1B's ``P`` (Narayanan et al. state the same).
- **ZB-V and DualPipeV** place two chunks on each rank in a V (rank ``s`` holds pieces ``s`` and
  ``2P - 1 - s``), so every rank holds both chunks' weights and both chunks' in-flight activations,
  each kept until its ``W``, counted per chunk as interleaved's. Rank ``s`` holds at most ``2P - s``
  on its first chunk and ``s + 1`` on its second: ``2P`` chunk activations (DualPipeV ``2P + 1``),
  about 1F1B's first stage's ``P`` whole ones, on every rank rather than only the first.

The prediction is per device. With D data-parallel replicas each of the P x D devices holds one
stage of one replica, fed micro-batches of ``b`` sequences (the global batch is D * a * b), so a
device's memory is this stage's at ``b`` whatever D is: the all-reduce reduces the gradients
already counted in place, and the collective's own staging buffers are left to the fixed overhead
(not measured here). May import:
:mod:`.profile`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config` (``BACKWARD_WEIGHTS``) and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..config.schema import BACKWARD_WEIGHTS
from ..schedule import Action, Op, copies_bound, inflight_per_chunk
from ..schedule.actions import virtual_stage
from ..schedule.replay import releases_at
from .profile import Profile

MIB = 2**20
GIB = 2**30
DEFAULT_OVERHEAD_BYTES = 256 * MIB
"""The device reserve outside the allocator's count (``StageMemory.overhead``): the caching allocator's
fragmentation and what it holds but has not handed out; on a GPU the CUDA context (several hundred MiB)
comes on top. A budget holds it; ``torch.cuda.max_memory_allocated`` does not count it."""

OPTIMIZER_STATE_FACTOR = {"adamw": 2, "sgd": 1, "nadam": 2, "muon": 2}
"""Optimizer state in units of the fp32 weights: AdamW's and NAdam's two moments, SGD's momentum buffer;
Muon's is one buffer for its matrices and AdamW's two for the rest, counted at the larger (an upper bound)."""

WEIGHT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per parameter of the weights a stage computes with, by the profile's ``dtype``."""


@dataclass(frozen=True)
class StageMemory:
    """The parts of one stage's predicted peak memory, in bytes (``masters``: fp32 masters of bf16 weights;
    ``weight_copies``: the forward-mode copies of ``params``, see the module docstring)."""

    params: int
    grads: int
    optimizer_state: int
    activations: int
    overhead: int  # the device reserve, outside the allocator's count (:data:`DEFAULT_OVERHEAD_BYTES`)
    masters: int = 0
    weight_copies: int = 0  # forward-mode weight versions kept for in-flight backwards
    transient: int = 0  # the temporaries of the action in progress at the peak (0: not in the profile)
    buffers: int = 0  # the transport's receive buffers, posted ahead (:func:`paci_tune.pipeline.planning`)

    @property
    def allocated(self) -> int:
        """What the allocator counts at the stage's peak (``torch.cuda.max_memory_allocated``): every tensor."""
        return (
            self.params
            + self.masters
            + self.grads
            + self.optimizer_state
            + self.activations
            + self.weight_copies
            + self.transient
            + self.buffers
        )

    @property
    def total(self) -> int:
        """What a device must hold for the stage: the allocated peak and the reserve."""
        return self.allocated + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "allocated": self.allocated, "total": self.total}


def stage_copies(
    schedule: str, stage: int, stages: int, window: int, inflight: int | None = None, *, backward_weights: str
) -> int:
    """Weight copies a stage holds at its peak: :func:`paci_tune.schedule.copies_bound` in ``forward`` mode
    (0 for flush schedules and at the last stage), none in ``current``."""
    if backward_weights not in BACKWARD_WEIGHTS:
        raise ValueError(f"unknown backward_weights {backward_weights!r}; expected one of {BACKWARD_WEIGHTS}")
    if backward_weights == "current":
        return 0
    return copies_bound(schedule, stage, stages, window, inflight)


def inflight_bytes(profile: Profile, units: Sequence[int], microbatch_size: int, *, last: bool) -> int:
    """Memory one in-flight micro-batch pins at a stage owning ``units`` (see the module docstring)."""
    costs = profile.at(microbatch_size)
    saved = sum(costs[i].saved_bytes for i in units)
    backward = profile.trains(range(units[-1] + 1))  # a unit up to this stage's last trains
    return saved + (0 if last or not backward else costs[units[-1]].activation_bytes)


def chunked_activations(
    profile: Profile,
    pieces: Sequence[Sequence[int]],
    stage: int,
    stages: int,
    microbatch_size: int,
    actions: Sequence[Action],
    placement: str = "looped",
) -> int:
    """Peak activation bytes of ``stage`` of a cut into ``v`` chunks a stage: ``pieces`` (each a list of
    units) in model order, placed by ``placement`` (:func:`held_pieces`). The largest, over the stage's
    ``actions``, of the sum over its chunks of micro-batches in flight
    (:func:`paci_tune.schedule.inflight_per_chunk`) times that chunk's :func:`inflight_bytes`."""
    mine = held_pieces(stage, stages, len(pieces) // stages, placement)
    per = [inflight_bytes(profile, list(pieces[j]), microbatch_size, last=j == len(pieces) - 1) for j in mine]
    live = inflight_per_chunk(actions)
    return max((sum(n * b for n, b in zip(counts, per, strict=False)) for counts in live), default=0)


def held_pieces(stage: int, stages: int, chunks: int, placement: str = "looped") -> list[int]:
    """The pieces (virtual stages) ``stage`` holds, by chunk: looped ``s, s + P, ...``; a V ``s, 2P - 1 - s``."""
    return [virtual_stage(stage, c, stages, placement) for c in range(chunks)]


def stage_memory(
    profile: Profile,
    units: Sequence[int],
    microbatch_size: int,
    inflight: int,
    *,
    last: bool,
    optimizer: str = "adamw",
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    copies: int = 0,
    activations: int | None = None,
    masters: bool = False,
    transient: int = 0,
) -> StageMemory:
    """Predicted peak memory of a stage owning ``units`` with at most ``inflight`` micro-batches in flight.

    ``copies``: forward-mode weight copies the stage holds (:func:`stage_copies`; 0: none, as before).
    ``activations``: the peak activation bytes when the stage holds several chunks
    (:func:`chunked_activations`); ``None``: ``inflight`` times one micro-batch's. ``masters``: an fp32
    master of every trainable weight even in fp32 (PACI's weight prediction keeps the trained weights
    there while the parameters hold the predicted ones). ``transient``: the temporaries of the action in
    progress at the peak (:class:`ActionPeak`; 0: as before, left to the reserve).
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise ValueError(f"copies must be an integer >= 0, got {copies!r}")
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    fp32 = sum(profile.units[i].param_bytes for i in units)
    trained = sum(profile.units[i].trained_bytes for i in units)  # fp32 bytes of the trainable ones
    per_fp32 = WEIGHT_BYTES[profile.dtype]  # bytes of the compute dtype per 4 fp32 bytes
    return StageMemory(
        params=fp32 * per_fp32 // 4,
        grads=trained,
        optimizer_state=OPTIMIZER_STATE_FACTOR[optimizer] * trained,
        activations=inflight * inflight_bytes(profile, units, microbatch_size, last=last)
        if activations is None
        else activations,
        overhead=overhead_bytes,
        masters=0 if per_fp32 == 4 and not masters else trained,
        weight_copies=copies * (trained * per_fp32 // 4),
        transient=transient,
    )


def train_transient(profile: Profile, units: Sequence[int], microbatch_size: int) -> int:
    """The largest temporaries a training forward and backward of one micro-batch make at a stage owning
    ``units``: the largest unit's ``transient_bytes`` (units run one at a time; 0 where not measured)."""
    costs = profile.at(microbatch_size)
    return max((costs[i].transient_bytes or 0 for i in units), default=0)


def eval_transient(profile: Profile, units: Sequence[int], microbatch_size: int) -> int:
    """The peak of an evaluation forward of ``microbatch_size`` sequences through ``units``: the largest
    unit's ``eval_bytes`` (its input included; the earlier units' tensors are freed by then)."""
    costs = profile.at(microbatch_size)
    return max((costs[i].eval_bytes or 0 for i in units), default=0)


def in_progress(profile: Profile, units: Sequence[int], microbatch_size: int, held: int, *, last: bool) -> int:
    """What the micro-batch being computed at a stage owning ``units`` holds at its worst moment, its own
    in-flight bytes ``held`` included: while unit ``k`` runs (forward, or backward, which frees the later
    units' saved tensors first) the saved tensors of units up to ``k``, unit ``k``'s ``transient_bytes``,
    and the stage's output unless ``last`` (kept until the backward ends). An embedding's dense weight
    gradient comes at the end of a backward, when the blocks' activations are gone; the head's logits'
    gradient, when they are all there. ``held`` is the most it can be (a profile without transients)."""
    costs = profile.at(microbatch_size)
    out = 0 if last else costs[units[-1]].activation_bytes
    prefix, worst = 0, 0
    for u in units:
        prefix += costs[u].saved_bytes
        worst = max(worst, prefix + (costs[u].transient_bytes or 0))
    return max(out + worst, held) if not any(costs[u].transient_bytes for u in units) else out + worst


def steps_foreach(profile: Profile) -> bool:
    """Whether torch's optimizers step a stage's parameters in one ``foreach`` call (their default on a
    GPU, whose temporaries then add up over the stage's units) or one at a time (the CPU's, whose
    temporaries are the largest unit's): read off the device the profile was measured on."""
    return not profile.device.lower().startswith("cpu")


def step_transient(profile: Profile, units: Sequence[int]) -> int:
    """Temporaries of one optimizer step of a stage owning ``units`` (each unit's ``step_bytes``, summed
    under ``foreach``, else the largest; 0 where not measured)."""
    sizes = [profile.units[i].step_bytes or 0 for i in units]
    return sum(sizes) if steps_foreach(profile) else max(sizes, default=0)


@dataclass(frozen=True)
class ActionPeak:
    """The moment of a stage's action list that holds the most: what its micro-batches in flight hold
    (``activations``), how many weight copies it keeps (``copies``) and the action's temporaries."""

    activations: int = 0
    copies: int = 0
    transient: int = 0
    grads: bool = False  # whether the window's weight gradients exist (from its first backward to its step)


def action_peak(
    profile: Profile,
    pieces: Sequence[Sequence[int]],
    stage: int,
    stages: int,
    microbatch_size: int,
    actions: Sequence[Action],
    *,
    copy_bytes: int = 0,
    grad_bytes: int = 0,
    forward_copies: bool = False,
    eval_size: int | None = None,
    eval_after_step: bool = False,
    keeps_logits: bool = False,
    placement: str = "looped",
    input_grads: Sequence[int] | None = None,
    eval_held: int = 0,
) -> ActionPeak:
    """Walk ``stage``'s ``actions`` (its chunks the pieces :func:`held_pieces` names under ``placement``)
    and return the moment that holds the most (the module docstring's moments):

    - at a forward, or a whole backward (a split one's ``W`` on the first piece), the other micro-batches
      in flight on each chunk (a micro-batch from its forward until its release,
      :func:`paci_tune.schedule.replay.releases_at`) and the one being computed at its worst
      (:func:`in_progress`); at a split backward's ``B`` or ``W`` elsewhere every micro-batch in flight
      and the chunk's :func:`train_transient` (the first piece's ``B`` computes nothing). From ``B`` to
      ``W`` a micro-batch holds its units' ``split_bytes`` in place of their saved tensors;
      ``keeps_logits``: the last stage holds its output (the logits) from the forward to the backward
      (``B``), as torch's ``PipelineStage`` does (paci-tune's own stage keeps only the loss);
    - the window's weight gradients (``grad_bytes``) from its first backward, which makes them as it
      frees its micro-batch, to its step, which frees them;
    - at a step, the weight copies in-flight micro-batches still need (``forward_copies``: one per
      older version a micro-batch in flight was forwarded on, ``copy_bytes`` each) and the step's
      temporaries; after it, with ``eval_after_step``, an evaluation's (without the gradients: torch's
      schedules evaluate a drained pipeline after each step);
    - at an ``EVAL`` of the list (a :class:`~paci_tune.schedule.program.Program`'s: PACI's later stages
      evaluate after a forward, with micro-batches in flight), what is live there and the evaluation's
      temporaries;
    - the run's last evaluation, drained: its forward at ``eval_size`` alone.

    torch's ``PipelineStage`` (a torch-run schedule) adds two: ``input_grads``, per chunk, the gradient of a
    received input, which stays on its receive buffer from the micro-batch's ``B`` until the next step
    begins (so a whole window of them at the step and at the evaluation after it); ``eval_held``, the
    validation outputs an evaluation keeps in flight (:func:`paci_tune.pipeline.links.eval_outputs_held`),
    on top of its forward.
    """
    mine = held_pieces(stage, stages, len(pieces) // stages, placement)
    last = len(pieces) - 1
    held = [inflight_bytes(profile, list(pieces[j]), microbatch_size, last=j == last) for j in mine]
    costs = profile.at(microbatch_size)
    # from B to W a micro-batch's units hold split_bytes in place of saved_bytes; the first piece's B computes
    # nothing (its input needs no gradient: the whole backward runs at W)
    split = [
        0 if j == 0 else sum((costs[u].split_bytes or costs[u].saved_bytes) - costs[u].saved_bytes for u in pieces[j])
        for j in mine
    ]
    logits = [
        profile.at(microbatch_size)[pieces[j][-1]].activation_bytes if keeps_logits and j == last else 0 for j in mine
    ]
    train = [train_transient(profile, pieces[j], microbatch_size) for j in mine]
    running = [in_progress(profile, pieces[j], microbatch_size, held[i], last=j == last) for i, j in enumerate(mine)]
    units = [u for j in mine for u in pieces[j]]
    evaluation = (eval_transient(profile, units, eval_size) if eval_size else 0) + eval_held
    at_step = max(step_transient(profile, pieces[j]) for j in mine)
    release = releases_at(actions)
    live: dict[tuple[int, int], int] = {}  # (chunk, micro-batch) -> weight version at its forward
    outputs: set[tuple[int, int]] = set()  # the last stage's forwards whose logits are kept, until their B
    waiting: set[tuple[int, int]] = set()  # micro-batches between their B and their W
    version, grads, best = 0, False, ActionPeak(transient=evaluation)
    in_grads, stepped = 0, False  # the received inputs' gradients held now; a step since the last forward

    def moment(transient: int, busy: tuple[int, int] | None = None) -> ActionPeak:
        """What is live now; ``busy``: the micro-batch being computed, whose part is in ``transient``."""
        acts = sum(held[c] for c, _ in live) + sum(logits[c] for c, _ in outputs) + sum(split[c] for c, _ in waiting)
        acts += in_grads
        acts -= held[busy[0]] if busy in live else 0
        copies = len({v for v in live.values() if v < version}) if forward_copies else 0
        return ActionPeak(acts, copies, transient, grads)

    def size(p: ActionPeak) -> int:
        return p.activations + p.copies * copy_bytes + p.transient + (grad_bytes if p.grads else 0)

    for act in actions:
        key = (act.chunk, act.mb)
        if act.op is Op.FORWARD:
            if stepped:  # torch's step() begins by clearing the input gradients
                in_grads, stepped = 0, False
            live[key] = version
            outputs.add(key)
            now = moment(running[act.chunk], key)

        elif act.op in (Op.BACKWARD, Op.WEIGHT):
            whole = act.op is release and (release is Op.BACKWARD or mine[act.chunk] == 0)  # the whole backward
            idle = act.op is Op.BACKWARD and release is Op.WEIGHT and mine[act.chunk] == 0  # B of the first piece
            now = moment(running[act.chunk], key) if whole else moment(0 if idle else train[act.chunk])
            outputs.discard((act.chunk, act.mb))
            if act.op is Op.BACKWARD and input_grads is not None:
                in_grads += input_grads[act.chunk]
            if act.op is Op.BACKWARD and release is Op.WEIGHT:
                waiting.add((act.chunk, act.mb))
            else:
                waiting.discard((act.chunk, act.mb))
            if act.op is release:
                live.pop((act.chunk, act.mb), None)
                if not grads:  # the window's first: its gradients replace what it frees (made as it ends)
                    grads = True
                    now = max(now, moment(0), key=size)
        elif act.op is Op.STEP:
            version += 1
            stepped = True
            now = moment(at_step)  # the gradients are still there while the step runs
            grads = False
            if eval_after_step:  # an evaluation after the step: the gradients are gone
                now = max(now, moment(evaluation), key=size)
        elif act.op is Op.EVAL:  # where the program puts it: whatever is in flight, and the gradients so far
            now = moment(evaluation)
        else:
            continue
        best = max(best, now, key=size)
    if input_grads is not None:  # the run's last evaluation, after its last step: the input gradients still there
        grads = False
        best = max(best, moment(evaluation), key=size)
    return best
