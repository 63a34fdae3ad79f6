"""Configuration: YAML files in, validated dataclasses out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
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
    "REMOVE",
    "LRScheduleConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainingConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "load_run_config",
    "read_yaml",
]


def read_yaml(path: str | Path, key: str = "config") -> Any:
    """Parse a YAML file, turning a missing file or a syntax error into a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, str(path), "an existing YAML file")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(key, str(path), f"valid YAML ({str(e).splitlines()[0]})") from None


REMOVE = object()
"""Override value that deletes a key, so a derived setting is recomputed (window from micro-batch size)."""


def apply_overrides(data: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``pipeline.stages``) in a parsed document; ``None`` values are skipped,
    :data:`REMOVE` deletes the key."""
    doc: dict[str, Any] = dict(data or {})
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, leaf = dotted.partition(".")
        node = doc.get(section)
        node = dict(node) if isinstance(node, dict) else {}
        if value is REMOVE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        doc[section] = node
    return doc


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read, override and validate a run configuration file."""
    data = read_yaml(path)
    if data is not None and not isinstance(data, dict):
        raise ConfigError("config", str(path), "a YAML mapping with sections model, data, training, ...")
    run_doc, tune = split_tune_sections(data or {})
    parse_tune_sections(tune, require=False)  # checked, then left to `paci-tune search`
    return load_run_config(apply_overrides(run_doc, overrides or {}))
