"""Timeline pictures of simulated schedules: one panel per schedule, one row per stage.

Forward, backward, weight-gradient (``W``, zero-bubble schedules: there the backward box is the
input gradient alone) and optimizer-step boxes have distinct colours and carry their micro-batch
(or, for a step, global-batch) number when it fits, with ``.c`` for model chunk ``c > 0``
(interleaved); consecutive global batches alternate between a dark and a light shade so a reader can
see where PACI lets batches overlap; idle time is the hatched grey left between boxes. Panels share
the time axis, so the schedule that finishes first is visibly shorter. The format follows the file
suffix (``.png`` or ``.svg``); the file is written atomically. May import: matplotlib (when
drawing), :mod:`.simulator`, :mod:`paci_tune.schedule`, :mod:`paci_tune.base`,
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..base.files import atomic_write
from ..errors import ConfigError
from ..schedule import Op
from .simulator import SimResult

FORMATS = ("png", "svg")
# Colour-blind-safe pairs (Paul Tol's palette): dark/light per op, alternating by global batch.
COLOURS = {
    Op.FORWARD: ("#4477AA", "#88BBEE"),
    Op.BACKWARD: ("#CC6611", "#EEAA66"),
    Op.WEIGHT: ("#AA3377", "#EE99CC"),
    Op.STEP: ("#228833", "#228833"),
}
LABELS = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward (B: input gradient only where W is drawn)",
    Op.WEIGHT: "weight gradient W",
    Op.STEP: "optimizer step",
}
IDLE = "#DDDDDD"


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 10:
        return 1.0, "s"
    if span >= 0.01:
        return 1e3, "ms"
    return 1e6, "µs"


def plot_timelines(results: Sequence[SimResult], path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``results`` (one panel each, top to bottom) to ``path``; returns the path written."""
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ConfigError("timeline", str(path), "a file name ending in .png or .svg")
    if not results:
        raise ValueError("nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(r.timeline.makespan for r in results)
    scale, unit = _time_unit(span)
    max_stages = max(r.layout.stages for r in results)
    width = 15.0
    heights = [0.55 * r.layout.stages + 0.7 for r in results]
    fig, axes = plt.subplots(
        len(results),
        1,
        sharex=True,
        figsize=(width, sum(heights) + 1.3),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    fig.subplots_adjust(left=0.07, right=0.99, top=1 - 0.75 / (sum(heights) + 1.3), bottom=0.85 / (sum(heights) + 1.3))
    # Usable width of an axis in points, to decide which labels fit inside their box.
    axis_pts = width * 72 * (0.99 - 0.07)
    pts_per_unit = axis_pts / (span * scale * 1.01)
    fontsize = 7

    for ax, res in zip(axes[:, 0], results, strict=True):
        tl = res.timeline
        for s, st in enumerate(tl.stages):
            ax.broken_barh(
                [(0, tl.makespan * scale)], (s - 0.4, 0.8), facecolors="white", edgecolor=IDLE, hatch="////", lw=0
            )
            for act, start, end in st.intervals:
                batch = act.mb if act.op is Op.STEP else act.mb // res.layout.window
                colour = COLOURS[act.op][batch % 2]
                x0, w = start * scale, (end - start) * scale
                ax.broken_barh([(x0, w)], (s - 0.4, 0.8), facecolors=colour, edgecolor="white", lw=0.4)
                label = f"S{act.mb}" if act.op is Op.STEP else repr(act)[1:]  # "3", or "3.1" on chunk 1
                if w * pts_per_unit > 0.62 * fontsize * len(label) + 2:
                    ax.text(
                        x0 + w / 2,
                        s,
                        label,
                        ha="center",
                        va="center",
                        fontsize=fontsize,
                        color="white" if batch % 2 == 0 or act.op is Op.STEP else "black",
                    )
        ax.set_ylim(max_stages - 0.5, -0.5)
        ax.set_yticks(range(res.layout.stages), [f"stage {s}" for s in range(res.layout.stages)])
        ax.tick_params(axis="y", length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        v = f" (v={res.layout.chunks})" if res.layout.chunks > 1 else ""
        ax.set_title(
            f"{res.layout.schedule}{v}: {res.step_time_s * scale:.3g} {unit} per global batch, "
            f"bubble {res.bubble_fraction:.0%}, makespan {tl.makespan * scale:.3g} {unit} "
            f"({res.n_batches} global batches of {res.layout.window} micro-batches)",
            loc="left",
            fontsize=10,
        )
    axes[-1, 0].set_xlim(0, span * scale * 1.01)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    drawn = {act.op for r in results for st in r.timeline.stages for act, _, _ in st.intervals}
    split = Op.WEIGHT in drawn
    ops = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT, Op.STEP) if split else (Op.FORWARD, Op.BACKWARD, Op.STEP)
    labels = LABELS if split else {**LABELS, Op.BACKWARD: "backward"}
    handles = [Patch(facecolor=COLOURS[op][0], label=labels[op]) for op in ops]
    handles.append(Patch(facecolor="white", edgecolor=IDLE, hatch="////", label="idle"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), frameon=False, fontsize=9)
    first = results[0]
    fig.suptitle(
        title
        or f"Simulated pipeline timelines · P={first.layout.stages} · a={first.layout.window} · "
        f"micro-batch {first.layout.microbatch_size}",
        x=0.07,
        ha="left",
        fontsize=11,
    )
    fig.text(
        0.07,
        0.2 / (sum(heights) + 1.3),
        "Box numbers: micro-batch (.c: model chunk c). Dark and light shades alternate between global batches. "
        "Green: optimizer step closing a global batch. Hatched grey: the stage is idle.",
        fontsize=8,
        color="#444444",
    )
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=130), suffix=f".{fmt}")
    finally:
        plt.close(fig)
    return out
