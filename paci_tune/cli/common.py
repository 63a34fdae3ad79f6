"""What several commands share: printing to stderr, checking a run's outputs, training with the live view.

May import: every layer of the package, click and rich.
"""

from __future__ import annotations

import sys

import click

from ..config import RunConfig


def stderr(msg: str) -> None:
    click.echo(msg, err=True)


def check_outputs(cfg: RunConfig, metrics: str | None) -> None:
    """The files a run writes can be written: refused now, not after the first minutes of training."""
    from ..base.files import check_writable

    if metrics is not None:
        check_writable(metrics, "--metrics")
    t = cfg.training
    if t.checkpoint_every and t.checkpoint_dir:
        check_writable(t.checkpoint_dir, "training.checkpoint_dir", folder=True)


def train_with_view(cfg: RunConfig, *, metrics: str | None, resume: bool, live: bool) -> None:
    """Resolve and train ``cfg`` with the live view (``train`` and ``apply``); failed workers exit non-zero."""
    from ..train.run import WorkersFailed, resolve_run, run_training
    from .ui import TrainView

    check_outputs(cfg, metrics)
    cfg = resolve_run(cfg, log=stderr)  # any measuring prints before the live view starts
    view = TrainView(live=live)
    try:
        with view:
            run_training(cfg, on_record=view.on_record, metrics=metrics, resume=resume, log=stderr)
    except WorkersFailed as e:
        stderr(e.message)
        sys.exit(e.exit_code)
