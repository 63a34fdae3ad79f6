"""One rank of a distributed training run that also writes the actions its runtime ran, in order.

Run under torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node N
tests/helpers/trace_worker.py CONFIG OUT``. Does what ``paci_tune.worker`` does (the run resolved,
the Trainer on the distributed runtime, replica 0's last stage writing ``OUT/m.jsonl``), then writes
``OUT/trace<rank>.json``: the ``repr`` of every action in the runtime's ``trace`` (``F3``, ``B3``,
``W3``, ``S0``), which only the torch-schedule runtime keeps.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from paci_tune.config import load_config
from paci_tune.pipeline.mesh import reporter_rank
from paci_tune.train.loop import Trainer
from paci_tune.train.metrics import RecordSink
from paci_tune.train.run import resolve_run


def main() -> None:
    config, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cfg = load_config(config, {"pipeline.runtime": "distributed"})
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    reporter = dist.get_rank() == reporter_rank(cfg.pipeline.stages)
    sink = RecordSink(str(out / "m.jsonl") if reporter else None, None, active=reporter)
    trainer = Trainer(resolve_run(cfg), sink, distributed=True)
    trainer.run()
    trace = [repr(a) for a in getattr(trainer.runtime, "trace", [])]
    (out / f"trace{dist.get_rank()}.json").write_text(json.dumps(trace))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as paci_tune.worker: gloo's teardown at exit can abort a finished process


if __name__ == "__main__":
    main()
