"""``paci-tune apply``'s run: the recommended trial's configuration, with the user's overrides.

Checkpoints go beside ``best.yaml`` so an interrupted run continues with ``--resume``; on the
trial's own budget the first one comes after the trial's steps, so ``apply`` trains exactly the
numerics of the trial it recommends (a PACI checkpoint drains the pipeline).

:func:`prepare_apply` is the whole of ``apply`` before training: the run derived, every output
checked writable, an existing run's checkpoints refused without ``--resume``, the run resolved
once and written out. A warm-started recommendation starts from the search's checkpoint
(``run.training.init_from``); where that is not on this machine, the warm-up best.yaml records is
trained first, beside it (:func:`warm_up_first`). A user model (``model.entry``) of either run is
imported only when ``trust_entry`` (``--trust-entry``) names it: best.yaml alone runs no code, and is
refused before anything is imported or written (:mod:`.trust`). The command line only renders it.
May import: :mod:`paci_tune.config`, :mod:`paci_tune.train`, :mod:`paci_tune.pipeline` (the resolved run),
:mod:`paci_tune.base`, :mod:`paci_tune.errors` and the tune layer's :mod:`.bestfile`, :mod:`.trust` and
:mod:`.warm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.files import check_writable
from ..config import RunConfig, derive_doc, derive_run
from ..errors import ConfigError
from ..pipeline.factory import ResolvedRun
from ..train import checkpoint
from ..train.launch import n_processes, torchrun_command, write_resolved
from ..train.run import check_outputs, resolve_run
from ..train.sinks import SinkSpec
from .bestfile import read_best
from .trust import check_entries
from .warm import WarmStart, ensure


def apply_run(
    best: str | Path, overrides: dict[str, Any], *, until: str = "target", trust_entry: str | None = None
) -> RunConfig:
    """The run ``apply`` trains: ``best``'s ``run`` plus ``overrides`` (dotted keys of what was given).

    ``until="budget"`` trains through the whole budget instead of stopping at the target; ``trust_entry``:
    the user model the command line names, the only one imported (:mod:`.trust`).
    """
    # The whole file checked first: a bad value (or a model entry the command line did not name) never reaches a run.
    best_file = read_best(best, trust_entry=trust_entry)
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
    if "training.eval_every" in over:  # another cadence than the trial's: its far points are not that one's
        over.setdefault("training.eval_far_every", None)
    return derive_run(run_doc, over)


def _starting_from(cfg: RunConfig, checkpoint: str | None) -> RunConfig:
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, init_from=checkpoint))


def warm_up_first(
    best: str | Path,
    cfg: RunConfig,
    *,
    dry_run: bool,
    log: Callable[[str], None] | None = None,
    trust_entry: str | None = None,
) -> tuple[RunConfig, str | None]:
    """(the run, the checkpoint its warm-up will write when the dry run trains nothing).

    A run whose ``training.init_from`` is missing here, from a warm-started search that trained its
    warm-up (best.yaml's ``warm_start.run``), trains that warm-up first into ``BEST-warm-start/``
    beside best.yaml and starts from it: ``apply`` then trains the warm-up and the recommendation.
    """
    init = cfg.training.init_from
    if not init or Path(init).exists():
        return cfg, None
    ws = read_best(best, trainable=False).warm_start
    if not ws or not isinstance(ws.get("run"), dict) or str(ws.get("checkpoint")) != init:
        return cfg, None  # a user's checkpoint (or --init-from's) that is not here: resolve_run refuses it, naming it
    check_entries({"warm_start": ws}, trust_entry)  # this read's warm-up, not only apply_run's
    warm = WarmStart.from_doc(ws)
    p = Path(best).resolve()
    folder = p.parent / f"{p.stem}-warm-start"
    doc = derive_doc(warm.run or {}, {"training.checkpoint_dir": str(folder)})
    if dry_run:
        if log:
            log(
                f"the search's warm-up checkpoint {init} is not here: apply will first train its "
                f"{warm.step}-step warm-up into {folder}"
            )
        return cfg, str(folder / f"batch_{warm.step:08d}")
    done = ensure(doc, "best.yaml.warm_start", log)
    return _starting_from(cfg, done["checkpoint"]), None


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
    verdict: str | None = None  # the search's comparison in one line (best.yaml's ``comparison``)

    def launch_commands(self, *, resume: bool, metrics: str | None, sinks: Sequence[SinkSpec] = ()) -> list[list[str]]:
        """What a user would type to train the written run: ``paci-tune train`` (with ``apply``'s ``--log``
        sinks), and for the distributed runtime the torchrun line it starts the workers with."""
        cmd = ["paci-tune", "train", str(self.run_path)] + (["--resume"] if resume else [])
        if metrics:
            cmd += ["--metrics", metrics]
        for spec in sinks:
            cmd += ["--log", spec.text]
        cfg = self.run.config
        if cfg.pipeline.runtime != "distributed":
            return [cmd]
        return [cmd, torchrun_command(self.run_path, n_processes(cfg))]

    def describe(self) -> str:
        lay = self.run.layout
        said = f"\nthe search's verdict: {self.verdict}" if self.verdict else ""
        return (
            f"training {lay.schedule} P={lay.stages} D={lay.data_parallel} a={lay.window} "
            f"b={lay.microbatch_size} from {self.best} (config {self.run_path}){said}"
        )


def prepare_apply(
    best: str | Path,
    overrides: dict[str, Any],
    *,
    until: str,
    metrics: str | None,
    resume: bool,
    dry_run: bool,
    log: Callable[[str], None] | None = None,
    trust_entry: str | None = None,
) -> PreparedApply:
    """Everything ``apply`` does before it trains (module docstring); raises ConfigError before any work."""
    cfg = apply_run(best, overrides, until=until, trust_entry=trust_entry)
    cfg, pending = warm_up_first(best, cfg, dry_run=dry_run, log=log, trust_entry=trust_entry)
    check_writable(run_file_for(best), "best.yaml (apply writes its run beside it)")
    check_outputs(cfg, metrics, resume=resume)
    folder = cfg.training.checkpoint_dir
    if not dry_run and not resume and folder and checkpoint.latest(Path(folder)):
        raise ConfigError(
            "--resume", False, f"--resume, or a new --checkpoint-dir: {folder} already holds checkpoints of a run"
        )
    compared = read_best(best, trainable=False).verdict_record
    said = compared.sentence() if compared is not None else None
    if pending is None:
        run = resolve_run(cfg, log=log)
        return PreparedApply(Path(best), run, write_resolved(run.config, run_file_for(best)), said)
    run = resolve_run(_starting_from(cfg, None), log=log)  # a dry run: the warm-up's checkpoint is not written yet
    return PreparedApply(Path(best), run, write_resolved(_starting_from(run.config, pending), run_file_for(best)), said)
