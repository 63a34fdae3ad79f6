"""The summary record that closes a run: its figures, as the search, the report and ``paci-tune train`` read them.

Throughput and bubble on the runtime's own timing and again on the run's clock (``clock_*``: the
objective's figures on a profile clock), the schedule's analytic bubble (PACI's fills at segment
ends; a timed schedule's formula on the profile's costs; else the textbook one), drift against its
bound, measured and predicted memory against the device budget (:mod:`.memory_check`) and the
closing losses. :class:`~.loop.Trainer` writes it once training ends. May import:
:mod:`paci_tune.pipeline`, :mod:`paci_tune.config`, :mod:`paci_tune.schedule`, the train layer's own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.layout import Layout
from ..config.schema import RunConfig
from ..pipeline.factory import Setup
from ..schedule import schedule_of
from .clock import Clock
from .memory_check import against_budget, allocated, predicted
from .timed import is_timed, numerics_config

if TYPE_CHECKING:
    from .loop import LoopState


def summary_record(
    cfg: RunConfig,
    state: LoopState,
    stats: list[dict[str, Any]],
    records: list[dict[str, Any]],
    setup: Setup,
    clock: Clock,
    layout: Layout,
    meter: Any,
) -> dict[str, Any]:
    """The ``summary`` record of a run at the end of its training (``state``), from the stages' ``stats``
    (:meth:`~paci_tune.pipeline.runtime.Runtime.stats`), the ``records`` written so far, the run's clock
    and its layout (its own cut); ``meter``: the runtime's allocation meter, if any."""
    c, st = cfg, state
    losses = [r["loss"] for r in records if r.get("event") == "train"]
    tail = losses[-10:]
    p, m = c.pipeline.stages, c.pipeline.window
    spec = schedule_of(c.pipeline.schedule)
    if spec.asynchronous:  # fills and drains once per segment (at checkpoints)
        fill = st.segments * (p - 1)
        analytic = fill / (m * st.batches_done + fill) if st.batches_done else 0.0
    elif is_timed(c) and clock.analytic_bubble is not None:  # its own formula, on the profile's costs
        analytic = clock.analytic_bubble
    else:  # the schedule's textbook bubble at equal costs
        analytic = spec.bubble(p, m, c.layout.chunks)
    mfu_flops = setup.flops_per_token
    bubble = sum(x["bubble_fraction"] for x in stats) / len(stats)
    if st.clock_busy and st.clock_span > 0:  # the same figures on the objective's clock
        clock_bubble = sum(1.0 - b / st.clock_span for b in st.clock_busy) / len(st.clock_busy)
    else:
        clock_bubble = bubble
    return {
        "event": "summary",
        "schedule": c.pipeline.schedule,
        "chunks": c.layout.chunks,
        # The schedule the runtime ran: a timed one's (interleaved, zb-h1 on the emulated runtime)
        # numbers are 1F1B's, and so are the runtime's own figures below (tokens_per_s,
        # bubble_fraction, stages); its clock_* figures are its own schedule's simulated timeline.
        "numerics_schedule": numerics_config(c).pipeline.schedule,
        "runtime": c.pipeline.runtime,
        "n_stages": p,
        "data_parallel": c.pipeline.data_parallel,  # replicas; tokens and tokens/s count the whole global batch
        "window": m,
        "microbatch_size": c.pipeline.microbatch_size,
        "global_batch": c.training.global_batch,
        "partition": list(layout.partition or ()),  # the run's own cut (a timed schedule's, v * P pieces)
        "device": str(setup.device),
        "precision": setup.precision,
        "steps": st.batches_done,
        "tokens": st.tokens,
        "tokens_per_s": st.tokens / st.makespan if st.makespan else 0.0,
        "wall_tokens_per_s": st.tokens / st.train_wall if st.train_wall else 0.0,
        "train_seconds": st.train_wall,
        "pipeline_seconds": st.makespan,
        "model_flops_per_token": mfu_flops,
        "bubble_fraction": bubble,
        "analytic_bubble_fraction": analytic,
        "max_drift": max(x["max_drift"] for x in stats),
        "drift_bound": max(x["drift_bound"] for x in stats) if spec.asynchronous else 0,
        "peak_memory_bytes": max(x["peak_memory_bytes"] for x in stats),
        "final_val_loss": st.last_val_loss,
        "train_loss": sum(tail) / len(tail) if tail else None,
        "clock": clock.now(),
        "clock_name": clock.name,
        "clock_tokens_per_s": st.tokens / st.clock_span if st.clock_span > 0 else 0.0,
        "clock_step_time_s": st.clock_span / trained if (trained := st.batches_done - st.origin) else 0.0,
        "clock_bubble_fraction": clock_bubble,
        "memory_measured_per": "stage" if c.pipeline.runtime == "distributed" else "process (all stages)",
        **allocated(stats, meter, setup.device.type),
        **against_budget(c, stats),  # hardware.memory against what the run measured
        **predicted(c, setup.profile),  # simulate's and the search's figure for this layout
        "profile": c.training.profile,
        "stages": stats,
    }
