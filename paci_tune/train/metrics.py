"""Run records: JSON lines for the live view while training, one metrics file at the end.

Record kinds (``event``): ``start`` (what is being run), ``train`` (one per global batch, with
``loss``), ``segment`` (after each drained segment: running tokens/s, bubble, drift), ``eval``
(``val_loss``), ``checkpoint`` and ``summary`` (the last one). The metrics file is written once,
atomically, when the run ends, and holds every record of the run, including those from before a
resume (they travel in the checkpoint). May import: :mod:`paci_tune.base`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ..base.files import atomic_write_text

Record = dict[str, Any]


class RecordSink:
    """Collects the run's records on the reporting process; a no-op on the others."""

    def __init__(
        self,
        metrics_path: str | None = None,
        events_path: str | None = None,
        on_record: Callable[[Record], None] | None = None,
        active: bool = True,
    ) -> None:
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.on_record = on_record
        self.active = active
        self.records: list[Record] = []
        self._events: TextIO | None = None
        if active and events_path:
            self._events = open(events_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def emit(self, record: Record) -> None:
        if not self.active:
            return
        self.records.append(record)
        if self._events is not None:
            self._events.write(json.dumps(record) + "\n")
        if self.on_record is not None:
            self.on_record(record)

    def restore(self, records: list[Record]) -> None:
        """Records of the run before a resume, without replaying them to the live view."""
        if self.active:
            self.records = list(records)

    def finish(self) -> None:
        if self.active and self.metrics_path is not None:
            text = "".join(json.dumps(r) + "\n" for r in self.records)
            atomic_write_text(self.metrics_path, text)
        if self._events is not None:
            self._events.close()
            self._events = None


def read_records(path: str | Path) -> list[Record]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
