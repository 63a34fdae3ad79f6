"""Parameters shared by units on different stages (tied weights): one copy per stage, gradients summed.

A model may hand one ``nn.Parameter`` to several units -- GPT-2's output head multiplies by the
embedding's own matrix. Where the stage cut puts those units on different stages, each stage holding
the parameter (a *holder*) keeps **its own copy**, identical at the start, as Megatron does for its
tied embedding: on the distributed runtime every rank builds the whole user model from one seed and
keeps its own units; on the emulated runtime :func:`untie` gives every later holder a deep copy of
its units, so no tensor is stepped by two optimizers. At each optimizer step the holders replace
their copy's gradient by the **sum** of every holder's gradient and then step: equal copies, equal
gradients and equal optimizer state give equal copies again, and the sum is exactly the gradient the
one shared parameter gets in plain training (autograd sums the uses). So flush schedules still equal
plain training; PACI, whose stages step at their own cadence, is refused
(:func:`paci_tune.pipeline.checks.check_shared_parameters`).

Order under data parallelism (as Megatron's): first each stage's gradients are averaged over its
replicas (:mod:`.replicas`), then the holders of one replica sum theirs. Both are linear, so the result
is the mean over replicas of the sum over holders: plain training's gradient of the whole global batch.
The whole model's gradient norm (a flush schedule's clip) counts a tied parameter once, at its first
holder (:attr:`~.stage.Stage.counted_elsewhere` on the others).

One mechanism, two transports, the same arithmetic (the holders' gradients summed in stage order):
:func:`sum_tied` in one process (emulated), :class:`TiedAllReduce` over a process group of the
replica's holder ranks (distributed). Two holders sum two terms, which is the same in either order,
so the runtimes agree bit for bit. A frozen tied parameter is never stepped, so its copies stay equal
with nothing to sum. What a profile records of it (:func:`tied_groups`) lets the simulator charge the
holders' all-reduce (:mod:`paci_tune.sim.tied`). May import: torch, :mod:`paci_tune.model`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.sim`, :mod:`.stage`, :mod:`.mesh`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..model import LoadedModel
from ..model.loader import model_ties
from ..schedule import stage_units
from ..sim.tied import TiedGroup
from .mesh import rank_of
from .stage import Stage


@dataclass(frozen=True, eq=False)
class TiedParameter:
    """One parameter held by units on more than one stage (compared by identity: one per parameter).

    ``names[s]``: its name in holder ``s``'s module (the first unit of ``s`` holding it, as
    ``Stage.param_names`` has it); ``label``: how an error line names it (every unit's name for it).
    """

    names: dict[int, str]
    label: str
    trainable: bool

    @property
    def stages(self) -> list[int]:
        return sorted(self.names)

    @property
    def owner(self) -> int:
        """The holder whose gradient norm counts the parameter (the first)."""
        return min(self.names)

    def index_in(self, stage: Stage) -> int:
        """Its index in holder ``stage``'s ``params``."""
        return stage.param_names.index(self.names[stage.index])


def tied_across_stages(meta: LoadedModel, sizes: Sequence[int]) -> list[TiedParameter]:
    """The parameters that the cut ``sizes`` puts on more than one stage, in the model's order.

    ``meta`` must hold every unit (a user entry model always does); the built-in GPT ties nothing.
    """
    ranges = stage_units(list(sizes))
    stage_of = [s for s, units in enumerate(ranges) for _ in units]
    out = []
    for tie in model_ties(meta):  # read from the units, or known without them (a model built per rank)
        units, names = tie.units, tie.names
        local: dict[int, str] = {}
        for u, name in zip(units, names, strict=True):
            local.setdefault(stage_of[u], f"{u - ranges[stage_of[u]].start}.{name}")
        if len(local) > 1:
            held = " and ".join(f"unit {u}'s {n!r} (stage {stage_of[u]})" for u, n in zip(units, names, strict=True))
            out.append(TiedParameter(local, held, tie.trainable))
    return out


def tied_groups(meta: LoadedModel) -> list[TiedGroup]:
    """The model's units sharing trainable parameters, as a profile records them (:mod:`paci_tune.sim.tied`).

    The detection :func:`tied_across_stages` uses, before any cut: per set of units, the fp32 gradient
    bytes (4 per element) of the trainable parameters they share. Frozen ones are left out (nothing is
    summed), and so is a parameter one unit holds under two names. The built-in GPT ties nothing.
    """
    out: dict[tuple[int, ...], int] = {}
    for tie in model_ties(meta):
        key = tuple(sorted(set(tie.units)))
        if tie.trainable and len(key) > 1:
            out[key] = out.get(key, 0) + 4 * tie.numel
    return [TiedGroup(k, b) for k, b in out.items()]


def untie(built: dict[int, list[nn.Module]], tied: Sequence[TiedParameter]) -> None:
    """Give every holder after the first its own copy of its units (emulated runtime; in place).

    A deep copy of the stage's whole unit list, so whatever its units share among themselves stays
    shared, and what they share with an earlier stage (the parameter, a module holding it) becomes
    this stage's own -- what a distributed rank, which builds the model itself, holds.
    """
    later = {s for t in tied for s in t.stages if s != t.owner and s in built}
    for s in sorted(later):
        built[s] = copy.deepcopy(built[s])


def holdings(stage: Stage, tied: Sequence[TiedParameter]) -> list[tuple[TiedParameter, int]]:
    """The trainable tied parameters ``stage`` holds, each with its index in ``stage.params``."""
    return [(t, t.index_in(stage)) for t in tied if t.trainable and stage.index in t.names]


def mark_counted_elsewhere(stage: Stage, tied: Sequence[TiedParameter]) -> None:
    """Leave the stage's copies that another holder counts out of its gradient norm (module docstring)."""
    stage.counted_elsewhere = frozenset(i for t, i in holdings(stage, tied) if t.owner != stage.index)


@torch.no_grad()
def sum_tied(holders: Sequence[tuple[Stage, int]]) -> None:
    """Replace each holder's gradient of one parameter, in place, by the sum over holders (in their order).

    ``holders``: (stage, index in its ``params``). A holder no backward reached adds nothing and gets
    the sum too, so every copy takes the same step.
    """
    grads = [st.optim.gradient_of(i) for st, i in holders]
    present = [g for g in grads if g is not None]
    if not present:
        return
    total = present[0].clone()
    for g in present[1:]:
        total.add_(g)
    for (st, i), g in zip(holders, grads, strict=True):
        if g is None:
            st.optim.set_gradient(i, total.clone())
        else:
            g.copy_(total)


class TiedAllReduce:
    """The distributed runtime's :func:`sum_tied`: this rank's copies summed with its replica's other holders.

    One process group per set of holder stages and replica (every rank creates every group, in the
    same order, as ``new_group`` requires), one all-reduce per step over the group's parameters
    flattened together (tied parameters are few). Called at the step, after the replicas' average.
    """

    def __init__(
        self,
        stage: Stage,
        tied: Sequence[TiedParameter],
        stages: int,
        replicas: int,
        replica: int,
        wire: torch.device,
    ) -> None:
        self.stage, self.wire = stage, wire
        trainable = [t for t in tied if t.trainable]
        index = dict(holdings(stage, trainable))
        self.parts: list[tuple[dist.ProcessGroup, list[int]]] = []
        for holders in dict.fromkeys(tuple(t.stages) for t in trainable):
            groups = [dist.new_group([rank_of(r, s, stages) for s in holders]) for r in range(replicas)]
            if stage.index in holders:
                self.parts.append((groups[replica], [index[t] for t in trainable if tuple(t.stages) == holders]))

    @torch.no_grad()
    def sum(self) -> None:
        optim = self.stage.optim
        for group, indices in self.parts:
            grads = [optim.gradient_of(i) for i in indices]
            parts = [
                torch.zeros_like(optim.masters[i]) if g is None else g for i, g in zip(indices, grads, strict=True)
            ]
            flat = torch.cat([g.reshape(-1) for g in parts]).to(self.wire)
            dist.all_reduce(flat, group=group)
            offset = 0
            for i, g in zip(indices, grads, strict=True):
                n = optim.masters[i].numel()
                value = flat[offset : offset + n].view_as(optim.masters[i]).to(optim.masters[i].device)
                if g is None:
                    optim.set_gradient(i, value.clone())
                else:
                    g.copy_(value)
                offset += n
