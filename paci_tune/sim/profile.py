"""Cost profiles: what each pipeline unit costs on one machine, as data the simulator can read.

A profile is measured by ``paci-tune calibrate`` (:mod:`paci_tune.calibrate`), but it is plain
YAML on purpose: a profile can be written by hand (or a measured one edited) to predict hardware
you do not have. :meth:`Profile.scale` makes a uniformly faster or slower copy.

Format (every time in seconds, every size in bytes)::

    format: paci-tune-profile/1     # optional
    machine: {node: host, processor: x86_64, platform: Linux-...}   # optional, informative
    device: cpu                     # optional, informative (the device name)
    torch: 2.13.0                   # optional, informative
    dtype: fp32                     # optional: fp32 or bf16, the compute precision measured (default fp32)
    date: 2026-01-01T00:00:00       # optional, informative
    threads: 1                      # optional: CPU threads per stage during measurement
    seq_len: 128                    # required: tokens per sequence the costs were measured at
    units:                          # required: one entry per pipeline unit, in model order
      - name: embed                 # optional
        param_bytes: 131072         # 4 bytes per parameter of the unit, in either dtype (see below)
        trainable_bytes: 131072     # optional: 4 bytes per trainable parameter (default: param_bytes)
        optimizer_s: 0.0002         # one optimizer step over the unit's parameters
        copy_s: 0.00002             # optional: one clone of the unit's weights in the compute dtype (below)
        microbatch:                 # per micro-batch size (sequences) measured
          8: {forward_s: 0.001, backward_s: 0.002, activation_bytes: 524288, saved_bytes: 8192,
              backward_input_s: 0.0012, backward_weight_s: 0.001}   # optional (below)
          16: {forward_s: 0.002, backward_s: 0.004, activation_bytes: 1048576, saved_bytes: 16384,
               transient_bytes: 65536, eval_bytes: 32768, split_bytes: 16384}  # optional; step_bytes: :mod:`.costs`
    p2p: {latency_s: 5.0e-05, bandwidth_Bps: 2.0e+09}   # one point-to-point send: latency + bytes / bandwidth
    allreduce: {latency_s: 1.0e-04, bandwidth_Bps: 1.0e+09, backend: gloo}   # optional: one ring step (below)
    tied: [{units: [0, 5], bytes: 131072}]   # optional: units sharing trainable parameters (:mod:`.tied`)
    optimizer: adamw                # optional: whose step optimizer_s is (default adamw); per unit, optionally,
    optimizer_note: ...             # optimizer_steps: {nadam: 0.0002, muon: 0.0009}, other optimizers' steps

A run is charged its own optimizer's step (:meth:`Profile.for_optimizer`; a profile that did not time
it is refused). Profiles written before the key timed AdamW.

``forward_s`` / ``backward_s`` are one micro-batch through the unit (the last unit includes the
cross-entropy loss, as the real last stage computes it). ``activation_bytes`` is the unit's
output -- what crosses a stage boundary cut after this unit (the gradient sent back has the same
size). ``saved_bytes`` is what autograd keeps alive between the unit's forward and backward,
excluding the parameters themselves: the activation memory of one in-flight micro-batch.
``bandwidth_Bps: .inf`` with ``latency_s: 0`` makes transfers free. ``backward_input_s`` and
``backward_weight_s`` are the two halves of the backward a zero-bubble schedule runs apart (input
gradient, weight gradient; one alone: the other is the rest of ``backward_s``); **a profile without
them** gets the derived split of
:mod:`.costs` (``W = backward_s / 2`` for a fully trainable unit), and :attr:`Profile.split_measured`
is false so reports can say so.

``allreduce`` is the gradient all-reduce among the D data-parallel replicas of a stage, in the ring
model every common backend follows for large tensors: ``2 (D-1)`` steps, each sending ``bytes / D``
to a neighbour, so one all-reduce of ``bytes`` over ``D`` ranks costs
``2 (D-1)/D * bytes / bandwidth_Bps + 2 (D-1) * latency_s`` (0 when ``D = 1``). ``latency_s`` and
``bandwidth_Bps`` are one ring step's: measured by ``paci-tune calibrate`` with gloo among processes
on this machine (:mod:`paci_tune.calibrate.allreduce`), or written by hand for NVLink or InfiniBand
(e.g. NCCL on NVLink: ~1e-5 s, ~1.5e11 B/s; InfiniBand HDR: ~5e-6 s, ~2.5e10 B/s). **A profile
without** ``allreduce`` (every profile written before it existed) takes the ``p2p`` link's latency and
bandwidth: a ring step is one neighbour send on the same link, which is exactly what ``p2p`` measured.

**``param_bytes`` is 4 bytes per parameter whatever ``dtype`` is** -- the size of the unit's weights
in fp32, i.e. its parameter count times 4 -- so a profile's weights can be compared and scaled
across precisions. What a stage holds is derived from it by :mod:`paci_tune.sim.memory`: in fp32
weights, gradients and optimizer state of ``param_bytes`` each (AdamW: two moments); in bf16
(fp32 master weights, :mod:`paci_tune.pipeline.optim`) bf16 weights of ``param_bytes / 2``, plus fp32
masters, fp32 gradients and fp32 optimizer state as in fp32. ``activation_bytes`` and ``saved_bytes``
are measured in the profile's ``dtype`` (bf16 activations in a bf16 profile, no weight copies).

``trainable_bytes`` counts only the parameters that train (``requires_grad``): gradients, optimizer
state, fp32 masters, weight copies and the all-reduce are sized by it (a frozen parameter has none).
**Without it** (profiles written before it existed) every parameter trains. A frozen unit's
``backward_s`` is its input gradient alone, 0 where nothing before it trains (no backward runs).

``copy_s`` is one clone of the unit's weights as a stage computes with them (bf16 in a bf16
profile, the fp32 masters never), what PACI with ``pipeline.backward_weights: forward`` does at an
optimizer step that would overwrite a version an in-flight micro-batch still needs
(:mod:`paci_tune.pipeline.versions`). ``paci-tune calibrate`` measures it. **A profile without**
``copy_s`` (every profile written before it existed) predicts such a copy to take no time: the
copy's *memory* is still counted (:mod:`paci_tune.sim.memory`), only its seconds are left out, which
is a small optimism (one pass over the weights, against an optimizer step's several); calibrate
again to measure it.

**Micro-batch sizes that were not measured** are linearly interpolated between the two nearest
measured sizes, and extrapolated along the line through the two nearest measured sizes beyond
either end (clamped at zero); with a single measured size, costs are taken proportional to the
micro-batch size. Compute time is close to linear in the micro-batch size once a kernel is large
enough to fill the device, and activation sizes are exactly linear, so this is accurate between
measured sizes and a fair guess a little beyond them.

Each value of a profile file is checked by :mod:`.profile_doc`. May import: PyYAML, :mod:`.costs`,
:mod:`.profile_doc`, :mod:`.tied`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

import yaml

from ..base.files import atomic_write_text, read_mapping
from ..base.shipped import resolve_path
from ..errors import ConfigError
from .costs import UnitCost, UnitProfile
from .profile_doc import _TOP_KEYS, _int, _link, _mapping, _unit  # the document's values, checked
from .tied import TiedGroup, parse_tied

FORMAT = "paci-tune-profile/1"


@dataclass(frozen=True)
class _LinkCost:
    """What both links' costs are made of: a latency, a bandwidth (``.inf``: free) and where it was measured."""

    latency_s: float
    bandwidth_Bps: float
    backend: str = "unknown"

    def _bytes_s(self, nbytes: float) -> float:
        """Seconds ``nbytes`` take at the bandwidth alone."""
        return 0.0 if math.isinf(self.bandwidth_Bps) else nbytes / self.bandwidth_Bps

    def scaled(self, factor: float) -> Self:
        """The same link ``factor`` times slower (a copy of this type)."""
        return replace(self, latency_s=self.latency_s * factor, bandwidth_Bps=self.bandwidth_Bps / factor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency_s": float(self.latency_s),
            "bandwidth_Bps": float(self.bandwidth_Bps),
            "backend": str(self.backend),
        }


@dataclass(frozen=True)
class P2PCost(_LinkCost):
    """Point-to-point transfer between neighbouring stages: ``latency_s + bytes / bandwidth_Bps``."""

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + self._bytes_s(nbytes)


@dataclass(frozen=True)
class AllReduceCost(_LinkCost):
    """Ring all-reduce among a stage's data-parallel replicas; one ring step: ``latency_s + bytes / bandwidth_Bps``.

    Its own type rather than a :class:`P2PCost`: the fields mean one *step* of a collective.
    """

    def ring_s(self, nbytes: float, ranks: int) -> float:
        """One all-reduce of ``nbytes`` over ``ranks``: ``2 (D-1)/D * bytes / bandwidth + 2 (D-1) * latency``."""
        if ranks <= 1:
            return 0.0
        return self._bytes_s(2 * (ranks - 1) / ranks * nbytes) + 2 * (ranks - 1) * self.latency_s


@dataclass(frozen=True)
class Profile:
    """Costs of every pipeline unit of one model on one machine; see the module docstring."""

    units: list[UnitProfile]
    p2p: P2PCost
    seq_len: int
    device: str = "unknown"
    dtype: str = "fp32"
    threads: int | None = None
    torch_version: str = "unknown"
    date: str = "unknown"
    machine: dict[str, str] = field(default_factory=dict)
    allreduce_cost: AllReduceCost | None = None  # None: derived from ``p2p`` (module docstring)
    tied: list[TiedGroup] = field(default_factory=list)  # units sharing trainable parameters (:mod:`.tied`)
    optimizer: str = "adamw"  # the timing key of the optimizer whose step ``optimizer_s`` is
    optimizer_note: str | None = None  # how the units' ``optimizer_steps`` were timed

    def timed_optimizers(self) -> list[str]:
        """The optimizers with a step time here: its own, then those every unit's ``optimizer_steps`` has."""
        others = set.intersection(*(set(u.optimizer_steps) for u in self.units)) if self.units else set()
        return [self.optimizer, *sorted(others - {self.optimizer})]

    def for_optimizer(self, key: str, where: str = "profile", path: str = "") -> Profile:
        """This profile charging optimizer ``key``'s step (module docstring); refused when it did not time it."""
        if key == self.optimizer:
            return self
        if key not in self.timed_optimizers():
            raise ConfigError(
                where,
                path or self.device,
                f"a profile that timed the {key} step (this one timed "
                f"{', '.join(self.timed_optimizers())}): paci-tune calibrate CONFIG, with "
                f"optimizer.name: {key.split()[0]} in CONFIG, measures one",
            )
        units = [
            replace(
                u,
                optimizer_s=u.optimizer_steps[key],
                optimizer_steps={
                    **{k: v for k, v in u.optimizer_steps.items() if k != key},
                    self.optimizer: u.optimizer_s,
                },
            )
            for u in self.units
        ]
        return replace(self, units=units, optimizer=key)

    @property
    def allreduce(self) -> AllReduceCost:
        """The all-reduce cost: the profile's own, or the ``p2p`` link's when it has none (module docstring)."""
        if self.allreduce_cost is not None:
            return self.allreduce_cost
        return AllReduceCost(self.p2p.latency_s, self.p2p.bandwidth_Bps, f"{self.p2p.backend} (from p2p)")

    def gradient_bytes(self, units: Sequence[int]) -> int:
        """Bytes a stage owning ``units`` all-reduces per step: its fp32 gradients (4 bytes per trainable parameter).

        Gradients accumulate in fp32 in both precisions (bf16 stages keep fp32 masters and fp32
        gradients, :mod:`paci_tune.sim.memory`), so this is ``trainable_bytes`` whatever ``dtype`` is
        (0 for a stage with nothing to train: it all-reduces nothing).
        """
        return sum(self.units[i].trained_bytes for i in units)

    def trains(self, units: Sequence[int]) -> bool:
        """Whether a unit among ``units`` has a parameter to train. In a profile where none does (costs
        written by hand, ``param_bytes: 0``: no model that runs) every unit counts as training."""
        if not any(u.trained_bytes for u in self.units):
            return bool(units)
        return any(self.units[i].trained_bytes > 0 for i in units)

    def backward_split(self, microbatch_size: int) -> list[tuple[float, float]]:
        """Every unit's ``(B, W)`` seconds at ``microbatch_size``: measured, or derived (:mod:`.costs`)."""
        out = []
        for i, (u, c) in enumerate(zip(self.units, self.at(microbatch_size), strict=True)):
            share = u.trained_bytes / u.param_bytes if u.param_bytes else float(self.trains([i]))
            out.append(c.split(share))
        return out

    @property
    def split_measured(self) -> bool:
        """Whether every unit's backward split was measured at every size (else some of it is derived)."""
        return all(c.split_measured for u in self.units for c in u.costs.values())

    def weight_copy_s(self, units: Sequence[int]) -> float:
        """Seconds to clone the weights of a stage owning ``units`` once (0 for units without ``copy_s``)."""
        return sum(self.units[i].copy_s or 0.0 for i in units)

    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def microbatch_sizes(self) -> list[int]:
        """Sizes measured for every unit (the ones needing no interpolation)."""
        common = set(self.units[0].costs)
        for u in self.units[1:]:
            common &= set(u.costs)
        return sorted(common)

    def at(self, microbatch_size: int) -> list[UnitCost]:
        """Every unit's cost at ``microbatch_size`` (interpolated where not measured)."""
        return [u.at(microbatch_size) for u in self.units]

    def scale(self, factor: float, p2p_factor: float | None = None) -> Profile:
        """A copy of this profile on hardware ``factor`` times slower (0.5: twice as fast).

        Compute, optimizer and weight-copy times are multiplied by ``factor``; transfers by ``p2p_factor``
        (default: the same factor), i.e. latency multiplied and bandwidth divided. Memory sizes
        are unchanged: they depend on the model, not on the speed of the machine.
        """
        for key, f in (("factor", factor), ("p2p_factor", p2p_factor)):
            if f is not None and not (isinstance(f, (int, float)) and f > 0 and math.isfinite(f)):
                raise ConfigError(key, f, "a positive finite number")
        pf = factor if p2p_factor is None else p2p_factor
        units = [
            replace(
                u,
                optimizer_s=u.optimizer_s * factor,
                optimizer_steps={k: v * factor for k, v in u.optimizer_steps.items()},
                copy_s=None if u.copy_s is None else u.copy_s * factor,
                costs={b: c.scaled(factor) for b, c in u.costs.items()},
            )
            for u in self.units
        ]
        ar = None if self.allreduce_cost is None else self.allreduce_cost.scaled(pf)
        return replace(
            self, units=units, p2p=self.p2p.scaled(pf), allreduce_cost=ar, device=f"{self.device} (scaled x{factor:g})"
        )

    # ------------------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "machine": {str(k): str(v) for k, v in self.machine.items()},
            "device": str(self.device),
            "torch": str(self.torch_version),
            "dtype": str(self.dtype),
            "date": str(self.date),
        }
        if self.threads is not None:
            out["threads"] = self.threads
        out["seq_len"] = self.seq_len
        out["units"] = [u.to_dict() for u in self.units]
        out["p2p"] = self.p2p.to_dict()
        if self.allreduce_cost is not None:
            out["allreduce"] = self.allreduce_cost.to_dict()
        if self.tied:
            out["tied"] = [g.to_dict() for g in self.tied]
        out["optimizer"] = str(self.optimizer)
        if self.optimizer_note:
            out["optimizer_note"] = str(self.optimizer_note)
        return out

    def dumps(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    def save(self, path: str | Path) -> None:
        """Write the YAML atomically: a crash leaves the old file or the new one, never half of one."""
        atomic_write_text(Path(path), self.dumps())

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        """Validate a parsed YAML document; bad values raise ConfigError naming ``where.key``."""
        _mapping(where, data, _TOP_KEYS)
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise ConfigError(f"{where}.format", fmt, FORMAT)
        seq_len = _int(f"{where}.seq_len", data.get("seq_len"), minimum=1)
        units_raw = data.get("units")
        if not isinstance(units_raw, list) or not units_raw:
            raise ConfigError(f"{where}.units", units_raw, "a non-empty list, one entry per pipeline unit")
        units = [_unit(f"{where}.units[{i}]", u, i) for i, u in enumerate(units_raw)]
        latency, bandwidth, backend = _link(f"{where}.p2p", data.get("p2p"))
        allreduce = None
        if data.get("allreduce") is not None:
            allreduce = AllReduceCost(*_link(f"{where}.allreduce", data["allreduce"]))
        threads = data.get("threads")
        if threads is not None:
            threads = _int(f"{where}.threads", threads, minimum=1)
        dtype = data.get("dtype", "fp32")
        if dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{where}.dtype", dtype, "fp32 or bf16")
        machine = data.get("machine") or {}
        if not isinstance(machine, dict):
            raise ConfigError(f"{where}.machine", machine, "a mapping of descriptive strings")
        return cls(
            units=units,
            p2p=P2PCost(latency, bandwidth, backend),
            allreduce_cost=allreduce,
            seq_len=seq_len,
            device=str(data.get("device", "unknown")),
            dtype=dtype,
            threads=threads,
            torch_version=str(data.get("torch", "unknown")),
            date=str(data.get("date", "unknown")),
            machine={str(k): str(v) for k, v in machine.items()},
            tied=parse_tied(f"{where}.tied", data.get("tied"), len(units)),
            optimizer=str(data.get("optimizer", "adamw")),
            optimizer_note=None if data.get("optimizer_note") is None else str(data["optimizer_note"]),
        )

    @classmethod
    def load(cls, path: str | Path, key: str = "profile") -> Profile:
        """Read and validate a profile file; a missing file or bad YAML is a ConfigError on ``key``.

        ``profiles/NAME.yaml`` not found here is the shipped reference profile of that name, as in
        ``budget.profile`` (``--profile profiles/tiny-gpt.yaml`` works from any folder)."""
        return cls.from_dict(read_mapping(resolve_path(path), key, "a cost profile: seq_len, units, p2p"), key)
