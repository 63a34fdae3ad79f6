"""Pipeline worker: one process per stage replica, started by ``torchrun``.

``paci-tune train --runtime distributed`` launches this for the user on one machine. For several
machines, run the same entry point under your own launch on every node, e.g.::

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD_HOST:29500 \\
        -m paci_tune.worker config.yaml --stages 8 --metrics run.jsonl

The world size must equal stages x data_parallel (P x D; e.g. ``--stages 4 --data-parallel 2``
on the two nodes above): stage s of replica r runs on global rank r * P + s
(:mod:`paci_tune.pipeline.mesh`), and a different world size is refused with that message.
Replica 0's last stage, rank P - 1, reports progress and writes the metrics file and the ``--log``
sinks (``--log-to tensorboard:DIR``, repeatable, :mod:`paci_tune.train.sinks`; torchrun takes ``--log``
for an abbreviation of its own options). An entry
point, like :mod:`paci_tune.cli`. May import: the train layer and what it stands on (:mod:`paci_tune.train`,
:mod:`paci_tune.pipeline`, :mod:`paci_tune.config`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`), and
the command-line options of :mod:`paci_tune.cli`.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import click

from .base.processes import die_with_parent, threads_per_process
from .cli.options import log_option, overrides_from, run_options
from .config import load_config
from .errors import ConfigError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@run_options
@click.option("--metrics", type=click.Path(dir_okay=False), default=None, help="Write JSON-lines metrics here.")
@click.option("--events", type=click.Path(dir_okay=False), default=None, help="Append live records here.")
@click.option("--resume", is_flag=True, help="Resume from the newest checkpoint in the checkpoint folder.")
@log_option("--log-to", "--log")  # torchrun refuses --log on its command line (cli.options.log_option)
@click.option("--checked", is_flag=True, hidden=True, help="The launcher checked this resolved config.")
def main(
    config: str,
    metrics: str | None,
    events: str | None,
    resume: bool,
    log_to: tuple[str, ...],
    checked: bool,
    **options: object,
) -> None:
    """Run this rank's pipeline stage of CONFIG."""
    import torch
    import torch.distributed as dist

    from .pipeline.backend import choose_backend, visible_gpus
    from .pipeline.mesh import reporter_rank
    from .train.loop import Trainer
    from .train.metrics import RecordSink
    from .train.run import resolve_run
    from .train.sinks import parse_sinks

    die_with_parent()  # a worker never outlives the torchrun agent that started it
    rank = int(os.environ.get("RANK", "0"))
    try:
        sinks = parse_sinks(log_to)  # every rank refuses a bad value alike; only the reporter opens the sinks
        cfg = load_config(config, {**overrides_from(options), "pipeline.runtime": "distributed"})
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(threads_per_process(local_world))
        backend = choose_backend(cfg.pipeline.backend, cfg.pipeline.device, local_world, visible_gpus())
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
        reporter = dist.get_rank() == reporter_rank(cfg.pipeline.stages)
        sink = RecordSink(metrics, events, active=reporter, sinks=sinks)
        trainer = Trainer(resolve_run(cfg, checked=checked), sink, distributed=True)
        trainer.run(resume=resume)
        dist.barrier()  # every rank is done: metrics and checkpoints are written and closed
    except ConfigError as e:
        if rank == 0:
            click.echo(f"error: {e}", err=True)
        sys.exit(2)
    # Leave without running C++ destructors: tearing down gloo's threads at exit aborted the
    # process ("terminate called without an active exception") in about 1 run in 15 on a 2-core
    # machine, after all work was done -- and turned a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
