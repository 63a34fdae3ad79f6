"""A picture of a search: every trial's validation curve on the budget's clock.

One panel per schedule, the target as a line, finished trials solid, pruned ones dashed and
ending where they were stopped, the recommendation drawn thick (a transfer check's long runs, on
another budget, are not drawn). It shows at a glance what a
table of numbers hides: how early the pruner cut, and how close the runners-up came. May import:
matplotlib, optuna, :mod:`paci_tune.base`, :mod:`paci_tune.tune` (the trial record).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from ..base.files import atomic_write
from ..tune.record import TrialRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_search(
    studies: dict[str, optuna.Study],
    *,
    target: float,
    budget: float,
    clock: str,
    best: tuple[str, int] | None,
    path: Path,
    thick: Collection[tuple[str, int]] = (),
) -> Path:
    """Write the PNG (atomically: a temporary file renamed into place) and return its path."""
    import matplotlib.pyplot as plt

    fig = draw_search(studies, target=target, budget=budget, clock=clock, best=best, thick=thick)
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".png")
    finally:
        plt.close(fig)


def draw_search(
    studies: dict[str, optuna.Study],
    *,
    target: float,
    budget: float,
    clock: str,
    best: tuple[str, int] | None,
    thick: Collection[tuple[str, int]] = (),
) -> Figure:
    """The figure: one panel per schedule. ``thick``: (schedule, trial number) pairs drawn like the
    recommendation -- the report's confirmed seeds of each schedule's winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(studies), figsize=(6 * len(studies), 4.2), sharey=True, squeeze=False)
    for ax, (schedule, study) in zip(axes[0], studies.items(), strict=True):
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            r = TrialRecord.read(t)
            curve: Any = r.curve
            if not curve or r.is_repeat or r.is_transfer:
                continue
            xs, ys = [c for c, _ in curve], [v for _, v in curve]
            chosen = best == (schedule, t.number) or (schedule, t.number) in thick
            style = "-" if t.state == TrialState.COMPLETE else "--"
            ax.plot(
                xs,
                ys,
                style,
                lw=3 if chosen else 1,
                alpha=1 if chosen else 0.6,
                label=f"#{t.number} {r.label or ''}" if chosen else None,
            )
            if t.state == TrialState.PRUNED:
                ax.plot(xs[-1:], ys[-1:], "x", color="grey")
        ax.axhline(target, color="black", lw=0.8, ls=":")
        ax.set_xlim(0, budget)
        ax.set_title(f"{schedule}: {len(study.trials)} trials (dashed: pruned)")
        ax.set_xlabel(f"{clock} clock (s)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    axes[0][0].set_ylabel("validation loss")
    fig.tight_layout()
    return fig
