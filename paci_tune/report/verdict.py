"""The report's pictures of the recommendation: its timeline, its drift, and the speedup's interval.

- Timelines: the recommended PACI point and the best flush point simulated on the search's own
  cost profile (the profile the trials' sim/rst clocks read), one above the other on one time
  axis, so the bubble PACI removes is visible. A wall-clock search has no profile: no picture.
- Drift: per stage, the most optimizer updates a micro-batch crossed between its forward and its
  backward, measured in the trial and predicted by the simulator, against PACI's bound
  ceil((P-s-1)/a).
- Speedup: the baseline's score over PACI's on each confirmed seed, their geometric mean and the
  verdict's interval (best.yaml's ``comparison``), and the line at 1 that the verdict is about.
May import: matplotlib, :mod:`.gather`, :mod:`.figures`, :mod:`paci_tune.sim`, :mod:`paci_tune.schedule`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schedule import drift_bound
from .figures import COLOURS, pyplot
from .gather import Evidence, TrialRow

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..sim.profile import Profile
    from ..sim.simulator import SimResult


def profile_path(ev: Evidence) -> Path | None:
    """The cost profile the search's trials were timed with, when it still exists."""
    run = (ev.best.run if ev.best else None) or {}
    path = (run.get("training") or {}).get("profile")
    return Path(path) if path and Path(path).is_file() else None


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Profile:
    """One read per profile file: the timelines and the drift picture simulate on the same one."""
    from ..sim.profile import Profile

    return Profile.load(path)


def simulated(ev: Evidence, row: TrialRow, n_batches: int = 2) -> SimResult | None:
    """The trial's point simulated on the search's profile and the trial's own stage cut."""
    from ..sim.simulator import simulate

    path, p = profile_path(ev), row.point
    sizes = row.attrs.get("partition")
    if path is None or p is None or not sizes:
        return None
    profile = _load(str(path))
    return simulate(
        p.layout.with_partition(sizes),
        profile,
        n_batches,
        extend=False,
        backward_weights=p.backward_weights or "forward",  # trials record it; older ones ran the default
    )


def draw_timelines(ev: Evidence, path: Path) -> tuple[Path | None, str]:
    """PACI's winner above flush's on one axis; (None, why) when they cannot be simulated."""
    from ..sim.plot import plot_timelines

    results = [r for s in ("paci", ev.baseline_schedule) if (w := ev.winner(s)) is not None and (r := simulated(ev, w))]
    if not results:
        why = "no cost profile (a wall-clock search)" if profile_path(ev) is None else "no finished trial"
        return None, why
    title = "Simulated timelines of the chosen points: " + " vs ".join(
        f"{r.layout.schedule} P={r.layout.stages} x D={r.layout.data_parallel} a={r.layout.window} "
        f"b={r.layout.microbatch_size}"
        for r in results
    )
    return plot_timelines(results, path, title=title), ""


def drift_rows(ev: Evidence) -> list[dict[str, Any]]:
    """Per stage of PACI's chosen point: measured and simulated maximum drift, and the bound."""
    w = ev.winner("paci")
    if w is None or w.point is None:
        return []
    p = w.point
    measured = w.attrs.get("stage_drift") or []
    sim = simulated(ev, w, n_batches=max(4 * p.stages, 8))
    rows = []
    for s in range(p.stages):
        rows.append(
            {
                "stage": s,
                "measured": measured[s]["max"] if s < len(measured) else None,
                "simulated": sim.per_stage[s].max_drift if sim is not None else None,
                "bound": drift_bound(s, p.stages, p.window),
            }
        )
    return rows


def draw_drift(ev: Evidence) -> Figure | None:
    rows = drift_rows(ev)
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    xs = [r["stage"] for r in rows]
    for k, (key, colour, dx) in enumerate((("measured", COLOURS["paci"], -0.2), ("simulated", "#88BBEE", 0.2))):
        vals = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r[key] is not None]
        if vals:
            ax.bar(
                [x + dx for x, _ in vals],
                [v for _, v in vals],
                width=0.4,
                color=colour,
                label=f"{key} max drift",
                zorder=2 + k,
            )
    ax.step(
        [x - 0.5 for x in xs] + [xs[-1] + 0.5],
        [r["bound"] for r in rows] + [rows[-1]["bound"]],
        where="post",
        color="black",
        lw=1.5,
        label="bound ceil((P-s-1)/a)",
    )
    p = ev.winner("paci").point  # type: ignore[union-attr]
    ax.set_xticks(xs, [f"stage {x}" for x in xs])
    ax.set_ylabel("optimizer updates crossed")
    ax.set_title(f"PACI drift per stage: {p.label()}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_speedup(ev: Evidence) -> Figure | None:
    """The baseline's time over PACI's on each paired seed, their geometric mean and the verdict's interval;
    None when best.yaml has no comparison."""
    c = ev.best.verdict_record if ev.best is not None else None
    if c is None:
        return None
    name = c.baseline_name
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    if c.interval is not None:
        ratios = c.ratios
        ax.scatter(list(ratios.values()), [0.15] * len(ratios), color="grey", label=f"one seed ({name} / PACI)")
        for i, (seed, r) in enumerate(ratios.items()):  # staggered: equal ratios must stay legible
            ax.annotate(
                f"seed {seed}",
                (r, 0.15),
                textcoords="offset points",
                xytext=(0, 6 + 9 * (i % 3)),
                ha="center",
                fontsize=7,
            )
        lo, hi = c.interval
        label = f"geometric mean, {c.level:.0%} interval [{lo:.3g}, {hi:.3g}] (n = {c.n})"
        ax.errorbar(
            [c.speedup], [0], xerr=[[c.speedup - lo], [hi - c.speedup]], fmt="o", color="black", capsize=6, label=label
        )
    else:
        ax.scatter([c.speedup], [0], color="black", label="single draws (no interval)")
    ax.axvline(1.0, color="#CC6611", ls="--", lw=1, label="1 = tie")
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.6)
    ax.set_xlabel(f"PACI speedup over {name} ({name}'s time / PACI's; > 1: PACI faster)")
    ax.set_title(f"verdict: {c.verdict} ({c.method.split(',')[0]})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
