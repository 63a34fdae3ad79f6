"""A from-scratch PACI with forward-time weights, on the optimizers :func:`helpers.oracles.oracle_optimizers` builds.

Shared by the backward-weights, optimizer and staleness tests; none of it is the code under test:

- :func:`oracle_losses`: each stage keeps its live weights and its own optimizer(s); at every forward
  it deep-copies the stage's module and runs the micro-batch through the copy, whose gradients are
  added to the live weights' at the backward; steps after every ``a`` backwards, in the stage's own
  1F1B order with at most ``min(P - s, inflight)`` in flight; D replicas average their gradients
  before each step. In bf16 the live weights are bf16 with fp32 masters, each backward's bf16
  gradient summed in fp32, the masters written back after the step. With ``predict_weights`` the
  live weights after a step are ``W + tau (W - W_before)`` (tau = ceil((P-s-1)/a)), the masters W.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from helpers.oracles import oracle_optimizers, paci_order
from paci_tune.data import MicroBatchStream, load_source
from paci_tune.model import load_model
from paci_tune.model.loss import next_token_loss


class OracleStage:
    """A stage of the from-scratch PACI: live weights and fp32 masters, its optimizer(s), copies per forward."""

    def __init__(
        self,
        units: list[nn.Module],
        cfg: dict,
        dtype: torch.dtype,
        hidden: list[bool],
        predict: int = 0,
    ) -> None:
        self.live = nn.Sequential(*units).to(dtype)
        named = [(n, p) for n, p in self.live.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.masters = [p.detach().float().clone() for p in self.params]
        flags = [hidden[int(n.split(".")[0])] for n, _ in named]
        self.opts = oracle_optimizers(self.masters, cfg, flags)
        self.dtype, self.predict = dtype, predict
        self.saved: dict[int, tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        frozen = copy.deepcopy(self.live)  # the weights of this forward, for this micro-batch's backward
        if x.is_floating_point():
            x = x.detach().to(self.dtype).requires_grad_(True)
        out = frozen(x)
        self.saved[mb] = (frozen, x, out)
        return out

    def backward(self, mb: int, root: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
        frozen, x, _ = self.saved.pop(mb)
        root.backward(None if grad is None else grad.to(root.dtype))
        for master, p in zip(self.masters, frozen.parameters(), strict=True):
            if p.grad is not None:
                g = p.grad.float()
                master.grad = g if master.grad is None else master.grad + g
        return x.grad if x.is_floating_point() else None

    def step(self) -> None:
        before = [m.detach().clone() for m in self.masters]
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m, w in zip(self.params, self.masters, before, strict=True):
                p.copy_(m + self.predict * (m - w))  # predict = 0: the masters themselves


def oracle_losses(doc: dict, dtype: torch.dtype = torch.float32) -> list[float]:
    """Per-global-batch train losses of PACI with forward-time weights, written from scratch (module doc).

    Every action of a stage's order runs on replica 0, 1, ..., D-1 in turn; at a step the D
    replicas' gradients are averaged (summed in replica order) and every replica steps.
    """
    t, pipe = doc["training"], doc["pipeline"]
    p_, a, d, steps = pipe["stages"], pipe["window"], pipe.get("data_parallel", 1), t["steps"]
    b = t["global_batch"] // (d * a)
    source = load_source(doc["data"], None)
    loaded = load_model(doc["model"], source.vocab_size, t["seed"])
    sizes = pipe["partition"]
    bounds = [sum(sizes[:s]) for s in range(p_ + 1)]
    base = [[loaded.units[i] for i in range(bounds[s], bounds[s + 1])] for s in range(p_)]
    hidden = [[0 < i < loaded.n_units - 1 for i in range(bounds[s], bounds[s + 1])] for s in range(p_)]
    tau = [math.ceil((p_ - s - 1) / a) if pipe.get("predict_weights") else 0 for s in range(p_)]
    reps = [
        [
            OracleStage([copy.deepcopy(u) for u in base[s]], doc["optimizer"], dtype, hidden[s], tau[s])
            for s in range(p_)
        ]
        for _ in range(d)
    ]
    streams = [MicroBatchStream(source.train, loaded.block_size, b, t["seed"], replicas=d, replica=r) for r in range(d)]
    n = steps * a
    orders = [paci_order(min(p_ - s, pipe.get("inflight") or p_), a, n) for s in range(p_)]
    acts: dict[tuple[int, int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int, int], torch.Tensor] = {}
    roots: dict[tuple[int, int, int], torch.Tensor] = {}
    losses: dict[tuple[int, int], torch.Tensor] = {}
    pos = [0] * p_
    while any(pos[s] < len(orders[s]) for s in range(p_)):
        progressed = False
        for s in range(p_):
            while pos[s] < len(orders[s]):
                op, m = orders[s][pos[s]]
                if op == "F" and s > 0 and (0, s, m) not in acts:
                    break
                if op == "B" and s < p_ - 1 and (0, s, m) not in grads:
                    break
                for r in range(d):
                    st = reps[r][s]
                    if op == "F":
                        x, y = streams[r].get(m)
                        out = st.forward(m, x if s == 0 else acts.pop((r, s, m)))
                        if s == p_ - 1:
                            loss = next_token_loss(out, y)
                            losses[(r, m)] = loss.detach()
                            roots[(r, s, m)] = loss / a
                        else:
                            roots[(r, s, m)] = out
                            acts[(r, s + 1, m)] = out.detach()
                    elif op == "B":
                        gin = st.backward(m, roots.pop((r, s, m)), None if s == p_ - 1 else grads.pop((r, s, m)))
                        if s > 0:
                            grads[(r, s - 1, m)] = gin
                if op == "S":
                    for i in range(len(reps[0][s].masters)):
                        gs = [reps[r][s].masters[i].grad for r in range(d)]
                        if gs[0] is None:
                            continue
                        total = gs[0].clone()
                        for g in gs[1:]:
                            total.add_(g)
                        total.div_(d)
                        for r in range(d):
                            reps[r][s].masters[i].grad = total.clone()
                    for r in range(d):
                        reps[r][s].step()
                pos[s] += 1
                progressed = True
        assert progressed, "the oracle's PACI schedule deadlocked"
    out = []
    for k in range(steps):
        per = [float(torch.stack([losses[(r, m)] for m in range(k * a, k * a + a)]).mean()) for r in range(d)]
        out.append(sum(per) / d)
    return out
