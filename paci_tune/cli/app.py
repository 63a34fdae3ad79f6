"""``paci-tune``: the click group, its error handling, and ``paci-tune train``.

Bad input anywhere below ends the command with one line and exit code 2, any other failure with
one line and exit code 1, Ctrl-C with 130 (:mod:`.failures`, the one handler; ``--debug`` shows
the traceback). Heavy imports (torch,
optuna, matplotlib) happen inside the commands so ``paci-tune --help`` stays fast. May import:
:mod:`paci_tune.config` and :mod:`paci_tune.train` (the run of ``train``), the other commands'
modules, click and rich.
"""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from .common import stderr, train_with_view
from .export import export
from .failures import debug_requested, guarded
from .options import log_option, overrides_from, run_options
from .report import report
from .sim import calibrate, simulate
from .tune import apply, search


class _Group(click.Group):
    """Runs every command under the one failure handler: one line and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        return guarded(lambda: super(_Group, self).invoke(ctx), debug=debug_requested(bool(ctx.params.get("debug"))))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="paci-tune")
@click.option("--debug", is_flag=True, help="Show the traceback of a failure (also PACI_TUNE_DEBUG=1).")
def main(debug: bool) -> None:
    """Auto-tune and run PACI asynchronous pipeline-parallel training."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@run_options
@click.option("--metrics", type=click.Path(dir_okay=False), default=None, help="Write JSON-lines metrics here.")
@click.option("--resume", is_flag=True, help="Resume from the newest checkpoint in the checkpoint folder.")
@click.option("--live/--no-live", default=True, help="Rich live progress (default on a terminal) or plain lines.")
@log_option("--log")
def train(config: str, metrics: str | None, resume: bool, live: bool, log_to: tuple[str, ...], **options: Any) -> None:
    """Train the model of CONFIG with a pipeline schedule (paci, 1f1b, gpipe, zb-h1; interleaved on sim/rst clocks)."""
    from ..config import load_config
    from ..train.run import prepare_run
    from ..train.sinks import parse_sinks

    sinks = parse_sinks(log_to)  # a missing backend is refused before the config is even read
    run = prepare_run(load_config(config, overrides_from(options)), metrics=metrics, resume=resume, log=stderr)
    train_with_view(run, metrics=metrics, resume=resume, live=live, sinks=sinks)


for _command in (search, apply, calibrate, simulate, report, export):
    main.add_command(_command)
