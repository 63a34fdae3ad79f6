"""``paci-tune report``: why the tuner chose what it chose, as pictures, tables and one HTML page.

:func:`make_report` reads a search's evidence (:mod:`.gather`: best.yaml and its Optuna studies),
draws the search (:mod:`.figures`) and the recommendation (:mod:`.verdict`), and writes PNGs
plus a self-contained ``index.html`` (:mod:`.page`); the words are :mod:`.summary`'s. The
terminal rendering is the command line's (:mod:`paci_tune.cli.report`). May import: the verdict
layer and what it reads (:mod:`paci_tune.verdict`, :mod:`paci_tune.tune`, :mod:`paci_tune.sim`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`, :mod:`paci_tune.config` for its
byte formatter), matplotlib, optuna.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .gather import Evidence, gather
from .page import Picture, write_page
from .summary import Table, tables, verdict_sentence

__all__ = ["Evidence", "Picture", "Report", "gather", "make_report"]


@dataclass(frozen=True)
class Report:
    evidence: Evidence
    verdict: str
    tables: list[Table]
    pictures: list[Picture]
    importances: dict[str, dict[str, float] | str]
    index: Path


def make_report(ev: Evidence, out: Path) -> Report:
    """Draw every picture into ``out`` and write ``out/index.html``."""
    from . import figures, verdict

    out.mkdir(parents=True, exist_ok=True)
    pics: list[Picture] = []
    trials = bool(ev.studies)  # none when no storage was opened: best.yaml's pictures only (gather's note)
    unread = "no storage opened: the search's trials are not in this report"

    def add(key: str, title: str, fig: object, caption: str, why: str = "") -> None:
        path = figures.save(fig, out / f"{key}.png") if fig is not None else None  # type: ignore[arg-type]
        pics.append(Picture(key, title, path, caption if path is not None else why))

    add(
        "curves",
        "Validation loss of every trial",
        figures.draw_curves(ev) if trials else None,
        "Each line is one trial on the search's clock; dashed lines were pruned where they end (x); the dotted "
        "line is the target; thick lines are each schedule's chosen point and its confirmation seeds.",
        unread,
    )
    add(
        "heatmap",
        "Time to target over depth x window",
        figures.draw_heatmap(ev) if trials else None,
        "Best score per cell (seconds on the search's clock; a miss scores above the "
        "budget); blank cells were not finished by any trial.",
        unread,
    )
    add(
        "microbatch",
        "Time to target over micro-batch size",
        figures.draw_microbatch(ev) if trials else None,
        "Every finished search trial; crosses at the top were pruned.",
        unread,
    )
    fig, imp = figures.draw_importances(ev) if trials else (None, {})
    add(
        "importances",
        "Parameter importances (Optuna, fANOVA)",
        fig,
        "The share of the score's variance each searched parameter explains, per schedule.",
        "; ".join(f"{s}: {v}" for s, v in imp.items() if isinstance(v, str)) if trials else unread,
    )
    path, why = verdict.draw_timelines(ev, out / "timelines.png")
    pics.append(
        Picture(
            "timelines",
            "Simulated timelines: recommended PACI vs best flush",
            path,
            "Both chosen points simulated on the search's cost profile, on one time axis: hatched grey is "
            "idle time, the bubble PACI removes."
            if path
            else why,
        )
    )
    add(
        "drift",
        "PACI's drift per stage against its bound",
        verdict.draw_drift(ev),
        "Measured in the chosen PACI trial and predicted by the simulator; the step line is ceil((P-s-1)/a).",
        "no finished PACI trial",
    )
    add(
        "speedup",
        "PACI's speedup over flush",
        verdict.draw_speedup(ev),
        "Flush's score over PACI's per confirmation seed, and the ratio of means with best.yaml's interval.",
        "best.yaml has no PACI-vs-flush figure",
    )
    sentence = verdict_sentence(ev)
    tabs = tables(ev)
    index = write_page(
        out / "index.html", title=f"paci-tune report: {ev.name}", verdict=sentence, tables=tabs, pictures=pics
    )
    return Report(ev, sentence, tabs, pics, imp, index)
