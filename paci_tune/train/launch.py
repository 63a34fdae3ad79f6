"""Start the distributed runtime on this machine: ``torchrun`` with one process per stage replica.

P stages x D data-parallel replicas make P x D processes (:func:`n_processes`).

The user never types torchrun. The run's config is written out resolved (every override applied,
the partition and profile pinned) so the workers run exactly what the launcher validated; the
workers append their records to an events file, which the launcher tails for the live view
(:class:`paci_tune.base.processes.Child`). torchrun is tethered to the launcher, so killing the
launcher, even with SIGKILL, takes the workers down.

On one machine nothing needs the network, so the launch keeps off it where torch lets it: torchrun's
static rendezvous on ``127.0.0.1`` (``--standalone``'s dynamic rendezvous unpickles its state from a
store any host can reach; the static one exchanges no pickled state), and gloo's connections on the
loopback interface (:func:`~paci_tune.base.processes.loopback_env`). torch's TCPStore itself still
listens on every interface, on a port chosen for the run; it offers no bind address (README, known
limitations). May import: :mod:`paci_tune.base`, :mod:`paci_tune.config`, :mod:`.sinks` (the ``--log`` values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..base.files import write_yaml
from ..base.processes import Child, Record, follow, free_port, loopback_env, tethered, threads_per_process, worker_env
from ..config.schema import RunConfig
from .sinks import SinkSpec

WORKER_MODULE = "paci_tune.worker"


def n_processes(cfg: RunConfig) -> int:
    """Processes (devices) a distributed run takes: ``pipeline.stages`` x ``pipeline.data_parallel``."""
    return cfg.layout.devices


LOOPBACK = "127.0.0.1"


def _torchrun_args(config_path: Path, n_procs: int, extra: list[str]) -> list[str]:
    """One node, its static rendezvous on the loopback address at a free port (module docstring)."""
    return [
        "--nnodes=1",
        "--node-rank=0",
        "--rdzv-backend=static",
        f"--master-addr={LOOPBACK}",
        f"--master-port={free_port(LOOPBACK)}",
        f"--nproc-per-node={n_procs}",
        "-m",
        WORKER_MODULE,
        str(config_path),
        *extra,
    ]


def worker_command(config_path: Path, n_procs: int, extra: list[str]) -> list[str]:
    """torchrun, tied to this launcher's life, starting ``n_procs`` pipeline workers on ``config_path``."""
    return tethered("torch.distributed.run", *_torchrun_args(config_path, n_procs, extra))


def torchrun_command(config_path: Path, n_procs: int) -> list[str]:
    """What a user would type for the same launch (``apply --dry-run`` shows it; run it with
    ``GLOO_SOCKET_IFNAME=lo`` to keep gloo on the loopback interface too)."""
    return ["torchrun", *_torchrun_args(config_path, n_procs, [])]


def write_resolved(cfg: RunConfig, path: Path) -> Path:
    """The run as a YAML file that loads back to the same config (what the workers read)."""
    return write_yaml(path, cfg.to_doc())


def run_distributed(
    cfg: RunConfig,
    workdir: Path,
    on_record: Callable[[Record], None],
    *,
    metrics: str | None = None,
    resume: bool = False,
    poll_s: float = 0.1,
    extra_env: dict[str, str] | None = None,
    sinks: Sequence[SinkSpec] = (),
) -> tuple[int, str]:
    """Run ``cfg`` under torchrun; feed each worker record to ``on_record``; (exit code, log tail).

    ``extra_env``: more for the workers' environment (the checkpoint folder whose lock the caller holds);
    ``sinks``: the ``--log`` sinks, passed on to the workers (the reporter rank writes them).

    Worker output goes to ``workdir/workers.log``; on failure its tail is what to show the user.
    Ctrl-C (or any error here) takes the whole process group down with it.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = write_resolved(cfg, workdir / "run.yaml")
    events = workdir / "events.jsonl"
    extra = ["--events", str(events), "--checked"]  # checked here: no worker builds a per-rank model whole
    if metrics:
        extra += ["--metrics", str(Path(metrics).resolve())]
    if resume:
        extra.append("--resume")
    for spec in sinks:
        extra += ["--log-to", spec.for_workers]  # torchrun's parser would take --log for its own --log-dir
    env = {**loopback_env(worker_env(threads_per_process(n_processes(cfg)))), **(extra_env or {})}
    cmd = worker_command(config_path, n_processes(cfg), extra)
    with Child(cmd, log=workdir / "workers.log", events=events, env=env) as child:
        follow(child, on_record, poll_s=poll_s)
        rc = child.returncode
    assert rc is not None
    return rc, child.log_tail()
