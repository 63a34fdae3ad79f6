"""``paci-tune`` command line: click commands and rich output, nothing else."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from . import __version__
from .config import RunConfig, load_config
from .errors import ConfigError
from .options import overrides_from, run_options


class _Group(click.Group):
    """Turns bad input anywhere below into one line and exit code 2, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="paci-tune")
def main() -> None:
    """Auto-tune and run PACI asynchronous pipeline-parallel training."""


def _preflight(cfg: RunConfig, resume: bool) -> None:
    """Catch data, model and partition errors here, before any worker process starts."""
    from .pipeline.backend import choose_backend, shares_gpus, visible_gpus
    from .pipeline.factory import load_pieces

    if cfg.training.clock == "sim" and not cfg.training.profile:
        from .sim.calibrate import cached_profile

        cfg.training.profile = str(cached_profile(cfg)[1])  # measured once here, not once per worker
    load_pieces(cfg, [], distributed=True)
    p, n_gpus = cfg.pipeline, visible_gpus()
    backend = choose_backend(p.backend, p.device, p.stages, n_gpus)  # all stages run on this machine
    if shares_gpus(backend, p.device, p.stages, n_gpus):
        click.echo(
            f"note: {p.stages} stages share {n_gpus} GPU(s): NCCL needs a GPU per stage, so the stages talk over "
            "gloo through host memory (right numbers, not a speed measurement; --runtime emulated is faster here)",
            err=True,
        )
    if resume and not cfg.training.checkpoint_dir:
        raise ConfigError("training.checkpoint_dir", None, "a checkpoint folder to resume from (--checkpoint-dir)")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@run_options
@click.option("--metrics", type=click.Path(dir_okay=False), default=None, help="Write JSON-lines metrics here.")
@click.option("--resume", is_flag=True, help="Resume from the newest checkpoint in the checkpoint folder.")
@click.option("--live/--no-live", default=True, help="Rich live progress (default on a terminal) or plain lines.")
@click.option(
    "--events",
    type=click.Path(dir_okay=False),
    default=None,
    hidden=True,
    help="Append each record to this file as it happens (how a search watches its trials).",
)
def train(config: str, metrics: str | None, resume: bool, live: bool, events: str | None, **options: Any) -> None:
    """Train the model of CONFIG with a pipeline schedule (paci, 1f1b or gpipe)."""
    cfg = load_config(config, overrides_from(options))
    run_training(cfg, metrics=metrics, resume=resume, live=live, events=events)


def run_training(cfg: RunConfig, *, metrics: str | None, resume: bool, live: bool, events: str | None = None) -> None:
    """Run a validated configuration on its runtime, with the live view (``train`` and ``apply``)."""
    from .ui import TrainView

    view = TrainView(live=live)
    on_record = view.on_record
    events_file = open(events, "a", buffering=1) if events else None  # noqa: SIM115 - closed below
    if events_file is not None:

        def on_record(rec: dict[str, Any]) -> None:
            events_file.write(json.dumps(rec) + "\n")
            view.on_record(rec)

    try:
        _run_training(cfg, view, on_record, metrics=metrics, resume=resume)
    finally:
        if events_file is not None:
            events_file.close()


def _run_training(cfg: RunConfig, view: Any, on_record: Any, *, metrics: str | None, resume: bool) -> None:
    if cfg.pipeline.runtime == "emulated":
        from .train.loop import Trainer
        from .train.metrics import RecordSink

        with view:
            Trainer(cfg, RecordSink(metrics, None, on_record)).run(resume=resume)
        return

    from .pipeline.launch import log_tail, run_distributed

    _preflight(cfg, resume)
    workdir = Path(tempfile.mkdtemp(prefix="paci-tune-run-"))
    with view:
        rc = run_distributed(cfg, workdir, on_record, metrics=metrics, resume=resume)
    if rc == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    click.echo(f"error: pipeline workers exited with code {rc}; their log is {workdir / 'workers.log'}:", err=True)
    click.echo(log_tail(workdir), err=True)
    sys.exit(2 if rc == 2 else 1)


from .commands.sim import calibrate, simulate  # noqa: E402  (commands register after the group exists)
from .commands.tune import apply, search  # noqa: E402

main.add_command(search)
main.add_command(apply)
main.add_command(calibrate)
main.add_command(simulate)

if __name__ == "__main__":
    main()
