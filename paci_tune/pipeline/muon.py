"""torch's Muon, with its Newton-Schulz iterations in fp32 on the CPU.

:class:`Muon` is ``torch.optim.Muon`` -- the same parameter groups, hyper-parameters, state
(``momentum_buffer``) and update: ``B <- lerp(B, g, 1 - mu)``, Nesterov's ``lerp(g, B, mu)``, the
quintic Newton-Schulz orthogonalisation, decoupled weight decay, the adjusted LR -- except where
its parameters are on the CPU: there the Newton-Schulz iterations run in fp32 instead of bf16.

Why: a CPU's fp32 gradients differ by ~1e-9 with the thread count (a matrix product's sum is split
otherwise), and so do the emulated runtime's (every core) and a distributed worker's (its share of
them). In bf16 such a difference can flip a rounding, and Newton-Schulz spreads it through the whole
update: the same run on 1 and on 2 threads differed by 1.7e-5 in the loss after 8 steps, and the
two runtimes did not train the same numbers. In fp32 they do, to float rounding. On CUDA (bf16
tensor cores, the reason torch iterates in bf16) it is torch's step unchanged. May import: torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def orthogonalize_fp32(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's quintic Newton-Schulz iteration (``torch.optim._muon``), in fp32: ~U V^T of ``update``'s SVD."""
    a, b, c = coefficients
    x = update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """torch's ``_adjust_lr``: Keller Jordan's sqrt(max(1, A/B)) (``original``) or Moonshot's 0.2 sqrt(max(A, B))."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule is None or rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr


class Muon(torch.optim.Muon):
    """``torch.optim.Muon``, whose Newton-Schulz iterations run in fp32 on the CPU (module docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is None or first.device.type != "cpu":
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = orthogonalize_fp32(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
