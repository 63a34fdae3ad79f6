"""What a search tells its live view (:class:`SearchEvent`): a trial started, made progress, or ended.

Its own module so the view (:mod:`paci_tune.cli.search_view`) reads the events without the search
loop. May import: the tune layer's :mod:`.point` and :mod:`.objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .objective import Progress
from .point import TrialParams


@dataclass
class SearchEvent:
    """What the live view hears: a trial started, made progress, or ended."""

    kind: str  # "start" | "eval" | "record" | "end" | "wait"
    schedule: str
    number: int
    params: TrialParams | None = None
    step: int | None = None
    progress: Progress | None = None
    record: dict[str, Any] | None = None
    state: str | None = None
    reason: str | None = None
    value: float | None = None
