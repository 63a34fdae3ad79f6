"""What the links between pipeline ranks hold in memory, per stage: the receive buffers of paci-tune's
transport or of torch's ``PipelineStage``, the input gradients torch keeps, and the validation outputs an
evaluation leaves in flight. Read by :func:`.planning.predicted_stage_memory`.
May import: :mod:`paci_tune.sim`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`, :mod:`.p2p`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config.schema import PipelineConfig, RunConfig
from ..schedule import Schedule, schedule_of
from ..sim.profile import Profile
from .p2p import EVAL_PENDING, POSTED_AHEAD


def eval_chunk(cfg: RunConfig) -> int:
    """Sequences one evaluation forward holds: ``training.eval_microbatch_size``, at most the whole
    validation set (:class:`paci_tune.pipeline.evaluation.ValidationSet` cuts it into such chunks)."""
    return min(cfg.training.eval_microbatch_size, cfg.training.eval_sequences)


def posted_buffers(profile: Profile, pieces: Sequence[Sequence[int]], stage: int, p: PipelineConfig) -> int:
    """Bytes of the receives paci-tune's transport keeps posted at ``stage`` (:data:`.p2p.POSTED_AHEAD` per
    neighbour): activations from the previous stage, gradients of its output from the next. torch's
    schedules (zb-h1, interleaved, ``torch_schedule``) receive into their own buffers, left out."""
    costs = profile.at(p.microbatch_size)
    into = costs[pieces[stage - 1][-1]].activation_bytes if stage > 0 else 0
    out = costs[pieces[stage][-1]].activation_bytes if stage < p.stages - 1 else 0
    return POSTED_AHEAD * (into + out)


def off_rank(spec: Schedule, a: int, b: int, stages: int) -> bool:
    """Whether pieces ``a`` and ``b`` sit on different ranks (a V's tip, or a pipe of one rank, hands over
    in memory)."""
    return spec.holder(a, stages)[0] != spec.holder(b, stages)[0]


def torch_links(
    profile: Profile, pieces: Sequence[Sequence[int]], stage: int, p: PipelineConfig
) -> tuple[int, list[int]]:
    """What torch's ``PipelineStage`` holds for its links at ``stage`` (each piece it holds, by chunk):
    (receive buffers, input gradient per chunk). At its first step it allocates one receive buffer per
    micro-batch of the window for each neighbour on another rank -- the previous piece's output coming
    in, the gradient of its own going back -- and keeps them for the run; a received input's gradient
    stays on its buffer from the micro-batch's backward until the next step begins."""
    spec, costs = schedule_of(p.schedule), profile.at(p.microbatch_size)
    last = len(pieces) - 1
    buffers, grads = 0, []
    for j in (spec.virtual_stage(stage, c, p.stages) for c in range(len(pieces) // p.stages)):
        into = costs[pieces[j - 1][-1]].activation_bytes if j > 0 and off_rank(spec, j - 1, j, p.stages) else 0
        back = costs[pieces[j][-1]].activation_bytes if j < last and off_rank(spec, j, j + 1, p.stages) else 0
        buffers += p.window * (into + back)
        grads.append(into)
    return buffers, grads


def eval_outputs_held(cfg: RunConfig, profile: Profile, pieces: Sequence[Sequence[int]], stage: int) -> int:
    """Validation outputs a torch-run evaluation keeps at ``stage`` (its pieces one after another, each over
    every chunk): :data:`.p2p.EVAL_PENDING` of each piece sending to another rank, every chunk's on the link
    from the last rank back to the first (the registry's ``wraps``: never waited on) or where the next piece
    is on this rank (handed over in memory, all taken by the next piece's turn)."""
    p = cfg.pipeline
    spec, size = schedule_of(p.schedule), eval_chunk(cfg)
    chunks = -(-cfg.training.eval_sequences // size)
    costs = profile.at(size)
    held = 0
    for j in (spec.virtual_stage(stage, c, p.stages) for c in range(len(pieces) // p.stages)):
        if j < len(pieces) - 1:
            kept = chunks if spec.wraps(j, p.stages) or not off_rank(spec, j, j + 1, p.stages) else EVAL_PENDING
            kept = min(chunks, kept)
            held += kept * costs[pieces[j][-1]].activation_bytes
    return held
