"""Running a training: resolve its config once, then train here (emulated) or on torchrun workers.

Every way of training -- ``paci-tune train``, ``paci-tune apply``, a search's trial process --
goes through :func:`resolve_run` and :func:`run_training`, so each runs exactly the same thing for
the same config. May import: the train layer's own modules, :mod:`paci_tune.calibrate` (a sim
clock's profile), :mod:`paci_tune.pipeline`, :mod:`paci_tune.config`, :mod:`paci_tune.base`,
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..base.processes import Record
from ..calibrate.cache import measured_profile
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..pipeline.backend import choose_backend, shares_gpus, uses_cuda, visible_gpus
from ..pipeline.factory import ResolvedRun, resolve_pieces
from .clock import check_seconds_budget
from .failure import first_failure
from .sinks import SinkSpec
from .timed import resolve_timed, trains_flush_for

Log = Callable[[str], None]


class WorkersFailed(Exception):
    """The distributed runtime's workers exited with an error; :attr:`message` says which rank
    failed first and how (:func:`.failure.first_failure`), or shows the log's tail when torchrun
    did not report one (the workers refused the run: they print why)."""

    def __init__(self, returncode: int, log_path: Path, tail: str, cause: str | None = None) -> None:
        self.returncode, self.log_path, self.tail, self.cause = returncode, log_path, tail, cause
        super().__init__(f"pipeline workers exited with code {returncode}")

    @property
    def exit_code(self) -> int:
        """2 when the workers refused the configuration (they print why), 1 for any other failure."""
        return 2 if self.returncode == 2 else 1

    @property
    def message(self) -> str:
        if self.cause:
            return f"error: pipeline worker {self.cause}; the other ranks were stopped (log: {self.log_path})"
        return f"error: pipeline workers exited with code {self.returncode}; their log is {self.log_path}:\n{self.tail}"


def resolve_run(cfg: RunConfig, *, log: Log | None = None, checked: bool = False) -> ResolvedRun:
    """The run as it will execute: its profile known, its partition pinned, its pieces loaded.

    Called once per process: by the command that trains, by each distributed worker (on the config
    the launcher resolved) and by a trial's process. The sim clock without a profile gets this
    machine's, measured once and cached, and so does a run with a device budget (``hardware.memory``:
    its predicted peak is checked before any work, which takes a profile). The stage cut
    (``partition: auto``) is computed here, with every check that can refuse the run (data, model,
    depth, partition, memory), so distributed workers and a later resume all run the same cut. A
    schedule the simulator times (interleaved, ZB-H1 on the emulated runtime) gets its own cut and
    trains 1F1B's numbers (:mod:`.timed`); ZB-H1 on
    the distributed runtime is resolved like any run, its cut its own. ``checked``: a worker started by
    paci-tune's launcher, which ran every check on this resolved config (:func:`.launch.run_distributed`).
    """
    t = cfg.training
    if t.init_from:
        from .checkpoint import INIT_FROM, check_files, find

        check_files(find(Path(t.init_from)), INIT_FROM)  # refused now, not after the model is built
    if (t.clock == "sim" or cfg.hardware.memory is not None) and not t.profile:  # a budget needs a prediction
        from ..pipeline.checks import check_model_and_data

        check_model_and_data(cfg)  # a bad model or data section is refused before minutes of calibration
        _, path = measured_profile(cfg, log=log)
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(t, profile=str(path)))
    if trains_flush_for(cfg):  # zb-h1 on the distributed runtime runs for real, resolved like any run
        run = resolve_timed(cfg)
    else:
        run = resolve_pieces(cfg, distributed=cfg.pipeline.runtime == "distributed", checked=checked)
    check_seconds_budget(run.config, run.profile)  # before a worker starts or a step runs
    if log is not None and run.model.untied:  # model.untie's cost, the run's opening line
        log(run.model.untied)
    return run


def check_outputs(cfg: RunConfig, metrics: str | None, *, resume: bool = False) -> None:
    """The files a run writes can be written, no other run writes its checkpoint folder, and the
    checkpoint it resumes from is complete and holds nothing but data (a LATEST that names nothing
    complete is refused, :func:`.checkpoint.latest`): refused now, not after the first minutes of training."""
    from ..base.files import check_writable
    from .checkpoint import RESUME, check_files, check_free, latest

    if metrics is not None:
        check_writable(metrics, "--metrics")
    t = cfg.training
    if t.checkpoint_every and t.checkpoint_dir:
        check_writable(t.checkpoint_dir, "training.checkpoint_dir", folder=True)
    if t.checkpoint_dir:
        check_free(Path(t.checkpoint_dir))
    start = latest(Path(t.checkpoint_dir)) if resume and t.checkpoint_dir else None
    if start is not None:
        check_files(start, RESUME)


def prepare_run(
    cfg: RunConfig, *, metrics: str | None = None, resume: bool = False, log: Log | None = None
) -> ResolvedRun:
    """What a command does before it trains: its files checked, then the run resolved."""
    check_outputs(cfg, metrics, resume=resume)
    return resolve_run(cfg, log=log)


def _check_launch(cfg: RunConfig, resume: bool, log: Log | None) -> None:
    """What the distributed runtime refuses, caught before any worker starts."""
    from .launch import n_processes

    p, n_gpus, n = cfg.pipeline, visible_gpus(), n_processes(cfg)
    backend = choose_backend(p.backend, p.device, n, n_gpus)  # all stage processes run on this machine
    if p.runs_torch_schedule and backend == "gloo" and uses_cuda(p.device, n_gpus):
        raise ConfigError(
            "pipeline.backend",
            p.backend,
            f"nccl, with a GPU per stage process, for schedule "
            f"{p.schedule} on CUDA stages: torch's schedule classes send from the stage's device, "
            "which gloo cannot (pipeline.device: cpu runs it on gloo)",
        )
    if shares_gpus(backend, p.device, n, n_gpus) and log:
        log(
            f"note: {n} stage processes share {n_gpus} GPU(s): NCCL needs a GPU per process, so they talk over "
            "gloo through host memory (right numbers, not a speed measurement; --runtime emulated is faster here)"
        )
    if resume and not cfg.training.checkpoint_dir:
        raise ConfigError("training.checkpoint_dir", None, "a checkpoint folder to resume from (--checkpoint-dir)")


def run_training(
    run: ResolvedRun,
    *,
    on_record: Callable[[Record], None] | None = None,
    metrics: str | None = None,
    resume: bool = False,
    log: Log | None = None,
    sinks: Sequence[SinkSpec] = (),
) -> dict[str, Any] | None:
    """Train the resolved ``run`` on its runtime; every record goes to ``on_record``; the summary record is returned.

    ``sinks``: the ``--log`` sinks (:mod:`.sinks`), written by the reporting process: this one on the
    emulated runtime, the reporter rank's worker on the distributed one.

    Raises :class:`~paci_tune.errors.ConfigError` for a run that cannot start and
    :class:`WorkersFailed` when distributed workers fail.
    """
    from .loop import Trainer
    from .metrics import RecordSink

    cfg = run.config
    if cfg.pipeline.runtime == "emulated":
        return Trainer(run, RecordSink(metrics, None, on_record, sinks=sinks)).run(resume=resume)

    from .launch import run_distributed

    _check_launch(cfg, resume, log)
    summary: list[Record] = []

    def record(rec: Record) -> None:
        if rec.get("event") == "summary":
            summary.append(rec)
        if on_record is not None:
            on_record(rec)

    with contextlib.ExitStack() as held:
        env = {}
        if cfg.training.checkpoint_dir:  # the launcher holds the folder for its workers (Trainer._hold_checkpoints)
            from .checkpoint import LOCK_ENV, hold

            root = Path(cfg.training.checkpoint_dir)
            held.enter_context(hold(root))
            env[LOCK_ENV] = str(root.resolve())
        workdir = Path(tempfile.mkdtemp(prefix="paci-tune-run-"))
        rc, tail = run_distributed(cfg, workdir, record, metrics=metrics, resume=resume, extra_env=env, sinks=sinks)
    if rc != 0:
        log_path = workdir / "workers.log"
        cause = first_failure(log_path.read_text(errors="replace"), cfg.pipeline.stages) if log_path.exists() else None
        raise WorkersFailed(rc, log_path, tail, cause)
    shutil.rmtree(workdir, ignore_errors=True)
    return summary[-1] if summary else None
