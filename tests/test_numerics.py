"""The headline invariant: the flush schedules train exactly like plain gradient accumulation.

The oracle is written from scratch (``tests/helpers/oracles.py``): one process, the model's units
chained in order, the same micro-batches, ``cross_entropy / a`` accumulated over a window,
``torch.optim.AdamW`` with weight decay on matrices only, and the learning rate by its own formula.
The trainer under test runs in this process on the emulated runtime.

PACI itself (P >= 2) is checked against a second oracle at the end of the file: a closed-form
simulation of PACI's semantics on a network of linear layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.cli import run_in_process, summary_of, train_losses
from helpers.configs import make_config, merge
from helpers.oracles import CONSTANT_LR, numerics_doc, plain_training
from torch import nn

from paci_tune.data import MicroBatchStream, load_source
from paci_tune.model import load_model

COSINE_LR = {"warmup_fraction": 0.25, "min_ratio": 0.1, "reference_batch": 16, "scaling": "sqrt"}


def run_and_compare(doc: dict[str, Any]) -> None:
    records = run_in_process(doc)
    got = train_losses(records)
    want, want_val, want_lrs = plain_training(doc)
    assert len(got) == doc["training"]["steps"]
    assert got == pytest.approx(want, abs=1e-5, rel=0)
    train = sorted((r for r in records if r["event"] == "train"), key=lambda r: r["step"])
    assert [r["lr"] for r in train] == pytest.approx(want_lrs, rel=1e-12)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)


@pytest.mark.parametrize(
    ("schedule", "stages", "extra"),
    [
        ("1f1b", 2, {}),
        ("1f1b", 4, {}),
        ("gpipe", 2, {}),
        ("gpipe", 4, {}),
        ("paci", 1, {}),
        ("1f1b", 2, {"partition": [1, 3]}),
        ("1f1b", 4, {"inflight": 1}),
        # PACI with one micro-batch in flight per stage never crosses an update: plain again
        ("paci", 4, {"inflight": 1}),
    ],
    ids=lambda v: str(v),
)
def test_flush_schedules_equal_plain_accumulation(schedule: str, stages: int, extra: dict):
    run_and_compare(numerics_doc(schedule, stages, CONSTANT_LR, **extra))


@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 2), ("gpipe", 4), ("paci", 1)])
def test_flush_schedules_equal_plain_with_warmup_cosine_schedule(schedule: str, stages: int):
    run_and_compare(numerics_doc(schedule, stages, COSINE_LR))


@pytest.mark.parametrize(("schedule", "stages"), [("paci", 1), ("1f1b", 2), ("gpipe", 4)])
def test_grad_clip_clips_the_global_norm_like_plain_training(schedule: str, stages: int):
    """``optimizer.grad_clip`` means what it means in single-process training: clip the norm of the
    whole model's gradient. A flush schedule must not turn that into a per-stage clip, or the same
    config trains differently at every pipeline depth (0.5 is active on most of these steps)."""
    doc = numerics_doc(schedule, stages, CONSTANT_LR)
    doc["optimizer"]["grad_clip"] = 0.5
    run_and_compare(doc)


@pytest.mark.parametrize("stages", [2, 4])
def test_paci_is_stale_but_close(stages: int):
    doc = numerics_doc("paci", stages, CONSTANT_LR)
    doc["optimizer"]["lr"] = 1e-3  # staleness costs about one step of progress: keep steps small
    got = train_losses(run_in_process(doc))
    want, _, _ = plain_training(doc)
    diffs = [abs(g - w) for g, w in zip(got, want, strict=True)]
    assert diffs[0] < 1e-6, "the first batch sees the initial weights in both"
    assert max(diffs) > 1e-3, "PACI with P >= 2 must use stale weights, yet it matched plain training"
    assert max(diffs) < 0.05


def test_paci_learns_the_markov_chain():
    """Tiny GPT on an order-1 Markov chain (64 tokens, 4 successors each): context is learned."""
    doc = make_config(
        training={"steps": 80, "global_batch": 8, "eval_every": 1000, "eval_sequences": 8},
        optimizer={"lr": 1e-2, "weight_decay": 0.0},
        lr_schedule={"warmup_fraction": 0.05, "min_ratio": 0.1, "scaling": "none"},
        pipeline={"schedule": "paci", "stages": 2, "window": 2},
    )
    records = run_in_process(doc)
    source = load_source(doc["data"], None)
    assert source.unigram_entropy > 3.5  # what a model that ignores context reaches
    summary = summary_of(records)
    assert summary["final_val_loss"] < source.unigram_entropy - 1.0
    assert summary["final_val_loss"] > source.entropy_rate - 0.05  # cannot beat the chain's entropy rate
    assert summary["max_drift"] == 1


# ------------------------------------------------------------- PACI against its own simulation
#
# For a network of an embedding and bias-free linear layers every gradient has a closed form, so
# PACI's semantics can be simulated without autograd: a backward multiplies by the weights the
# stage holds *now* and by the activations it saved at forward time. The per-stage order is
# derived here from the definition (1F1B with P - s in flight, never flushing, a step after
# every a backwards), not read from the schedule module.

SIM_VOCAB, SIM_WIDTH, SIM_SEQ = 64, 16, 8


def linear_units(vocab: int = SIM_VOCAB, width: int = SIM_WIDTH, depth: int = 2) -> list[nn.Module]:
    """Entry model for the trainer: Embedding, ``depth`` square Linears, the output Linear."""
    return [
        nn.Embedding(vocab, width),
        *(nn.Linear(width, width, bias=False) for _ in range(depth)),
        nn.Linear(width, vocab, bias=False),
    ]


def paci_local_order(stage: int, stages: int, window: int, mbs: list[int]) -> list[tuple[str, int]]:
    order, held, nxt_f, nxt_b, backs = [], 0, 0, 0, 0
    cap = stages - stage
    while nxt_b < len(mbs):
        if nxt_f < len(mbs) and held < cap:
            order.append(("F", mbs[nxt_f]))
            nxt_f, held = nxt_f + 1, held + 1
            continue
        order.append(("B", mbs[nxt_b]))
        nxt_b, held, backs = nxt_b + 1, held - 1, backs + 1
        if backs % window == 0:
            order.append(("S", 0))
    return order


def simulate_paci(doc: dict[str, Any], sizes: list[int]) -> list[float]:
    """PACI by hand in float64: each stage's weights, its AdamW, its local order of F, B and S.

    ``pipeline.backward_weights``: ``current`` multiplies each backward by the weights of *now*;
    ``forward`` by a copy of the weights taken at that micro-batch's forward.
    """
    t, opt_doc, pipe = doc["training"], doc["optimizer"], doc["pipeline"]
    at_forward = pipe.get("backward_weights", "forward") == "forward"
    stages, a, steps = pipe["stages"], pipe["window"], t["steps"]
    b = t["global_batch"] // a
    source = load_source(doc["data"], None)
    loaded = load_model(doc["model"], source.vocab_size, t["seed"])
    weights = [loaded.units[i].weight.detach().double().clone() for i in range(loaded.n_units)]
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    stage_units = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
    grads = [torch.zeros_like(w) for w in weights]
    opts = [
        torch.optim.AdamW(
            [weights[i].requires_grad_(False) for i in units],
            lr=opt_doc["lr"],
            betas=tuple(opt_doc["betas"]),
            eps=opt_doc["eps"],
            weight_decay=opt_doc["weight_decay"],
        )
        for units in stage_units
    ]
    stream = MicroBatchStream(source.train, loaded.block_size, b, t["seed"])
    mbs = list(range(steps * a))
    orders = [paci_local_order(s, stages, a, mbs) for s in range(stages)]
    acts: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> input activation from stage - 1
    back: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> gradient from stage + 1
    saved: dict[tuple[int, int], list[torch.Tensor]] = {}  # (stage, mb) -> each unit's input; + softmax grad
    losses: dict[int, float] = {}
    pos = [0] * stages
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                op, m = orders[s][pos[s]]
                if op == "F":
                    if s > 0 and (s, m) not in acts:
                        break
                    x, y = stream.get(m)
                    h = x if s == 0 else acts.pop((s, m))
                    ins = []
                    for i in stage_units[s]:
                        ins.append((h, weights[i].clone() if at_forward else weights[i]))
                        h = weights[0][h] if i == 0 else h @ weights[i].T
                    if s == stages - 1:
                        logits = h.reshape(-1, SIM_VOCAB)
                        logp = torch.log_softmax(logits, dim=-1)
                        target = y.flatten()
                        losses[m] = float(-logp[torch.arange(len(target)), target].mean())
                        dlogits = logp.exp()
                        dlogits[torch.arange(len(target)), target] -= 1.0
                        ins.append((dlogits / len(target) / a).reshape(h.shape))  # saved at forward time
                    else:
                        acts[(s + 1, m)] = h
                    saved[(s, m)] = ins
                elif op == "B":
                    if s < stages - 1 and (s, m) not in back:
                        break
                    ins = saved.pop((s, m))
                    g = ins.pop() if s == stages - 1 else back.pop((s, m))
                    for i, (h_in, w) in zip(reversed(stage_units[s]), reversed(ins), strict=True):
                        if i == 0:
                            grads[0].index_put_((h_in.flatten(),), g.reshape(-1, SIM_WIDTH), accumulate=True)
                        else:
                            grads[i] += g.reshape(-1, g.shape[-1]).T @ h_in.reshape(-1, h_in.shape[-1])
                            g = g @ w  # the weights of now (current), or the forward's copy
                    if s > 0:
                        back[(s - 1, m)] = g
                else:
                    for i in stage_units[s]:
                        weights[i].grad = grads[i]
                    opts[s].step()
                    for i in stage_units[s]:
                        weights[i].grad = None
                        grads[i] = torch.zeros_like(weights[i])
                pos[s] += 1
                progressed = True
        assert progressed, "the simulated PACI schedule deadlocked"
    return [sum(losses[m] for m in range(k * a, k * a + a)) / a for k in range(steps)]


@pytest.mark.parametrize("backward_weights", ["current", "forward"])
@pytest.mark.parametrize(
    ("sizes", "window"), [([2, 2], 1), ([2, 2], 4), ([1, 2, 1], 2), ([1, 1, 1, 1], 1), ([1, 1, 1, 1], 4)]
)
def test_paci_equals_an_independent_simulation_of_paci(sizes: list[int], window: int, backward_weights: str):
    doc = make_config(
        training={"steps": 10, "global_batch": 8, "eval_every": 1000, "eval_sequences": 2},
        optimizer={"lr": 2e-2},
        lr_schedule=CONSTANT_LR,
        pipeline={
            "schedule": "paci",
            "stages": len(sizes),
            "window": window,
            "partition": sizes,
            "backward_weights": backward_weights,
        },
    )
    doc["model"] = {"entry": "test_numerics:linear_units", "block_size": SIM_SEQ}
    got = train_losses(run_in_process(doc))
    want = simulate_paci(doc, sizes)
    assert got == pytest.approx(want, abs=1e-5, rel=0)
    # and the simulation is not plain training in disguise: one stage has no staleness
    plain = simulate_paci(merge(doc, {"pipeline": {"stages": 1, "partition": [4]}}), [4])
    assert max(abs(w - p) for w, p in zip(want, plain, strict=True)) > 1e-3
    # nor the other semantics in disguise (every case here has micro-batches that cross an update)
    other = "current" if backward_weights == "forward" else "forward"
    alt = simulate_paci(merge(doc, {"pipeline": {"backward_weights": other}}), sizes)
    assert max(abs(w - a) for w, a in zip(want, alt, strict=True)) > 1e-6
