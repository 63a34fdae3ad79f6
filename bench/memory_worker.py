"""One rank of several distributed training runs in a row, each run's summary written by its reporter.

Run under torchrun (``bench/memory_model.py`` launches it): ``python -m torch.distributed.run
--nproc-per-node P bench/memory_worker.py OUT CONFIG...``. Each CONFIG is trained as ``paci-tune train
CONFIG --runtime distributed`` trains it (the run resolved, the Trainer on the distributed runtime), one
after another in the same P processes, so a matrix of schedules and precisions pays torch's import and
the process group's start once. The reporting rank writes ``OUT/<config stem>.json``: the run's summary
record. Between runs every rank collects its garbage and, on CUDA, resets the allocator's peak, so each
run's ``peak_allocated_bytes`` is its own (the CPU meter is the runtime's own, made with the run).
"""

from __future__ import annotations

import gc
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


def run_one(config: Path, out: Path) -> None:
    """Train ``config`` on the distributed runtime; the reporter writes its summary to ``out``."""
    cfg = load_config(str(config), {"pipeline.runtime": "distributed"})
    reporter = dist.get_rank() == reporter_rank(cfg.pipeline.stages)
    sink = RecordSink(None, None, active=reporter)
    trainer = Trainer(resolve_run(cfg), sink, distributed=True)
    trainer.run()
    if reporter:
        summary = next(r for r in reversed(sink.records) if r.get("event") == "summary")
        out.write_text(json.dumps(summary))
    del trainer, sink


def main() -> None:
    out, configs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    for config in configs:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        run_one(config, out / f"{config.stem}.json")
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as paci_tune.worker: gloo's teardown at exit can abort a finished process


if __name__ == "__main__":
    main()
