"""Co-running timing processes: the stage pattern measured while every core is busy, as in a pipeline.

On a CPU every stage process of a pipeline computes at once, sharing caches and memory bandwidth, so
timing one process alone on an idle machine came out 16-22% fast. :func:`co_run_pattern` runs the
stage pattern in several processes at once: each is built, says ``ready``, waits at a barrier
(``go`` on its stdin), times its passes, says ``done`` once its samples are written, and keeps
running untimed until ``stop`` so that nobody's timed pass runs on a quieter machine. Children are
:class:`paci_tune.base.processes.Child` processes (their own process group, reporting through an
events file, killed on every exit path, dying with this process). May import: :mod:`.pattern`,
:mod:`paci_tune.base`, :mod:`paci_tune.model`, torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base.processes import Child, die_with_parent, worker_env
from .pattern import PatternSamples

Log = Callable[[str], None]

MEASURE_IDLE_TIMEOUT_S = 300.0
"""A timing process silent this long is stuck: each one reports after every global batch."""
MEASURE_EXIT_TIMEOUT_S = 30.0


def _timing_worker(spec_path: str) -> None:
    """One process of a co-run, started as ``python -c``; the protocol is in the module docstring."""
    import torch

    from ..model import load_model
    from .pattern import StagePattern

    spec = json.loads(Path(spec_path).read_text())
    die_with_parent(parent=spec["parent_pid"])
    events = open(spec["events"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def say(event: str, **fields: Any) -> None:
        events.write(json.dumps({"event": event, **fields}) + "\n")

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["model"], spec["vocab_size"], spec["seed"])
    pattern = StagePattern.from_spec(model, spec, device=torch.device(spec["device"]), seed=spec["rank"])
    say("ready")
    if sys.stdin.readline().strip() != "go":
        return
    stop = threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=listen, daemon=True).start()
    sizes: list[int] = spec["sizes"]
    for b in sizes:
        say("size", b=b)
        pattern.measure(b, repeats=spec["repeats"], warmup=spec["warmup"], on_batch=lambda: say("batch"))
    Path(spec["out"]).write_text(json.dumps(pattern.samples.to_json()))
    say("done")
    while not stop.is_set():
        pattern.microbatch(sizes[-1], record=False)


def _await(children: list[Child], word: str, timeout_s: float, log: Log | None) -> None:
    """Wait until every child said ``word``; relay rank 0's sizes; raise if one ends or all fall silent."""
    said: set[int] = set()
    last = time.monotonic()
    while len(said) < len(children):
        for rank, child in enumerate(children):
            exited = not child.running
            recs, active = child.records()
            if active:
                last = time.monotonic()
            for rec in recs:
                if rec["event"] == word:
                    said.add(rank)
                elif rec["event"] == "size" and rank == 0 and log:
                    log(f"stage pattern, micro-batch {rec['b']}")
            if exited and rank not in said:
                raise RuntimeError(f"timing process {rank} exited early (waiting for {word!r})")
        if len(said) < len(children) and time.monotonic() - last > timeout_s:
            raise RuntimeError(f"a timing process was silent for {timeout_s:g} s (waiting for {word!r})")
        time.sleep(0.02)


def import_path() -> str:
    """This process's import path for a child, without the working folder ``python -m`` put on it
    (unless ``PYTHONPATH`` names it): the child imports what this process imports, nothing from where it runs."""
    chosen = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    cwd = os.getcwd()
    return os.pathsep.join(p for p in sys.path if p and (p != cwd or p in chosen))


def co_run_pattern(
    spec: dict[str, Any], processes: int, *, idle_timeout_s: float = MEASURE_IDLE_TIMEOUT_S, log: Log | None = None
) -> list[PatternSamples]:
    """Run the stage pattern in ``processes`` child processes at once; every child's samples.

    ``spec`` says what to build and measure (see :func:`_timing_worker`). Children get the
    environment the distributed launcher gives its workers (threads, malloc tunables) and this
    process's import path. Any failure, stall (nothing from any child for ``idle_timeout_s``) or
    interruption kills every child before raising.
    """
    with tempfile.TemporaryDirectory(prefix="paci-calibrate-") as tmp, contextlib.ExitStack() as stack:
        env = worker_env(spec["threads"])
        env["PYTHONPATH"] = import_path()
        outs = [os.path.join(tmp, f"samples{r}.json") for r in range(processes)]
        children: list[Child] = []
        try:
            for rank in range(processes):
                events = Path(tmp, f"events{rank}.jsonl")
                spec_path = Path(tmp, f"spec{rank}.json")
                full = {**spec, "rank": rank, "out": outs[rank], "events": str(events), "parent_pid": os.getpid()}
                spec_path.write_text(json.dumps(full, default=str))
                code = f"from paci_tune.calibrate.corun import _timing_worker; _timing_worker({str(spec_path)!r})"
                child = Child(
                    [sys.executable, "-c", code], log=Path(tmp, f"rank{rank}.log"), events=events, env=env, stdin=True
                )
                children.append(stack.enter_context(child))
            _await(children, "ready", idle_timeout_s, None)
            for child in children:  # the barrier: every child is built, all start timing now
                child.send("go")
            _await(children, "done", idle_timeout_s, log)
            for child in children:  # every sample is written: let them go
                child.send("stop")
            deadline = time.monotonic() + MEASURE_EXIT_TIMEOUT_S
            for child in children:
                child.wait(max(deadline - time.monotonic(), 0.1))
        except (RuntimeError, OSError) as exc:
            tails = [f"[timing process {r}]\n{c.log_tail(40)}" for r, c in enumerate(children) if c.log_tail()]
            for child in children:
                if child.running:
                    child.kill(grace_s=1.0)
            raise RuntimeError(f"stage-pattern measurement failed: {exc}\n" + "\n".join(tails)) from exc
        return [PatternSamples.from_json(json.loads(Path(p).read_text())) for p in outs]
