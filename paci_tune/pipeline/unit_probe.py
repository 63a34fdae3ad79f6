"""What :func:`.checks.check_units` measures on a model's units besides their contract: cost and causality.

- **Cost.** A model with no cost of its own (a user ``model.entry``, a transformers model: ``flops=None``)
  is cut, when no profile says better, by its units' forward FLOPs per token, counted here by
  :class:`torch.utils.flop_counter.FlopCounterMode` on the sample the check runs anyway. Parameter
  counts, the fallback before, price an embedding (a table lookup: no FLOPs) like the head of the same
  size (a matmul per token), and cut a Llama-vocabulary toy ``[1, 1, 15, 1]`` at 4 stages.
- **Causality.** A next-token model's logits at position ``i`` may depend on tokens ``0..i`` only. A
  model that sees the future (eager attention handed ``attention_mask=None`` attends both ways)
  trains to a loss that is a lie and generates garbage. The probe runs the units on two random-token
  samples differing in the last token only: any earlier position of any unit's output that moves beyond
  a tight floating-point tolerance is a leak, and the first such unit and position are reported.

Both run in eval mode (:func:`eval_mode`): dropout would move every position. May import: torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

LEAK_RTOL = 1e-5
"""A leak is a change above this fraction of the output's largest magnitude (fp32 rounding is ~1e-7)."""
PROBE_SEED = 20240607
"""The probe's token sample comes from its own generator: the caller's RNG is untouched."""


@contextlib.contextmanager
def eval_mode(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module (and submodule) in eval mode inside, each back in the mode it had on leaving."""
    saved = [(m, m.training) for unit in modules for m in unit.modules()]
    for unit in modules:
        unit.eval()
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


def _cpu_sdpa_flops(query: torch.Size, key: torch.Size, value: torch.Size, *args: object, **kwargs: object) -> int:
    """The CPU's fused attention (``F.scaled_dot_product_attention`` on a CPU), which FlopCounterMode has no
    formula for: the same count as its GPU kernels'."""
    return sdpa_flop_count(query, key, value)


_CUSTOM = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def counted(unit: nn.Module, h: object) -> tuple[object, float]:
    """``unit(h)`` and the forward FLOPs it took (matmuls, convolutions, attention: FlopCounterMode's formulas).

    A dispatch mode's first use imports ``torch._dynamo``: about a second, once per process.
    """
    with FlopCounterMode(display=False, custom_mapping=_CUSTOM) as counter:
        out = unit(h)
    return out, float(counter.get_total_flops())


@dataclass(frozen=True)
class Leak:
    """A unit whose output at an earlier position moved when only the last token changed."""

    unit: int
    position: int
    change: float  # the largest absolute change at the earlier positions
    scale: float  # the output's largest magnitude, for the relative size


def _moved(a: torch.Tensor, b: torch.Tensor, t: int) -> tuple[int, float, float] | None:
    """First earlier position (< t - 1) at which ``a`` and ``b`` differ beyond the tolerance, if any."""
    if a.shape != b.shape or a.dim() < 2 or a.shape[1] != t or not a.is_floating_point():
        return None  # not a (b, T, ...) activation: nothing to compare position by position
    diff = (a[:, : t - 1].double() - b[:, : t - 1].double()).abs().nan_to_num(nan=float("inf"))
    scale = float(a.double().abs().max().nan_to_num(nan=0.0))
    per_pos = diff.transpose(0, 1).reshape(t - 1, -1).amax(dim=1)
    over = (per_pos > LEAK_RTOL * max(scale, 1.0)).nonzero()
    if over.numel() == 0:
        return None
    return int(over[0, 0]), float(per_pos.max()), scale


def first_leak(
    units: Sequence[nn.Module], vocab_size: int, t: int, on_error: Callable[[int, Exception], None]
) -> Leak | None:
    """Run the chain on two random-token samples that differ only in the last token; the first leak.

    ``on_error(i, exc)``: unit ``i`` raised on the random sample (it must raise itself: a refusal).
    """
    if t < 2 or vocab_size < 2:
        return None  # no earlier position, or no other token to put last
    gen = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randint(0, vocab_size, (1, t), generator=gen)
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1 + torch.randint(0, vocab_size - 1, (), generator=gen)) % vocab_size
    a: object = x
    b: object = y
    for i, unit in enumerate(units):
        try:
            a, b = unit(a), unit(b)
        except Exception as exc:  # the user's model on tokens of its vocabulary: the caller names it
            on_error(i, exc)
            raise
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            moved = _moved(a, b, t)
            if moved is not None:
                return Leak(i, *moved)
    return None
