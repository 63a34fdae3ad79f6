"""Live metric sinks: ``--log tensorboard:DIR``, ``--log wandb:PROJECT``, ``--log mlflow:EXPERIMENT``.

A multi-hour run is watched in the tool the user already has, as the values come, not read out
of the JSON lines at the end. Every sink gets the same scalars, made from the run's records
(:func:`scalars_of`), so the JSON lines stay the independent record of what a sink shows. The step
axis is the records' ``step``: global batches completed, i.e. optimizer steps (each global batch is
one update of every stage; ``pipeline.window`` micro-batches each); a resumed run continues it.

Only the reporting process opens sinks (the emulated runtime's one process, the distributed
runtime's reporter rank, :func:`paci_tune.pipeline.mesh.reporter_rank`), and it opens them on the
run's first record, so a run refused before training leaves no sink output. A backend's package is
an optional extra, checked when the option is read (:func:`parse_sinks`), before any work. Nothing
here writes or prints a credential: W&B and MLflow read their keys and tracking URI from the
environment themselves, and a sink's failure is reported by its exception's type only (a client's
message may quote a URL). May import: :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..base.files import check_writable
from ..errors import ConfigError

OPTION = "--log"
BACKENDS: dict[str, str] = {"tensorboard": "DIR", "wandb": "PROJECT", "mlflow": "EXPERIMENT"}
"""Each backend and what follows its colon; the backend is also its package's and its extra's name."""
ALLOWED = "tensorboard:DIR, wandb:PROJECT or mlflow:EXPERIMENT (repeatable)"
TB_FLUSH_S = 10
"""How often TensorBoard's writer flushes: a live view seconds behind the run, not its 2-minute default."""

_RUN_FIELDS = ("schedule", "n_stages", "data_parallel", "window", "microbatch_size", "global_batch", "runtime")
"""The start record's fields a sink is told as the run's parameters (W&B config, MLflow params)."""


class MetricSink(Protocol):
    """Where live scalars go: one implementation per backend."""

    def scalar(self, name: str, value: float, step: int) -> None: ...

    def flush(self) -> None:
        """What was sent is kept (called before each checkpoint is committed)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkSpec:
    """One ``--log BACKEND:TARGET`` value, checked (:func:`parse_sinks`)."""

    backend: str
    target: str

    @property
    def text(self) -> str:
        """The value as the user gave it (``apply --dry-run`` shows it in its ``train`` command)."""
        return f"{self.backend}:{self.target}"

    @property
    def for_workers(self) -> str:
        """The value for the distributed workers: a TensorBoard folder made absolute (their folder may differ)."""
        if self.backend == "tensorboard":
            return f"tensorboard:{Path(self.target).absolute()}"
        return self.text


def parse_sinks(values: Iterable[str]) -> tuple[SinkSpec, ...]:
    """The ``--log`` values checked before any work: the form, the backend's package, a TensorBoard folder
    this user can write. Raises :class:`~paci_tune.errors.ConfigError` (exit 2) naming ``--log`` and the value."""
    specs: list[SinkSpec] = []
    for value in values:
        backend, sep, target = value.partition(":")
        if not sep or backend not in BACKENDS or not target.strip():
            raise ConfigError(OPTION, value, ALLOWED)
        if importlib.util.find_spec(backend) is None:
            raise ConfigError(
                OPTION, value, f"a backend whose package is installed: pip install 'paci-tune[{backend}]' for {backend}"
            )
        if backend == "tensorboard":
            check_writable(target, OPTION, folder=True)
        spec = SinkSpec(backend, target)
        if spec not in specs:
            specs.append(spec)
    return tuple(specs)


def scalars_of(record: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, scalars) a record gives the sinks; None for one that gives none (start, checkpoint).

    train: ``train/loss``, ``train/lr``; eval: ``val/loss``; segment (each drained segment):
    ``perf/tokens_per_s``, ``perf/bubble_fraction``, ``perf/max_drift``; summary (at the last step): its
    throughput, bubble, drift, peak memory and final losses under ``summary/``."""
    kind = record.get("event")
    if kind == "train":
        values = {"train/loss": record["loss"], "train/lr": record["lr"]}
    elif kind == "eval":
        values = {"val/loss": record["val_loss"]}
    elif kind == "segment":
        values = {
            "perf/tokens_per_s": record["tokens_per_s"],
            "perf/bubble_fraction": record["bubble_fraction"],
            "perf/max_drift": record["max_drift"],
        }
    elif kind == "summary":
        keys = ("tokens_per_s", "wall_tokens_per_s", "clock_tokens_per_s", "bubble_fraction")
        keys += ("analytic_bubble_fraction", "max_drift", "peak_memory_bytes", "final_val_loss", "train_loss")
        values = {f"summary/{k}": record.get(k) for k in keys}
        return record["steps"], {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
    else:
        return None
    return record["step"], {k: float(v) for k, v in values.items()}


# ---------------------------------------------------------------------------------------- backends
class TensorBoardSink:
    """torch's ``SummaryWriter`` in ``logdir`` (a folder per run). A resumed run's writer purges the folder's
    steps after its checkpoint (``purge_step``; all of them when nothing was saved), so TensorBoard shows each
    step once, as the resumed JSON lines hold it; the trainer flushes it before each checkpoint is committed."""

    def __init__(self, logdir: str, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=logdir, purge_step=purge_step, flush_secs=TB_FLUSH_S)

    def scalar(self, name: str, value: float, step: int) -> None:
        self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run in ``project``; it logs in with ``WANDB_API_KEY`` (or ``wandb login``) on its own. Every
    scalar is charted against ``step``, W&B's own counter hidden: an evaluation reported after a later
    batch's loss (PACI's evaluations run inside the pipeline) would be dropped on W&B's monotonic step."""

    def __init__(self, project: str, params: dict[str, Any]) -> None:
        import wandb

        # Metrics and the run's shape only: no console capture, no code.
        self._run = wandb.init(project=project, config=params, settings=wandb.Settings(console="off", save_code=False))
        self._run.define_metric("step", hidden=True)
        self._run.define_metric("*", step_metric="step")

    def scalar(self, name: str, value: float, step: int) -> None:
        self._run.log({name: value, "step": step})

    def flush(self) -> None:
        pass  # W&B's service process keeps what was logged

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run in ``experiment`` (created if new), at the tracking URI the environment names
    (``MLFLOW_TRACKING_URI``, never printed); its client, not mlflow's global active run."""

    def __init__(self, experiment: str, params: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        self._run_id = client.create_run(exp_id).info.run_id
        for key, value in params.items():
            client.log_param(self._run_id, key, value)

    def scalar(self, name: str, value: float, step: int) -> None:
        self._client.log_metric(self._run_id, name, value, step=step)

    def flush(self) -> None:
        pass  # each metric was sent when logged

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def open_sink(spec: SinkSpec, start: Mapping[str, Any], *, resumed: bool) -> MetricSink:
    """``spec``'s sink for the run whose ``start`` record this is (``resumed``: continuing its own checkpoint)."""
    params = {k: start[k] for k in _RUN_FIELDS if k in start}
    if spec.backend == "tensorboard":
        at = int(start.get("resumed_at") or 0)
        return TensorBoardSink(spec.target, at + 1 if resumed else None)
    if spec.backend == "wandb":
        return WandbSink(spec.target, params)
    return MlflowSink(spec.target, params)


class LiveSinks:
    """The run's open sinks, fed every record; a sink that fails is closed and dropped with one warning on
    stderr -- a multi-hour run is not ended by a tracking server -- and the JSON lines still hold everything."""

    def __init__(self, specs: Iterable[SinkSpec]) -> None:
        self.specs = tuple(specs)
        self._open: dict[SinkSpec, MetricSink] | None = None

    def record(self, rec: Mapping[str, Any], *, resumed: bool = False) -> None:
        """Feed one record; the first one (the run's ``start``) opens the sinks."""
        if self._open is None:
            self._open = {}
            for spec in self.specs:
                self._guard(spec, lambda s=spec: self._open.__setitem__(s, open_sink(s, rec, resumed=resumed)))
        got = scalars_of(rec)
        if got is not None:
            self.scalars(*got)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Scalars at ``step`` to every open sink (non-finite ones too: a diverged loss is worth seeing)."""
        for spec, sink in list((self._open or {}).items()):
            for name, value in values.items():
                if not self._guard(spec, lambda: sink.scalar(name, value, step)):  # noqa: B023 - called at once
                    break

    def flush(self) -> None:
        for spec, sink in list((self._open or {}).items()):
            self._guard(spec, sink.flush)

    def close(self) -> None:
        """Close every open sink (flushing its last scalars); idempotent."""
        opened, self._open = self._open or {}, {}
        for spec, sink in opened.items():
            self._guard(spec, sink.close)

    def _guard(self, spec: SinkSpec, call: Callable[[], object]) -> bool:
        """Run one client call; on failure drop ``spec``'s sink (closing it, once) and say so by the error's type."""
        try:
            call()
            return True
        except Exception as e:  # any client failure: the run goes on without this sink
            print(
                f"warning: {OPTION} {spec.text} stopped ({type(e).__name__}); the run goes on, "
                "its metrics file keeps every record",
                file=sys.stderr,
                flush=True,
            )
            sink = (self._open or {}).pop(spec, None)
            if sink is not None:
                with contextlib.suppress(Exception):
                    sink.close()
            return False
