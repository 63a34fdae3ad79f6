"""One pipeline unit's measured costs: per micro-batch size, and the backward's input/weight split.

The records a :class:`~paci_tune.sim.profile.Profile` is made of (its file format is described
there). Their own module so the profile stays a reader and writer of files, and because they carry
the one rule a zero-bubble schedule needs from a profile: what the two halves of a backward cost.

**The backward split.** A zero-bubble schedule (:mod:`paci_tune.schedule.synchronous`) runs each
backward as ``B``, the gradient with respect to the unit's input (what the previous stage waits
for), and ``W``, the gradient with respect to its weights. ``paci-tune calibrate`` measures both
(``backward_input_s``, ``backward_weight_s``; their sum may exceed ``backward_s``, which stays the
time of one whole backward). **A profile without them** (every profile written before they existed)
gets a derived split, :func:`derived_split`: ``W = backward_s / 2 * t`` and ``B = backward_s - W``,
where ``t`` is the unit's trainable share of its parameters (``trainable_bytes / param_bytes``).
A fully trainable unit's two halves are equal (a matmul's input and weight gradients cost the same
FLOPs); a frozen or parameter-free unit has no weight gradient. Real units put their
parameter-free work (attention scores, softmax, normalisation) into ``B``, so a measured ``B`` is
usually the larger half: a derived split flatters zero-bubble schedules a little, and reports say
when a split was derived.

**Memory transients** (issue 38; :mod:`.memory`), all optional: a profile without them (every profile
written before them) counts none, as the model did before (the device reserve was meant to hold them).
Per micro-batch size, ``transient_bytes``: what a training forward and backward of the unit allocate
above what they hold between them (the arriving gradient, activation gradients, a weight's new gradient
before it is added in; the last unit's loss and its gradient: the head's logits' are the large ones);
``eval_bytes``: the peak of an evaluation forward (no gradients), its input included, read at
``training.eval_microbatch_size`` (linear in the size); ``split_bytes``: what a micro-batch holds from
a split backward's ``B`` to its ``W``, as torch's zero-bubble schedules split it, in place of
``saved_bytes``. Per unit (:class:`UnitProfile`), ``step_bytes``: an optimizer step's temporaries over
the unit's parameters. ``paci-tune calibrate`` measures all four (:mod:`paci_tune.calibrate.memory`).
May import: the standard library only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class UnitCost:
    """One unit's cost for one micro-batch of a given size; the split ``None`` when not measured."""

    forward_s: float
    backward_s: float
    activation_bytes: int
    saved_bytes: int
    backward_input_s: float | None = None  # B: the input gradient alone (measured together with W)
    backward_weight_s: float | None = None  # W: the weight gradient alone
    transient_bytes: int | None = None  # peak of a training forward + backward above what it holds (saved + output)
    eval_bytes: int | None = None  # peak of an evaluation forward, its input included
    split_bytes: int | None = None  # held between a split backward's B and W, above the forward's (torch's)

    def with_bytes(self, transient: int | None, evaluation: int | None, split: int | None = None) -> UnitCost:
        """This cost with the transient sizes (:mod:`paci_tune.sim.memory`) set."""
        return replace(self, transient_bytes=transient, eval_bytes=evaluation, split_bytes=split)

    @property
    def split_measured(self) -> bool:
        return self.backward_input_s is not None and self.backward_weight_s is not None

    def split(self, trainable_share: float) -> tuple[float, float]:
        """``(B, W)`` seconds: measured, or :func:`derived_split` of ``backward_s``."""
        if self.backward_input_s is not None and self.backward_weight_s is not None:
            return self.backward_input_s, self.backward_weight_s
        return derived_split(self.backward_s, trainable_share)

    def scaled(self, factor: float) -> UnitCost:
        """Every time ``factor`` times longer; sizes unchanged."""

        def mul(x: float | None) -> float | None:
            return None if x is None else x * factor

        return UnitCost(
            self.forward_s * factor,
            self.backward_s * factor,
            self.activation_bytes,
            self.saved_bytes,
            mul(self.backward_input_s),
            mul(self.backward_weight_s),
            self.transient_bytes,
            self.eval_bytes,
            self.split_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "forward_s": float(self.forward_s),
            "backward_s": float(self.backward_s),
            "activation_bytes": int(self.activation_bytes),
            "saved_bytes": int(self.saved_bytes),
        }
        if self.backward_input_s is not None and self.backward_weight_s is not None:
            out["backward_input_s"] = float(self.backward_input_s)
            out["backward_weight_s"] = float(self.backward_weight_s)
        if self.transient_bytes is not None:
            out["transient_bytes"] = int(self.transient_bytes)
        if self.eval_bytes is not None:
            out["eval_bytes"] = int(self.eval_bytes)
        if self.split_bytes is not None:
            out["split_bytes"] = int(self.split_bytes)
        return out


def _times(nbytes: int | None, factor: float) -> int | None:
    """A size measured at one micro-batch size, at ``factor`` times that size (None stays None)."""
    return None if nbytes is None else round(nbytes * factor)


def _lerp_bytes(a: int | None, b: int | None, t: float) -> int | None:
    """A size between two measured ones (or beyond, clamped at 0); None unless both were measured."""
    return None if a is None or b is None else max(round(a + (b - a) * t), 0)


def derived_split(backward_s: float, trainable_share: float) -> tuple[float, float]:
    """The stated split of a profile that did not measure it (module docstring): ``W = backward/2 * t``."""
    weight = backward_s / 2 * min(max(trainable_share, 0.0), 1.0)
    return backward_s - weight, weight


@dataclass(frozen=True)
class UnitProfile:
    """A unit's measured costs at each measured micro-batch size, and its size-independent costs."""

    name: str
    param_bytes: int
    optimizer_s: float
    costs: dict[int, UnitCost]
    copy_s: float | None = None  # one clone of the weights (compute dtype); None: not measured, taken as 0
    trainable_bytes: int | None = None  # 4 per trainable parameter; None: every parameter trains
    optimizer_steps: dict[str, float] = field(default_factory=dict)  # other optimizers' steps, by timing key
    step_bytes: int | None = None  # peak of one optimizer step over the unit alone, above its state; None: not measured

    @property
    def trained_bytes(self) -> int:
        """4 bytes per parameter that trains: ``trainable_bytes``, or ``param_bytes`` when not given."""
        return self.param_bytes if self.trainable_bytes is None else self.trainable_bytes

    def at(self, microbatch_size: int) -> UnitCost:
        """Cost at ``microbatch_size``; interpolated or extrapolated when not measured (see the profile).

        The split is interpolated like the other times where both sizes around have it, else ``None``.
        """
        if microbatch_size in self.costs:
            return self.costs[microbatch_size]
        sizes = sorted(self.costs)
        if len(sizes) == 1:
            (b0,) = sizes
            f = microbatch_size / b0
            c = self.costs[b0].scaled(f)
            return UnitCost(
                c.forward_s,
                c.backward_s,
                round(c.activation_bytes * f),
                round(c.saved_bytes * f),
                c.backward_input_s,
                c.backward_weight_s,
                _times(c.transient_bytes, f),
                _times(c.eval_bytes, f),
                _times(c.split_bytes, f),
            )
        i = bisect.bisect_left(sizes, microbatch_size)
        i = min(max(i, 1), len(sizes) - 1)  # the segment [i-1, i] containing the size, or the nearest end one
        lo, hi = sizes[i - 1], sizes[i]
        t = (microbatch_size - lo) / (hi - lo)
        a, b = self.costs[lo], self.costs[hi]

        def lerp(x: float, y: float) -> float:
            return max(x + (y - x) * t, 0.0)

        both = a.split_measured and b.split_measured
        return UnitCost(
            lerp(a.forward_s, b.forward_s),
            lerp(a.backward_s, b.backward_s),
            round(lerp(a.activation_bytes, b.activation_bytes)),
            round(lerp(a.saved_bytes, b.saved_bytes)),
            lerp(a.backward_input_s or 0.0, b.backward_input_s or 0.0) if both else None,
            lerp(a.backward_weight_s or 0.0, b.backward_weight_s or 0.0) if both else None,
            _lerp_bytes(a.transient_bytes, b.transient_bytes, t),
            _lerp_bytes(a.eval_bytes, b.eval_bytes, t),
            _lerp_bytes(a.split_bytes, b.split_bytes, t),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": str(self.name),
            "param_bytes": int(self.param_bytes),
        }
        if self.trainable_bytes is not None:
            out["trainable_bytes"] = int(self.trainable_bytes)
        out["optimizer_s"] = float(self.optimizer_s)
        if self.optimizer_steps:
            out["optimizer_steps"] = {str(k): float(v) for k, v in self.optimizer_steps.items()}
        if self.copy_s is not None:
            out["copy_s"] = float(self.copy_s)
        if self.step_bytes is not None:
            out["step_bytes"] = int(self.step_bytes)
        out["microbatch"] = {int(b): c.to_dict() for b, c in sorted(self.costs.items())}
        return out
