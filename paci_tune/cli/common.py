"""What several commands share: printing to stderr, training a resolved run with the live view.

May import: :mod:`paci_tune.pipeline` (the resolved run), :mod:`paci_tune.train`, click and rich.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from ..pipeline.factory import ResolvedRun

if TYPE_CHECKING:
    from ..train.sinks import SinkSpec


def stderr(msg: str) -> None:
    click.echo(msg, err=True)


def train_with_view(
    run: ResolvedRun, *, metrics: str | None, resume: bool, live: bool, sinks: Sequence[SinkSpec] = ()
) -> None:
    """Train a resolved run with the live view (``train`` and ``apply``) and the ``--log`` ``sinks``; failed
    workers exit non-zero."""
    from ..train.run import WorkersFailed, run_training
    from .ui import TrainView

    view = TrainView(live=live)
    try:
        with view:
            run_training(run, on_record=view.on_record, metrics=metrics, resume=resume, log=stderr, sinks=sinks)
    except WorkersFailed as e:
        stderr(e.message)
        sys.exit(e.exit_code)
