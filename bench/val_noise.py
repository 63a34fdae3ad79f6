"""How many validation sequences does the tuner need? The noise of a fixed validation set, measured.

The tuner ranks trials by when their validation loss crosses a target, so what matters is the
error of a *difference* between two models' losses on the validation set (the same set for every
trial), against the difference on the whole held-out split. This trains the example's model
(``examples/tiny-gpt.yaml``, plain single-stage training) to a few checkpoints of different quality,
scores each on every disjoint window of the held-out split, and reports, for validation sets of N
evenly spaced sequences (what :class:`paci_tune.data.ValidationSet` draws), the largest error of a
model's loss and of the difference between two models, over all pairs.

    python bench/val_noise.py            # ~3 min on a 2-core CPU
    python bench/val_noise.py --quick    # seconds: a smaller model and split (CI)
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import numpy as np
import torch

from paci_tune.config import load_config
from paci_tune.data import MicroBatchStream, ValidationSet, load_source
from paci_tune.model import load_model, next_token_loss

SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


def _forward(units: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    h = x
    for u in units:
        h = u(h)
    return h


def full_split_loss(units: list[torch.nn.Module], tokens: np.ndarray, seq: int, chunk: int = 32) -> tuple[float, int]:
    """Mean loss over every disjoint window of the held-out split (the oracle), and the window count."""
    n = (len(tokens) - 1) // seq
    total = 0.0
    with torch.no_grad():
        for start in range(0, n, chunk):
            idx = np.arange(start, min(start + chunk, n)) * seq
            rows = torch.from_numpy(tokens[idx[:, None] + np.arange(seq + 1)].astype(np.int64))
            total += float(next_token_loss(_forward(units, rows[:, :-1]), rows[:, 1:])) * len(idx)
    return total / n, n


def set_loss(units: list[torch.nn.Module], vs: ValidationSet) -> float:
    """What a run reports: the loss on the validation set's own windows."""
    with torch.no_grad():
        return vs.mean_loss([float(next_token_loss(_forward(units, x), y)) for x, y in vs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/tiny-gpt.yaml")
    ap.add_argument("--quick", action="store_true", help="a 1-layer model, 20 steps, a small split: a smoke run")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    over = {"model.n_layer": 1, "model.d_model": 32, "model.n_head": 2} if args.quick else {}
    cfg = load_config(args.config, over)
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    model = load_model(cfg.model, source.vocab_size, 0)
    units = [model.units[i] for i in range(model.n_units)]
    seq = model.block_size
    val = source.val[:40_000] if args.quick else source.val
    params = [p for u in units for p in u.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = MicroBatchStream(source.train, seq, cfg.training.global_batch, 0)
    checkpoints = (5, 10, 20) if args.quick else (40, 80, 120, 160, 200)
    sizes = [n for n in SIZES if n <= (128 if args.quick else SIZES[-1])]
    full: dict[int, float] = {}
    est: dict[int, dict[int, float]] = {n: {} for n in sizes}
    n_windows = 0
    for step in range(1, checkpoints[-1] + 1):
        x, y = stream.get(step)
        loss = next_token_loss(_forward(units, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in checkpoints:
            full[step], n_windows = full_split_loss(units, val, seq)
            for n in sizes:
                est[n][step] = set_loss(units, ValidationSet(val, seq, n, 32))
    print(
        f"{n_windows} disjoint windows of {seq} tokens in the held-out split; models after steps "
        f"{list(checkpoints)}: full-split loss " + ", ".join(f"{full[k]:.4f}" for k in checkpoints)
    )
    pairs = list(itertools.combinations(checkpoints, 2))
    small = min(abs(full[a] - full[b]) for a, b in pairs)
    print(f"smallest difference between two of the models on the whole split: {small:.4f}")
    print(f"{'N':>6} {'max |loss error|':>17} {'max |difference error|':>23}")
    for n in sizes:
        e = est[n]
        err = max(abs(e[k] - full[k]) for k in checkpoints)
        derr = max(abs((e[a] - e[b]) - (full[a] - full[b])) for a, b in pairs)
        print(f"{n:>6} {err:>17.4f} {derr:>23.4f}")
    print(f"({time.time() - t0:.0f} s)")
    assert all(math.isfinite(v) for v in full.values())


if __name__ == "__main__":
    main()
