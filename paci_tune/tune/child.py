"""``python -m paci_tune.tune.child PARENT_PID RUN.yaml EVENTS METRICS``: one trial's process.

It trains the trial's run through the train layer (:func:`paci_tune.train.run_training`), appending
every record to EVENTS as it happens (the search tails it) and writing METRICS at the end; it dies
with the search that started it (SIGKILL included), so a killed search leaves no trial training.
Exit codes and the log's last line tell the runner why a trial failed (:func:`.runner.crash_reason`):
2 with an ``error:`` line for a configuration this machine refuses, a traceback otherwise.

A search forks its trials from a server that has already imported this module (:func:`preload`,
:mod:`paci_tune.base.zygote`) and calls :func:`forked`, the same :func:`main` with torch's threads
set from the environment the runner asked for. May import: :mod:`paci_tune.train`,
:mod:`paci_tune.config`, :mod:`paci_tune.model`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import json
import os
import sys

from ..base.files import read_yaml
from ..base.processes import Record, die_with_parent
from ..config import derive_run
from ..errors import ConfigError
from ..train.run import WorkersFailed, resolve_run, run_training


def _log_line(rec: Record) -> str | None:
    """The trial log's plain progress: validations and the end."""
    kind = rec.get("event")
    if kind == "eval":
        return f"step {rec['step']}: val_loss {rec['val_loss']:.4f} at {rec['clock']:.4g}s"
    if kind == "summary":
        return f"done: {rec['steps']} steps, {rec['tokens_per_s']:,.0f} tokens/s, val_loss {rec['final_val_loss']}"
    return None


def main(config: str, events_path: str, metrics: str) -> int:
    with open(events_path, "a", buffering=1) as events:

        def on_record(rec: Record) -> None:
            events.write(json.dumps(rec) + "\n")
            line = _log_line(rec)
            if line:
                print(line, flush=True)

        try:
            log = lambda m: print(m, flush=True)  # noqa: E731
            run = resolve_run(derive_run(read_yaml(config, "trial")), log=log)
            run_training(run, on_record=on_record, metrics=metrics, log=log)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        except WorkersFailed as e:
            print(e.message, file=sys.stderr, flush=True)
            return e.exit_code
    return 0


def preload() -> None:
    """The fork server's one-time work: this module's imports, and torch's first model built on the meta
    device (its kernels load lazily, about a CPU-second). Nothing is computed: a server that has run a
    parallel region cannot fork safely."""
    import torch

    from ..model.gpt import Block, Embedding, GPTConfig, Head
    from ..train import loop  # noqa: F401 - the trainer's modules load when a run starts; here, once

    cfg = GPTConfig(n_layer=1, n_head=1, d_model=8, block_size=8, vocab_size=8)
    with torch.device("meta"):
        Embedding(cfg), Block(cfg), Head(cfg)


def forked(config: str, events_path: str, metrics: str) -> int:
    """:func:`main` in a child forked from the server: torch's threads as ``OMP_NUM_THREADS`` asks (read by
    OpenMP when the server started, so it is set here)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    return main(config, events_path, metrics)


if __name__ == "__main__":
    die_with_parent(parent=int(sys.argv[1]))
    sys.exit(main(*sys.argv[2:5]))
