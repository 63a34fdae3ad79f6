"""Terminal output for training runs: a rich live view, or plain lines when not on a terminal.

May import: rich and :mod:`paci_tune.config` (its byte formatter).
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..config.memory import format_bytes as fmt_bytes  # one formatter for every byte count shown


class TrainView:
    """Consumes run records (see ``train.metrics``) and shows progress.

    Live mode draws a progress bar with loss, tokens/s, bubble and drift; plain mode prints one
    line per evaluation and segment, which reads well in CI logs and ``tee``'d files.
    """

    def __init__(self, console: Console | None = None, live: bool = True) -> None:
        self.console = console or Console(stderr=True)
        self.live = live and self.console.is_terminal
        self.progress: Progress | None = None
        self.task: Any = None
        self.total: int | None = None
        self.fields = {"loss": "-", "val": "-", "tps": "-", "bubble": "-", "drift": "-"}

    def __enter__(self) -> TrainView:
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  val {task.fields[val]}"),
                TextColumn("{task.fields[tps]} tok/s  bubble {task.fields[bubble]}  drift {task.fields[drift]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def on_record(self, rec: dict[str, Any]) -> None:
        ev = rec.get("event")
        if ev == "start":
            self.total = rec.get("steps")
            dp = f" D={rec['data_parallel']}" if rec.get("data_parallel", 1) != 1 else ""
            desc = f"{rec['schedule']} P={rec['n_stages']}{dp} a={rec['window']} b={rec['microbatch_size']}"
            if self.progress is not None:
                self.task = self.progress.add_task(
                    desc, total=self.total, completed=rec.get("resumed_at", 0), **self.fields
                )
            else:
                self.console.print(
                    f"start {desc} runtime={rec['runtime']} device={rec['device']} precision={rec['precision']} "
                    f"partition={rec['partition']} steps={rec['steps']} resumed_at={rec.get('resumed_at', 0)}"
                )
        elif ev == "train":
            self.fields["loss"] = f"{rec['loss']:.3f}"
            self._update(completed=rec["step"])
        elif ev == "segment":
            self.fields["tps"] = f"{rec['tokens_per_s']:,.0f}"
            self.fields["bubble"] = f"{rec['bubble_fraction']:.1%}"
            self.fields["drift"] = str(rec["max_drift"])
            self._update()
            if self.progress is None:
                self.console.print(
                    f"step {rec['step']}: loss {self.fields['loss']} tokens/s {self.fields['tps']} "
                    f"bubble {self.fields['bubble']} drift {self.fields['drift']} clock {rec['clock']:.1f}s"
                )
        elif ev == "eval":
            self.fields["val"] = f"{rec['val_loss']:.3f}"
            self._update()
            if self.progress is None:
                self.console.print(f"step {rec['step']}: val_loss {rec['val_loss']:.4f}")
        elif ev == "checkpoint" and self.progress is None:
            self.console.print(f"step {rec['step']}: checkpoint {rec['path']}")
        elif ev == "summary":
            self._update()
            if self.progress is not None:
                self.progress.stop()
                self.progress = None
            self.console.print(summary_table(rec))
            if line := budget_line(rec):
                self.console.print(line, markup=False, highlight=False)

    def _update(self, **kw: Any) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, **kw, **self.fields)


def budget_line(s: dict[str, Any]) -> str | None:
    """The predicted peak per device (simulate's and the search's figure) and what the run measured against
    ``hardware.memory`` (None with neither)."""
    cap, peak = s.get("memory_budget_bytes"), s.get("predicted_peak_bytes")
    said = f"predicted peak per device {fmt_bytes(peak)} (simulate's and the search's figure)" if peak else None
    if cap is None:
        return said
    if said:
        return f"{said}; {_measured_line(s, cap)}"
    return _measured_line(s, cap)


def _measured_line(s: dict[str, Any], cap: int) -> str:
    over = s.get("memory_over_budget")
    if over is None:
        return (
            f"hardware.memory {fmt_bytes(cap)}: admitted on its prediction; the allocator's peak was not "
            "measured here (a CPU process's resident set counts torch's libraries too)"
        )
    if not over:
        return f"hardware.memory {fmt_bytes(cap)}: every stage's measured peak stayed within it"
    worst = ", ".join(
        f"stage {o['stage']} measured {fmt_bytes(o['measured_bytes'])} > {fmt_bytes(o['budget_bytes'])}" for o in over
    )
    return f"warning: hardware.memory exceeded: {worst} (the prediction admitted it; see docs/benchmarks.md)"


def summary_table(s: dict[str, Any]) -> Table:
    """The run's headline figures and a row per stage."""
    val = s.get("final_val_loss")
    title = (
        f"{s['schedule']} · P={s['n_stages']} · D={s.get('data_parallel', 1)} · a={s['window']} · "
        f"b={s['microbatch_size']} · {s['runtime']} · "
        f"val_loss {val:.4f} (ppl {math.exp(min(val, 50)):.2f})"
        if val is not None
        else s["schedule"]
    )
    t = Table(title=title)
    for col in ("stage", "units", "busy s", "idle s", "bubble", "updates", "drift max/mean (bound)", "peak mem"):
        t.add_column(col, justify="right")
    for st in s["stages"]:
        t.add_row(
            f"{st['stage']} (r{st['pipe_stage']})" if "pipe_stage" in st else str(st["stage"]),  # r: its rank
            f"{st['units'][0]}..{st['units'][1] - 1}",
            f"{st['busy_s']:.2f}",
            f"{st['idle_s']:.2f}",
            f"{st['bubble_fraction']:.1%}",
            str(st["updates"]),
            f"{st['max_drift']}/{st['mean_drift']:.2f} ({st['drift_bound']})"
            if st.get("trains", True)
            else "nothing to train",
            fmt_bytes(st["peak_memory_bytes"]),
        )
    numerics = s.get("numerics_schedule", s["schedule"])
    if numerics != s["schedule"]:  # timed by the simulator: its bubble is the clock's; the stages ran 1F1B
        bubble = (
            f"{s['schedule']}'s bubble {s['clock_bubble_fraction']:.1%} on the {s['clock_name']} clock "
            f"(analytic {s['analytic_bubble_fraction']:.1%}), the stages above ran {numerics}'s numbers"
        )
    else:
        bubble = f"bubble {s['bubble_fraction']:.1%} (analytic {s['analytic_bubble_fraction']:.1%})"
    t.caption = (
        f"{s['steps']} steps, {s['tokens']:,} tokens, {s['tokens_per_s']:,.0f} tokens/s (pipeline), "
        f"{bubble}, train loss {s['train_loss']:.4f}"
        if s.get("train_loss") is not None
        else ""
    )
    return t
