"""Why a distributed run failed, in one line, from its workers' log.

When a worker dies, torchrun stops the other ranks and ends its log with a report whose "Root
Cause" block names the first rank that failed and its exit code or signal; the ranks it stopped
afterwards fail too, but only as a consequence, so the user is told about the first one. A rank
that raised has its traceback in the log with torch's ``[rankN]:`` prefix: its last exception
line says what went wrong. Rank layout: ``rank = replica * stages + stage``
(:mod:`paci_tune.pipeline.mesh`). May import: the standard library only.
"""

from __future__ import annotations

import re

_ROOT = re.compile(r"Root Cause \(first observed failure\):(.*?)(?:={5,}|\Z)", re.S)
_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(.*?)\s*$", re.M)


def first_failure(log_text: str, stages: int) -> str | None:
    """``"rank 1 (stage 1, replica 0) was killed by signal 9 (SIGKILL)"``, or None when the log
    holds no torchrun failure report (the workers refused the run themselves, or it never started)."""
    block = _ROOT.search(log_text)
    if block is None:
        return None
    fields = dict(_FIELD.findall(block.group(1)))
    rank_m = re.match(r"(\d+)", fields.get("rank", ""))
    if rank_m is None:
        return None
    rank = int(rank_m.group(1))
    where = f"rank {rank} (stage {rank % stages}, replica {rank // stages})"
    code = fields.get("exitcode", "?")
    signal = re.match(r"-(\d+)", code)
    if signal:
        name = re.search(r"\((SIG[A-Z0-9]+)\)", code)
        return f"{where} was killed by signal {signal.group(1)}" + (f" ({name.group(1)})" if name else "")
    status = re.match(r"(\d+)", code)
    said = last_exception(log_text, rank)
    return f"{where} exited with code {status.group(1) if status else code}" + (f": {said}" if said else "")


def last_exception(log_text: str, rank: int) -> str | None:
    """The last ``SomethingError: message`` line rank ``rank`` printed, or None."""
    pattern = re.compile(rf"^\[rank{rank}\]: ([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)$", re.M)
    found = pattern.findall(log_text)
    return found[-1].strip()[:300] if found else None
