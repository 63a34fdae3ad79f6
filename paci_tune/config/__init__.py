"""Configuration: YAML in, validated frozen dataclasses out, and the one rule for deriving a run.

Every run -- ``paci-tune train`` with its options, a pipeline worker, a search trial's point,
``apply`` of a ``best.yaml`` -- is a document plus dotted overrides, turned into a
:class:`RunConfig` by :func:`derive_run`. May import: :mod:`paci_tune.base`,
:mod:`paci_tune.errors`, :mod:`paci_tune.schedule`, PyYAML and the standard library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..base.files import read_mapping
from ..base.shipped import resolve_path
from .schema import (
    LRScheduleConfig,
    OptimizerConfig,
    PipelineConfig,
    RunConfig,
    TrainingConfig,
    from_dict,
    load_run_config,
)
from .tune import parse_tune_sections, split_tune_sections

__all__ = [
    "LRScheduleConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainingConfig",
    "derive_doc",
    "derive_run",
    "from_dict",
    "load_config",
    "load_run_config",
]

PAIRED = (("pipeline.window", "pipeline.microbatch_size"), ("training.steps", "training.seconds"))
"""Keys that determine each other (a * b = global batch) or exclude each other (one budget)."""


def derive_doc(data: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run document with dotted overrides (``pipeline.stages``) applied to a copy of ``data``.

    A ``None`` value unsets the key (its default, or derived). Overriding one key of a
    :data:`PAIRED` pair and not the other unsets the other, so it is derived (window from
    micro-batch size) or unused (the other budget) rather than contradicted.
    """
    overrides = dict(overrides or {})
    for a, b in PAIRED:
        for key, other in ((a, b), (b, a)):
            if overrides.get(key) is not None and other not in overrides:
                overrides[other] = None
    doc: dict[str, Any] = dict(data or {})
    for dotted, value in overrides.items():
        section, _, leaf = dotted.partition(".")
        node = doc.get(section)
        node = dict(node) if isinstance(node, dict) else {}
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        doc[section] = node
    return doc


def derive_run(data: Any, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The validated run of a document plus overrides (see :func:`derive_doc`)."""
    return load_run_config(derive_doc(data, overrides))


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a run (or search) file, check its tuning sections if any, and derive the run.

    An empty file is an error naming it (not the defaults): a run is always written down. The
    README's ``examples/tiny-gpt.yaml`` is found in the package where no such file exists here.
    """
    what = "sections model, data, training, optimizer, lr_schedule, pipeline"
    data = read_mapping(resolve_path(path), "config", what)
    run_doc, tune = split_tune_sections(data)
    parse_tune_sections(tune, require=False)  # checked, then left to `paci-tune search`
    return derive_run(run_doc, overrides)
