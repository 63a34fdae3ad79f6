"""One search from a search file: open it (space, storage, studies, profile, start points) and run it.

Its studies become ``best.yaml`` in the verdict layer (:func:`paci_tune.verdict.recommend.recommend`);
``paci-tune search`` is the two plus a live view. May import: optuna, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors` and the tune layer's own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from ..base.credentials import scrub, shown
from ..base.files import read_mapping
from ..base.shipped import resolve_path
from ..config import derive_doc
from ..config.tune import TuneConfig, load_tune_config
from ..errors import ConfigError, Failure
from .events import SearchEvent
from .preflight import check_outputs, check_trials
from .runner import SubprocessRunner
from .search import Search
from .setup import (
    bind_space,
    drop_over_budget,
    drop_unfit,
    enqueue_start_points,
    fingerprint,
    profile_for,
    side_by_side,
    trial_runtime,
)
from .space import SearchSpace
from .study import open_storage, open_studies
from .warm import WarmStart, prepare

Log = Callable[[str], None]


@dataclass
class SearchSession:
    """A search file bound to this machine and its storage, ready to run (or to be resumed)."""

    config: Path
    tune: TuneConfig
    name: str
    workdir: Path
    storage_url: str
    space: SearchSpace
    studies: dict[str, optuna.Study]
    profile: str | None
    warm: WarmStart | None = None

    def search(self, on_event: Callable[[SearchEvent], None]) -> Search:
        s = self.tune.search
        runner = SubprocessRunner(stall_seconds=s.stall_seconds, timeout=s.trial_timeout)
        return Search(
            self.tune,
            self.space,
            self.studies,
            runner,
            self.workdir,
            self.profile,
            on_event=on_event,
            warm=self.warm,
            jobs=side_by_side(self.tune, self.space, self.profile),
        )


def open_search(
    config: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    study_name: str | None = None,
    workdir: str | Path | None = None,
    storage: str | None = None,
    log: Log | None = None,
    out: str | Path | None = None,
) -> SearchSession:
    """Validate the file (with ``search.*`` overrides), bind its space, open its studies, get its profile.

    Every trial the space can produce is validated and the outputs (``out``, the work folder, a
    file storage) checked writable before anything is created (:mod:`.preflight`); the storage is
    opened before anything is measured, so a bad URL or a different stored search is refused first.
    A warm-started search's warm-up is trained here, once for all workers (:mod:`.warm`).
    """
    config = resolve_path(config)  # examples/tiny-gpt.yaml from the package when not here
    doc = read_mapping(config, "config", "sections model, data, training, ..., target, budget, search")
    tune = load_tune_config(derive_doc(doc, overrides), str(config))
    if study_name is not None and (not study_name.strip() or "/" in study_name):
        raise ConfigError("--study-name", study_name, "a non-empty name without '/'")
    name = study_name or tune.search.study_name or Path(config).stem
    work = Path(workdir or Path("paci-search") / name).resolve()
    storage_url = storage or f"sqlite:///{work / 'study.db'}"
    space = bind_space(tune)
    check_trials(tune, space, None)
    check_outputs(out, work, storage_url)
    try:
        studies = open_studies(
            open_storage(storage_url),
            name,
            space.schedules,
            tune.search,
            space,
            tune.budget.grid,
            fingerprint(tune, space),
        )
    except (ConfigError, Failure):
        raise
    except Exception as e:  # the database: unreachable, locked, not a database, another schema version
        raise Failure(f"opening the study storage {shown(storage_url)}", _storage_reason(e)) from e
    profile = profile_for(tune, space, work, log)
    space = drop_over_budget(tune, space, profile)  # hardware.memory: every schedule's points predicted above it
    studies = {s: st for s, st in studies.items() if s in space.schedules}  # a schedule nothing fits is left out
    space = drop_unfit(tune, space, profile)  # after the fingerprint: it depends on this machine's free memory
    if log:
        for why in space.dropped:
            log(f"dropped from the space: {why}")
    warm = prepare(tune, name, work, storage_url, studies, trial_runtime(tune), log, profile)  # once, before any trial
    enqueue_start_points(tune, space, studies)
    return SearchSession(Path(config), tune, name, work, storage_url, space, studies, profile, warm)


def _storage_reason(e: Exception) -> str:
    text = scrub(next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__))
    if "table schema" in text:
        return f"it was written by another Optuna schema version ({text[:200]})"
    return f"{type(e).__name__}: {text[:240]}"
