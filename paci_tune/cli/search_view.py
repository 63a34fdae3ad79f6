"""Terminal output for a search: a rich live table of trials, or plain lines off a terminal.

Live: one row per trial (schedule, point, state, time to target, where it was pruned or why it
failed), a progress bar per running trial on the budget's clock with its latest validation loss,
and a footer with the best of each schedule and PACI's speedup over the flush baseline. Plain: one
line when a trial starts, one per validation (named by its trial: with ``search.jobs`` several run
at once), one when it ends. Events come from the trials' threads (:mod:`paci_tune.tune.lanes`): one
lock keeps the view whole. A trial's label carries
its optimizer recipe in brackets (``[muon momentum=0.95]``), which rich would read as markup and
drop: labels and notes are printed as plain text. May import: rich,
:mod:`paci_tune.schedule` and :mod:`paci_tune.tune` (the search's events).
"""

from __future__ import annotations

import math
import threading
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..schedule import schedule_of, sides, strongest
from ..tune.events import SearchEvent

_STYLE = {"complete": "green", "pruned": "yellow", "failed": "red", "running": "cyan", "rejected": "dim"}
MAX_ROWS = 24


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}{unit}"


class SearchView:
    """Consumes :class:`SearchEvent` from the search loop (module docstring)."""

    def __init__(self, budget: float, clock: str, target: float, console: Console | None = None, live: bool = True):
        self.console = console or Console(stderr=True)
        self.live = live and self.console.is_terminal
        self.budget, self.clock, self.target = budget, clock, target
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.best: dict[str, tuple[float, str]] = {}
        self.running: dict[tuple[str, int], TaskID] = {}  # trial -> its progress bar
        self._lock = threading.Lock()
        self._live: Live | None = None
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[clock]}"),
            TextColumn("val {task.fields[val]}"),
            TimeElapsedColumn(),
            console=self.console,
        )

    def __enter__(self) -> SearchView:
        if self.live:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()

    def seed(self, rows: list[dict[str, Any]]) -> None:
        """Trials already in the storage (a resumed search), shown before new ones."""
        for r in rows:
            self.rows[(r["schedule"], r["number"])] = r
            if r["state"] == "complete" and r.get("value") is not None:
                self._note_best(r["schedule"], r["value"], r["point"])

    # ----------------------------------------------------------------------------- events
    def on_event(self, e: SearchEvent) -> None:
        with self._lock:
            self._on_event(e)

    def _on_event(self, e: SearchEvent) -> None:
        key = (e.schedule, e.number)
        if e.kind == "start":
            assert e.params is not None
            point = e.params.label() + (f" ({e.reason})" if e.reason else "")  # a confirmation says so
            self.rows[key] = {
                "schedule": e.schedule,
                "number": e.number,
                "point": point,
                "state": "running",
                "ttt": None,
                "note": "",
            }
            self.running[key] = self.progress.add_task(
                escape(f"{e.schedule}#{e.number} {point}"), total=self.budget, clock="-", val="-"
            )
            if not self.live:
                self.console.print(f"trial {e.schedule}#{e.number}: {point} ...", markup=False)
        elif e.kind == "eval" and e.progress is not None:
            p = e.progress
            val = p.best_val
            if key in self.running:
                at = f"{p.clock:.3g}/{self.budget:g}s {self.clock}"
                self.progress.update(
                    self.running[key], completed=min(p.clock, self.budget), clock=at, val=_fmt(val, "")
                )
            if not self.live:
                self.console.print(
                    f"  {e.schedule}#{e.number} step {e.step}: clock {p.clock:.3g}s val "
                    f"{_fmt(val, '')} (target {self.target:g})"
                )
        elif e.kind == "end":
            row = self.rows.setdefault(
                key,
                {
                    "schedule": e.schedule,
                    "number": e.number,
                    "point": e.params.label() if e.params else "",
                    "ttt": None,
                },
            )
            row["state"] = e.state or "?"
            p = e.progress
            if e.state == "complete":
                row["value"] = e.value
                reached = e.value if e.value is not None and e.value <= self.budget else None
                row["ttt"] = p.reached_at if p is not None else reached
                row["note"] = e.reason or ("target reached" if row["ttt"] is not None else "budget spent")
                if e.value is not None:
                    self._note_best(e.schedule, e.value, row["point"])
            elif e.state == "pruned":
                why = e.reason or ""
                at = f"pruned at step {e.step}"
                row["note"] = why if why.startswith(("pruned", "capped")) else at + (f" ({why})" if why else "")
            else:
                row["note"] = e.reason or "failed"
            if key in self.running:
                self.progress.remove_task(self.running.pop(key))
            if not self.live:
                self.console.print(
                    f"trial {e.schedule}#{e.number}: {row['state']} -- {row['note']}"
                    + (f", score {_fmt(e.value)}" if e.value is not None else ""),
                    markup=False,
                )
        if self._live is not None:
            self._live.update(self._render())

    def _note_best(self, schedule: str, value: float, point: str) -> None:
        if schedule not in self.best or value < self.best[schedule][0]:
            self.best[schedule] = (value, point)

    # ----------------------------------------------------------------------------- drawing
    def _render(self) -> Group:
        title = f"trials (target val_loss {self.target:g}, budget {self.budget:g}s on the {self.clock} clock)"
        table = Table(title=title)
        for col in ("trial", "point", "state", "time to target", "note"):
            table.add_column(col)
        rows = list(self.rows.values())[-MAX_ROWS:]
        for r in rows:
            st = r.get("state", "?")
            table.add_row(
                f"{r['schedule']}#{r['number']}",
                Text(r["point"]),
                Text(st, style=_STYLE.get(st, "")),
                _fmt(r.get("ttt")),
                Text(r.get("note", "")),
            )
        parts: list[Any] = [table]
        if self.running:
            parts.append(self.progress)
        parts.append(Text(self.footer()))
        return Group(*parts)

    def footer(self) -> str:
        bits = [
            f"best {s}: " + (f"{_fmt(v)} to target" if v <= self.budget else f"missed (score {v:.3g})") + f" ({pt})"
            for s, (v, pt) in sorted(self.best.items())
        ]
        paci, sync = sides(self.best)
        if paci is not None and sync:  # against the strongest synchronous baseline so far
            base = strongest({s: self.best[s][0] for s in sync})
            name = schedule_of(base).label
            bits.append(f"PACI vs {name}: {self.best[base][0] / self.best[paci][0]:.2f}x")
        return "  |  ".join(bits) if bits else "no finished trial yet"
