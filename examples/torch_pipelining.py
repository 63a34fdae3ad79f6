"""Train a tiny GPT with PyTorch's own pipelining, under torch's Schedule1F1B or paci-tune's SchedulePACI.

    torchrun --standalone --nproc-per-node 2 examples/torch_pipelining.py --schedule paci --steps 10

Everything except the schedule line is plain ``torch.distributed.pipelining`` usage, which is the
point: ``--schedule 1f1b`` steps the optimizer after every ``step()`` as torch users do, while
``--schedule paci`` hands the optimizer to ``SchedulePACI``, which steps it every ``--window``
backwards at each stage and never flushes the pipeline (``--flush`` makes it synchronous 1F1B for
an A/B run; ``--backward-weights current`` makes each backward read the weights as they are then
instead of those its forward used). The last rank prints each step's mean micro-batch loss.
``--json DIR`` writes each rank's losses, drift and weight copies to ``DIR/rank<r>.json`` (used by
the tests). ``--bf16`` converts each stage's module to bf16 (no autocast): SchedulePACI then keeps
fp32 master weights in the optimizer and writes them into the bf16 parameters in place (torch's
``--schedule 1f1b`` path steps the bf16 parameters directly, as a plain torch optimizer does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from paci_tune import SchedulePACI
from paci_tune.data import MicroBatchStream, synthetic_source
from paci_tune.model import load_model
from paci_tune.pipeline.muon import Muon as PaciMuon

SPEC = {"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32}
VOCAB = 256


def my_units(rank: int, world: int, n_units: int) -> list[int]:
    """Contiguous, near-even split of the model's units (embed, blocks, head) over the ranks."""
    bounds = [round(i * n_units / world) for i in range(world + 1)]
    return list(range(bounds[rank], bounds[rank + 1]))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())  # fp32 even for bf16 logits


def adamw(module: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (paci-tune's recipe, so the runs are comparable)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def muon_and_adamw(module: nn.Module, units: list[int], n_units: int, lr: float,
                   muon: type[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:  # fmt: skip
    """``muon`` on the 2-D weights of the hidden units (neither the model's first nor its last), AdamW on the
    rest: two optimizers, which SchedulePACI takes as a list and steps as one."""
    hidden = [p for i, unit in zip(units, module, strict=True) if 0 < i < n_units - 1
              for p in unit.parameters() if p.requires_grad and p.dim() == 2]  # fmt: skip
    taken = {id(p) for p in hidden}
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    out: list[torch.optim.Optimizer] = []
    if hidden:
        out.append(muon(hidden, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))
    if rest:
        out.append(torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=["1f1b", "paci"], default="paci")
    ap.add_argument("--flush", action="store_true", help="SchedulePACI as synchronous 1F1B-flush")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step()")
    ap.add_argument("--window", type=int, default=2, help="PACI: backwards per optimizer step")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--backward-weights",
        choices=["forward", "current"],
        default="forward",
        help="PACI: which weights a late backward reads (its forward's, or the current ones)",
    )
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (fp32 masters under PACI)")
    ap.add_argument("--muon", choices=["torch", "paci"], default=None,
                    help="Muon on the hidden matrices and AdamW on the rest: torch's Muon, or paci-tune's (fp32 "
                         "Newton-Schulz on the CPU, as optimizer.name: muon trains)")  # fmt: skip
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = load_model(SPEC, VOCAB, args.seed)
    units = my_units(rank, world, model.n_units)
    module = nn.Sequential(*[model.units[i] for i in units])
    if args.bf16:
        module.to(torch.bfloat16)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    muon = {"torch": torch.optim.Muon, "paci": PaciMuon}.get(args.muon or "")
    optimizers = muon_and_adamw(module, units, model.n_units, args.lr, muon) if muon else [adamw(module, args.lr)]
    m = args.microbatches
    if args.schedule == "1f1b":
        schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
    else:  # the one-line swap
        schedule = SchedulePACI(
            stage,
            m,
            loss_fn,
            window=args.window,
            optimizer=optimizers if args.muon else optimizers[0],  # a list: stepped as one
            flush=args.flush,
            backward_weights=args.backward_weights,
        )
    ptrs = [p.data_ptr() for p in module.parameters()]

    data = MicroBatchStream(synthetic_source(VOCAB, n_train=200_000, n_val=1_000).train, 32, args.microbatch_size, 0)
    step_losses: list[float] = []
    mb_losses: list[float] = []  # every micro-batch's, in order
    for k in range(args.steps):
        x, y = (torch.cat(t) for t in zip(*[data.get(k * m + i) for i in range(m)], strict=True))
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if args.schedule == "1f1b":
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        if rank == world - 1:
            step_losses.append(float(torch.stack(losses).detach().mean()))
            mb_losses += [float(v) for v in losses]
            print(f"step {k} loss {step_losses[-1]:.4f}", flush=True)
    if isinstance(schedule, SchedulePACI):
        schedule.drain()  # finish in-flight micro-batches before evaluating or saving

    if args.json is not None:
        out = {
            "losses": step_losses,
            "mb_losses": mb_losses,
            "ptrs_unchanged": ptrs == [p.data_ptr() for p in module.parameters()],
        }
        if isinstance(schedule, SchedulePACI):
            copies = schedule.copies_stats()["weight_copies_peak"]
            out |= {"max_drift": schedule.max_drift, "updates": schedule.updates, "weight_copies_peak": copies}
        args.json.mkdir(parents=True, exist_ok=True)
        (args.json / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
