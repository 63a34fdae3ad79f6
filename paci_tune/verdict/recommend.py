"""``paci-tune search``'s last step: the studies of a finished search turned into ``best.yaml`` and its picture.

The provenance keeps the storage's URL without its password (:mod:`paci_tune.base.credentials`): best.yaml
is the file users keep and share. May import: :mod:`paci_tune.tune` (the session, the file's writer),
:mod:`paci_tune.base` and the verdict layer's :mod:`.best`, :mod:`.plot`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..base.credentials import without_password
from ..tune.bestfile import write_best
from ..tune.choices import lr_grid
from ..tune.comparison import Design
from ..tune.extra import confirm_seeds
from ..tune.rounds import current_round
from ..tune.search import Search
from ..tune.session import SearchSession
from ..tune.setup import untie_note
from .best import build_best
from .candidates import memory_section


def recommend(session: SearchSession, search: Search, out: Path) -> dict[str, Any]:
    """Build ``best.yaml`` from the studies, draw every trial's curve beside it, write it atomically."""
    from .plot import plot_search  # matplotlib: only when a search ends

    tune, b = session.tune, session.tune.budget
    c = tune.search.confirm
    design = Design(c.seeds, c.cap, c.tolerance)
    rounds = current_round(session.studies, tune.run.training.seed, design)
    # apply reads the budget back: an rst clock needs its reference profile, wherever apply runs from
    budget = {
        "clock": b.clock,
        "seconds": b.seconds,
        "grid": b.grid,
        **({"profile": str(Path(b.profile).resolve())} if b.profile else {}),
    }
    best = build_best(
        session.studies,
        run_doc_for=search.trial_doc,
        base_lr=float(tune.run.optimizer.lr),
        fixed_batch=session.space.fixed_batch,
        target={"metric": tune.target.metric, "value": tune.target.value},
        budget=budget,
        provenance={
            "study_name": session.name,
            "storage": without_password(session.storage_url),
            "clock": b.clock,
            "profile": session.profile,
            "space": session.space.describe(),
            "sampler": tune.search.sampler,
            "pruner": tune.search.pruner,
            "seed": tune.search.seed,
            "config": str(session.config.resolve()),
            **untie_note(tune),
        },
        confirm_seeds=confirm_seeds(tune.run.training.seed, rounds.seeds) if c.enabled else None,
        confirm_rounds={
            "min_seeds": c.seeds,
            "max_seeds": c.cap,
            "tolerance": c.tolerance,
            "stopped_by": rounds.stopped_by,
        }
        if c.enabled
        else None,
        transfer_factor=tune.search.transfer_check.factor if tune.search.transfer_check.enabled else None,
        warm_started=session.warm is not None,
        memory=memory_section(tune.run.hardware.memory, session.space.memory_bytes, session.space.over_memory),
        design=design,
        lr_grid=lr_grid(session.space.lr_scale, session.space.lr_is_range),
    )
    rec_number = int(str(best["evidence"]["trial"]).rsplit("#", 1)[-1])
    picture = plot_search(
        session.studies,
        target=float(tune.target.value or 0),
        budget=float(b.seconds or 0),
        clock=b.clock,
        best=(best["recommended"]["schedule"], rec_number),
        path=session.workdir / "trials.png",
    )
    best["provenance"]["plot"] = str(picture)
    if session.warm is not None:
        best["warm_start"] = {"note": session.warm.describe(), **session.warm.to_doc()}
    write_best(out, best)
    return best
