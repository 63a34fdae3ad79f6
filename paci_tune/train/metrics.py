"""Run records: JSON lines for the live view while training, the metrics file, the live metric sinks.

Record kinds (``event``): ``start`` (what is being run), ``train`` (one per global batch, with
``loss``), ``segment`` (after each drained segment: running tokens/s, bubble, drift), ``eval``
(``val_loss``), ``checkpoint`` and ``summary`` (the last one). The metrics file is written as the
records come -- a line appended and flushed per record, so ``tail -f`` follows a run and a killed
run leaves every record up to the kill -- and holds every record of the run, including those from
before a resume (they travel in the checkpoint): a resumed run's first record rewrites the file to
the checkpoint's records, so what a killed run wrote past its checkpoint is neither kept twice nor
lost. The same records feed ``--log``'s sinks (:mod:`.sinks`). May import: :mod:`paci_tune.base`,
:mod:`paci_tune.errors`, :mod:`.sinks`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from ..base.files import atomic_write_text
from ..errors import Failure
from .sinks import LiveSinks, SinkSpec

Record = dict[str, Any]


class RecordSink:
    """Collects the run's records on the reporting process; a no-op on the others.

    ``metrics_path``: the JSON-lines file, appended per record; ``events_path``: the distributed
    workers' live feed to their launcher; ``sinks``: the ``--log`` sinks, opened on the first record.
    """

    def __init__(
        self,
        metrics_path: str | None = None,
        events_path: str | None = None,
        on_record: Callable[[Record], None] | None = None,
        active: bool = True,
        sinks: Iterable[SinkSpec] = (),
    ) -> None:
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.on_record = on_record
        self.active = active
        self.records: list[Record] = []
        self._events: TextIO | None = None
        self._file: TextIO | None = None
        self._resumed = False
        self._live = LiveSinks(sinks) if active and sinks else None
        if active and events_path:
            self._events = open(events_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def emit(self, record: Record) -> None:
        if not self.active:
            return
        self.records.append(record)
        self._append(record)
        if self._events is not None:
            self._events.write(json.dumps(record) + "\n")
        if self.on_record is not None:
            self.on_record(record)
        if self._live is not None:
            self._live.record(record, resumed=self._resumed)

    def measure(self, step: int, values: Mapping[str, float]) -> None:
        """Scalars for the live sinks only: what the run measures but its records do not carry (memory per segment)."""
        if self.active and self._live is not None:
            self._live.scalars(step, values)

    def flush(self) -> None:
        """Every record so far on disk in the live sinks (the metrics file is flushed per record)."""
        if self.active and self._live is not None:
            self._live.flush()

    def restore(self, records: list[Record]) -> None:
        """Records of the run before a resume, without replaying them to the live view."""
        if self.active:
            self.records = list(records)
            self._resumed = True

    def _append(self, record: Record) -> None:
        """One record onto the metrics file, flushed. The first one writes the file whole (atomically): the
        restored records and this one, replacing what a killed run or an earlier run left there."""
        path = self.metrics_path
        if path is None:
            return
        try:
            if self._file is None:
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
                self._file = open(path, "a")  # noqa: SIM115 - lives as long as the run
                return
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            raise Failure(f"writing {path}", e.strerror or str(e)) from e

    def finish(self) -> None:
        """The run is over: the metrics file complete and on disk, every sink closed."""
        if self.active and self.metrics_path is not None and self._file is None:
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.records))
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        self.close()

    def close(self) -> None:
        """Close the files and the sinks (what a failed run wrote stays); idempotent."""
        for f in (self._file, self._events):
            if f is not None:
                f.close()
        self._file = self._events = None
        if self._live is not None:
            self._live.close()


def read_records(path: str | Path) -> list[Record]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
