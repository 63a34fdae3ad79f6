"""The report's pictures of the search: where in the space the time to target was, and what mattered.

Each ``draw_*`` builds a matplotlib figure from the :class:`~.gather.Evidence` and nothing else
(tests read the figure's axes and series; :func:`save` writes it as a PNG, atomically). A picture
that has nothing to show (importances of a study with one finished trial) is ``None`` with the
reason, never an empty frame. The recommendation's own pictures are in :mod:`.verdict`. May
import: matplotlib, optuna, :mod:`.gather`, :mod:`paci_tune.verdict`, :mod:`paci_tune.tune`, :mod:`paci_tune.base`,
:mod:`paci_tune.schedule` (the colours).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.files import atomic_write
from ..schedule import REGISTRY
from ..verdict.plot import draw_search
from .gather import Evidence, TrialRow

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = {name: spec.colour for name, spec in REGISTRY.items()}
"""Each schedule's colour in every figure (the registry's)."""


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG) atomically and release it."""
    plt = pyplot()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".png")
    finally:
        plt.close(fig)


def draw_curves(ev: Evidence) -> Figure:
    """Validation loss against the clock for every trial; the winners and their confirmed seeds thick."""
    thick = set()
    for schedule in ev.studies:
        if (w := ev.winner(schedule)) is not None:
            thick.add((schedule, w.number))
            thick.update((schedule, r.number) for r in ev.confirmations(schedule, w.number))
    budget = ev.budget or max((c for rows in ev.rows.values() for r in rows for c, _ in r.curve), default=1.0)
    return draw_search(ev.studies, target=ev.target or math.nan, budget=budget, clock=ev.clock, best=None, thick=thick)


def _search_rows(ev: Evidence, schedule: str) -> list[TrialRow]:
    return [r for r in ev.rows.get(schedule, []) if r.is_search and r.point is not None and r.state != "infeasible"]


def _depth_label(ev: Evidence, p: int) -> str:
    ds = sorted({r.point.data_parallel for rows in ev.rows.values() for r in rows if r.point and r.point.stages == p})
    return f"{p} x D={'/'.join(map(str, ds))}" if ds and ds != [1] else str(p)


def draw_heatmap(ev: Evidence) -> Figure:
    """The best score at each (depth, window) cell, per schedule (the depth's D in its label).

    The score is the objective: time to target, or more than the budget for a trial that missed
    it. Cells no finished trial visited are blank; a cell's number is its best score in seconds.
    """
    import numpy as np

    plt = pyplot()
    ykey, xkey = "stages", "window"  # on a device budget D follows from P: it labels the depth axis
    schedules = list(ev.studies)
    ys = sorted({getattr(r.point, ykey) for s in schedules for r in _search_rows(ev, s)})
    xs = sorted({getattr(r.point, xkey) for s in schedules for r in _search_rows(ev, s)})
    fig, axes = plt.subplots(1, len(schedules), figsize=(4.8 * len(schedules), 3.8), squeeze=False)
    cells = {}
    for s in schedules:
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in _search_rows(ev, s):
            if r.state == "complete" and r.score is not None:
                i, j = ys.index(getattr(r.point, ykey)), xs.index(getattr(r.point, xkey))
                grid[i, j] = r.score if math.isnan(grid[i, j]) else min(grid[i, j], r.score)
        cells[s] = grid
    finite = [v for g in cells.values() for v in g.flat if not math.isnan(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    for ax, s in zip(axes[0], schedules, strict=True):
        im = ax.imshow(cells[s], cmap="viridis_r", vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
        for (i, j), v in np.ndenumerate(cells[s]):
            if not math.isnan(v):
                ax.text(
                    j,
                    i,
                    f"{v:.3g}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if v < (lo + hi) / 2 else "white",
                )  # viridis_r: low is light
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [_depth_label(ev, y) for y in ys])
        ax.set_xlabel("window a (micro-batches per step)")
        ax.set_ylabel("pipeline depth P")
        ax.set_title(f"{s}: best score (s), {ev.clock} clock")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    return fig


def draw_microbatch(ev: Evidence) -> Figure:
    """Score against micro-batch size, every finished search trial; pruned ones as crosses at the top."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    top = max((r.score for rows in ev.rows.values() for r in rows if r.score is not None), default=1.0)
    for i, s in enumerate(ev.studies):
        rows = _search_rows(ev, s)
        jitter = (i - 0.5) * 0.06
        done = [r for r in rows if r.state == "complete" and r.score is not None]
        ax.scatter(
            [r.point.microbatch_size * (1 + jitter) for r in done],
            [r.score for r in done],
            color=COLOURS.get(s),
            label=f"{s} (finished)",
        )
        pruned = [r for r in rows if r.state == "pruned"]
        if pruned:
            ax.scatter(
                [r.point.microbatch_size * (1 + jitter) for r in pruned],
                [top * 1.05] * len(pruned),
                marker="x",
                color=COLOURS.get(s),
                label=f"{s} (pruned)",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size b (sequences)")
    ax.set_ylabel(f"score: time to target ({ev.clock} clock, s)")
    if ev.budget:
        ax.axhline(ev.budget, color="grey", lw=0.8, ls=":", label="budget")
    ax.legend(fontsize=8)
    ax.set_title("time to target by micro-batch size")
    fig.tight_layout()
    return fig


def importances(ev: Evidence) -> dict[str, dict[str, float] | str]:
    """Optuna's own parameter importances per schedule (fANOVA) over its search trials, or why there are none.

    Confirmation and transfer-check runs are left out (:func:`paci_tune.tune.record.is_extra`): a
    long run's score is on another budget's scale. Optuna reads a whole study, so the search trials
    are copied into an in-memory one.
    """
    import optuna

    from ..tune.record import is_extra

    out: dict[str, dict[str, float] | str] = {}
    for s, study in ev.studies.items():
        done = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and t.value is not None and not is_extra(t)
        ]
        varied = {k for t in done for k in t.params if len({u.params.get(k) for u in done}) > 1}
        if len(done) < 2 or not varied:
            out[s] = f"{len(done)} finished trial(s), no parameter varied among them"
            continue
        search = optuna.create_study(directions=study.directions)
        search.add_trials(done)
        try:
            out[s] = dict(optuna.importance.get_param_importances(search, params=sorted(varied)))
        except (RuntimeError, ValueError) as e:  # too few distinct points for the evaluator
            out[s] = f"not computable: {e}"
    return out


def draw_importances(ev: Evidence) -> tuple[Figure | None, dict[str, dict[str, float] | str]]:
    """Bars of each schedule's importances; None when no schedule has any."""
    imp = importances(ev)
    shown = {s: v for s, v in imp.items() if isinstance(v, dict)}
    if not shown:
        return None, imp
    plt = pyplot()
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.2), squeeze=False)
    for ax, (s, v) in zip(axes[0], shown.items(), strict=True):
        names = list(v)
        ax.barh(names, [v[n] for n in names], color=COLOURS.get(s))
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("importance (fANOVA, share of variance)")
        ax.set_title(f"{s}: what the score depended on")
    fig.tight_layout()
    return fig, imp
