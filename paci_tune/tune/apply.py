"""``paci-tune apply``'s run: the recommended trial's configuration, with the user's overrides.

Checkpoints go beside ``best.yaml`` so an interrupted run continues with ``--resume``; on the
trial's own budget the first one comes after the trial's steps, so ``apply`` trains exactly the
numerics of the trial it recommends (a PACI checkpoint drains the pipeline).

:func:`prepare_apply` is the whole of ``apply`` before training: the run derived, every output
checked writable, an existing run's checkpoints refused without ``--resume``, the run resolved
once and written out. The command line only renders it. May import: :mod:`paci_tune.config`,
:mod:`paci_tune.train`, :mod:`paci_tune.pipeline` (the resolved run), :mod:`paci_tune.base`, :mod:`paci_tune.errors` and
the tune layer's :mod:`.bestfile`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.files import check_writable
from ..config import RunConfig, derive_run
from ..errors import ConfigError
from ..pipeline.factory import ResolvedRun
from ..train import checkpoint
from ..train.launch import n_processes, torchrun_command, write_resolved
from ..train.run import check_outputs, resolve_run
from .bestfile import read_best


def apply_run(best: str | Path, overrides: dict[str, Any], *, until: str = "target") -> RunConfig:
    """The run ``apply`` trains: ``best``'s ``run`` plus ``overrides`` (dotted keys of what was given).

    ``until="budget"`` trains through the whole budget instead of stopping at the target.
    """
    best_file = read_best(best)  # the whole file checked first: a bad value never reaches a run
    run_doc = best_file.run
    best_path = Path(best).resolve()
    over = dict(overrides)
    if until == "budget":
        over["training.target_val_loss"] = None
    over.setdefault("training.checkpoint_dir", str(best_path.parent / f"{best_path.stem}-checkpoints"))
    if "training.checkpoint_every" not in over and not run_doc["training"].get("checkpoint_every"):
        # A checkpoint drains the pipeline, which changes PACI's numbers after it. On the trial's own
        # budget, checkpoints go every trial-length, so the steps the trial ran are trained exactly as
        # it trained them; on another budget (the LR schedule changes anyway), about four over the run.
        trial_steps = best_file.trial_steps or 100
        steps = over.get("training.steps")
        over["training.checkpoint_every"] = int(trial_steps) if steps is None else max(1, int(steps) // 4)
    if over.get("training.steps") is not None:
        over["training.eval_every_seconds"] = None
        over["training.eval_every"] = max(1, int(over["training.steps"]) // 8)
    return derive_run(run_doc, over)


def run_file_for(best: str | Path) -> Path:
    """Where ``apply`` writes the resolved run it trains: ``best.run.yaml`` beside ``best.yaml``."""
    p = Path(best).resolve()
    return p.parent / f"{p.stem}.run.yaml"


@dataclass(frozen=True)
class PreparedApply:
    """``apply``'s run, resolved and written beside best.yaml, ready to train or to show."""

    best: Path
    run: ResolvedRun
    run_path: Path

    def launch_commands(self, *, resume: bool, metrics: str | None) -> list[list[str]]:
        """What a user would type to train the written run: ``paci-tune train``, and for the distributed
        runtime the torchrun line it starts the workers with."""
        cmd = ["paci-tune", "train", str(self.run_path)] + (["--resume"] if resume else [])
        if metrics:
            cmd += ["--metrics", metrics]
        cfg = self.run.config
        if cfg.pipeline.runtime != "distributed":
            return [cmd]
        return [cmd, torchrun_command(self.run_path, n_processes(cfg))]

    def describe(self) -> str:
        lay = self.run.layout
        return (f"training {lay.schedule} P={lay.stages} D={lay.data_parallel} a={lay.window} "
                f"b={lay.microbatch_size} from {self.best} (config {self.run_path})")  # fmt: skip


def prepare_apply(
    best: str | Path,
    overrides: dict[str, Any],
    *,
    until: str,
    metrics: str | None,
    resume: bool,
    dry_run: bool,
    log: Callable[[str], None] | None = None,
) -> PreparedApply:
    """Everything ``apply`` does before it trains (module docstring); raises ConfigError before any work."""
    cfg = apply_run(best, overrides, until=until)
    check_writable(run_file_for(best), "best.yaml (apply writes its run beside it)")
    check_outputs(cfg, metrics)
    folder = cfg.training.checkpoint_dir
    if not dry_run and not resume and folder and checkpoint.latest(Path(folder)):
        raise ConfigError("--resume", False, f"--resume, or a new --checkpoint-dir: {folder} already holds "
                          "checkpoints of a run")  # fmt: skip
    run = resolve_run(cfg, log=log)
    return PreparedApply(Path(best), run, write_resolved(run.config, run_file_for(best)))
