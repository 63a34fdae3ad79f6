"""Start the distributed runtime on this machine: ``torchrun`` with one process per stage.

The user never types torchrun. The run's config is written out resolved (with every command-line
override applied) so the workers read exactly what the launcher validated; the workers append
their records to an events file, which the launcher tails for the live view.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from ..config.schema import RunConfig
from ..train.metrics import Record


def worker_command(config_path: Path, n_procs: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "paci_tune.pipeline.lifetime",  # torchrun, tied to this launcher's life (see lifetime.py)
        str(os.getpid()),
        "--standalone",
        f"--nproc-per-node={n_procs}",
        "-m",
        "paci_tune.worker",
        str(config_path),
        *extra,
    ]


def write_resolved(cfg: RunConfig, path: Path) -> None:
    doc = cfg.to_dict()
    doc["optimizer"]["betas"] = list(doc["optimizer"]["betas"])
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def run_distributed(
    cfg: RunConfig,
    workdir: Path,
    on_record: Callable[[Record], None],
    *,
    metrics: str | None = None,
    resume: bool = False,
    poll_s: float = 0.1,
) -> int:
    """Run ``cfg`` under torchrun; feed each worker record to ``on_record``; return the exit code.

    Worker output goes to ``workdir/workers.log``; on failure its tail is what to show the user.
    Ctrl-C (or the launcher being killed politely) takes the whole process group down with it.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, events, log = workdir / "run.yaml", workdir / "events.jsonl", workdir / "workers.log"
    write_resolved(cfg, config_path)
    events.write_text("")
    extra = ["--events", str(events)]
    if metrics:
        extra += ["--metrics", str(Path(metrics).resolve())]
    if resume:
        extra.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // cfg.pipeline.stages)))
    # Back large CPU allocations with transparent huge pages: activations are freed and re-allocated
    # every micro-batch, and 4 KiB page faults made backward times jitter by up to 2x (each stall
    # idles the neighbouring stage). Ignored by non-glibc systems; a user's own setting wins.
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    with open(log, "w") as logf, open(events) as tail:
        proc = subprocess.Popen(
            worker_command(config_path, cfg.pipeline.stages, extra),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        pending = ""
        try:
            while True:
                done = proc.poll() is not None
                pending += tail.read()
                *lines, pending = pending.split("\n")  # keep a line still being written
                for line in lines:
                    if line.strip():
                        on_record(json.loads(line))
                if done:
                    break
                time.sleep(poll_s)
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    return proc.returncode


def log_tail(workdir: Path, lines: int = 25) -> str:
    path = workdir / "workers.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
