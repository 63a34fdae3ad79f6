"""Oracles written from scratch for the numerics tests: plain gradient accumulation in one process, the
learning rate by this file's own formula, one stage's PACI order of forwards, backwards and steps, and
the torch optimizer(s) a config's ``optimizer`` section names, from the documented rules (decay on
matrices only; Muon on the 2-D weights of the units between the model's first and last, with
``adjust_lr_fn="match_rms_adamw"``, AdamW on the rest).

Shared by the numerics, bf16, data-parallel and GPU tests (the same oracle checks the trainer on the
CPU and on CUDA); none of it is the code under test.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helpers.configs import make_config
from paci_tune.data import MicroBatchStream, ValidationSet, load_source
from paci_tune.model import load_model


def oracle_lr(doc: dict[str, Any], k: int) -> float:
    """Peak LR scaled to the global batch, linear warm-up then cosine, at progress (k+1)/steps."""
    opt, sched, t = doc["optimizer"], doc["lr_schedule"], doc["training"]
    peak = opt["lr"]
    if sched.get("reference_batch"):
        ratio = t["global_batch"] / sched["reference_batch"]
        peak *= {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[sched["scaling"]]
    p, w, floor = (k + 1) / t["steps"], sched["warmup_fraction"], sched["min_ratio"]
    if p < w:
        return peak * p / w
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w))))


DEFAULT_MOMENTUM = {"sgd": 0.9, "muon": 0.95}


def oracle_optimizers(
    params: list[torch.Tensor], cfg: dict[str, Any], hidden: list[bool]
) -> list[torch.optim.Optimizer]:
    """The optimizer(s) ``cfg`` names over ``params`` (``hidden``: per parameter, whether Muon may take it)."""
    name = cfg.get("name", "adamw")
    wd, lr = cfg.get("weight_decay", 0.1), cfg["lr"]
    betas, eps = tuple(cfg.get("betas", (0.9, 0.95))), cfg.get("eps", 1e-8)
    momentum = cfg.get("momentum") if cfg.get("momentum") is not None else DEFAULT_MOMENTUM.get(name, 0.9)

    def groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        out = [
            {"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
        ]
        return [g for g in out if g["params"]]

    if name == "sgd":
        return [torch.optim.SGD(groups(params), lr=lr, momentum=momentum)]
    if name == "nadam":
        psi = cfg.get("momentum_decay", 0.004)
        return [
            torch.optim.NAdam(
                groups(params), lr=lr, betas=betas, eps=eps, momentum_decay=psi, decoupled_weight_decay=True
            )
        ]
    if name == "muon":
        mats = [p for p, h in zip(params, hidden, strict=True) if h and p.dim() == 2]
        rest = [p for p, h in zip(params, hidden, strict=True) if not (h and p.dim() == 2)]
        out: list[Any] = []
        if mats:
            out.append(OracleMuon(mats, lr, wd, momentum, cfg.get("nesterov", True), cfg.get("ns_steps", 5)))
        if rest:
            out.append(torch.optim.AdamW(groups(rest), lr=lr, betas=betas, eps=eps))
        return out
    return [torch.optim.AdamW(groups(params), lr=lr, betas=betas, eps=eps)]


class OracleMuon:
    """Muon as its documentation states it, from scratch (Keller Jordan's algorithm, torch's coefficients): an
    EMA momentum B, Nesterov's mix, five quintic Newton-Schulz iterations in fp32 (paci-tune's precision on
    the CPU), decoupled weight decay, and Moonshot's LR match to AdamW, 0.2 sqrt(max(rows, cols))."""

    def __init__(self, params: list[torch.Tensor], lr: float, wd: float, mu: float, nesterov: bool, steps: int) -> None:
        self.param_groups = [{"params": params, "lr": lr}]
        self.wd, self.mu, self.nesterov, self.steps = wd, mu, nesterov, steps
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        for p, buf in zip(self.param_groups[0]["params"], self.bufs, strict=True):
            if p.grad is None:
                continue
            buf.lerp_(p.grad, 1 - self.mu)
            x = p.grad.lerp(buf, self.mu) if self.nesterov else buf.clone()
            tall = x.shape[0] > x.shape[1]
            x = x.T if tall else x
            x = x / x.norm().clamp(min=1e-7)
            for _ in range(self.steps):
                a = x @ x.T
                x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
            x = x.T if tall else x
            p.mul_(1 - lr * self.wd)
            p.sub_(lr * 0.2 * math.sqrt(max(p.shape)) * x)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


def plain_training(doc: dict[str, Any]) -> tuple[list[float], float, list[float]]:
    """Single-process gradient accumulation; returns per-batch losses, final val loss and LRs."""
    t, opt_doc, pipe = doc["training"], doc["optimizer"], doc["pipeline"]
    a = pipe["window"]
    b = t["global_batch"] // a
    source = load_source(doc["data"], None)
    loaded = load_model(doc["model"], source.vocab_size, t["seed"])
    net = nn.Sequential(*(loaded.units[i] for i in range(loaded.n_units)))
    params = list(net.parameters())
    hidden = [0 < int(n.split(".")[0]) < loaded.n_units - 1 for n, _ in net.named_parameters()]
    opts = oracle_optimizers(params, opt_doc, hidden)
    stream = MicroBatchStream(source.train, loaded.block_size, b, t["seed"])
    losses, lrs = [], []
    for k in range(t["steps"]):
        total = 0.0
        for j in range(k * a, k * a + a):
            x, y = stream.get(j)
            loss = F.cross_entropy(net(x).flatten(0, -2), y.flatten())
            (loss / a).backward()
            total += loss.item()
        if opt_doc.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(params, opt_doc["grad_clip"])  # the norm of the whole model's gradient
        lr = oracle_lr(doc, k)
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total / a)
        lrs.append(lr)
    val = ValidationSet(source.val, loaded.block_size, t["eval_sequences"], 32)  # 32: eval_microbatch_size's default
    with torch.no_grad():
        val_loss = val.mean_loss([F.cross_entropy(net(x).flatten(0, -2), y.flatten()).item() for x, y in val])
    return losses, val_loss, lrs


CONSTANT_LR = {"warmup_fraction": 0.0, "min_ratio": 1.0, "scaling": "none"}


def numerics_doc(schedule: str, stages: int, lr_schedule: dict[str, Any], **pipeline: Any) -> dict[str, Any]:
    return make_config(
        training={"steps": 8, "global_batch": 8, "eval_every": 1000, "eval_sequences": 4},
        optimizer={"lr": 3e-3},
        lr_schedule=lr_schedule,
        pipeline={"schedule": schedule, "stages": stages, "window": 4, **pipeline},
    )


def paci_order(cap: int, window: int, n: int) -> list[tuple[str, int]]:
    """One stage's PACI order: forward while fewer than ``cap`` are in flight, else backward; a step every window."""
    order, f, b = [], 0, 0
    while b < n:
        if f < n and f - b < cap:
            order.append(("F", f))
            f += 1
        else:
            order.append(("B", b))
            b += 1
            if b % window == 0:
                order.append(("S", b // window - 1))
    return order
