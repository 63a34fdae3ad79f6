"""Models as flat lists of pipeline units; see :mod:`paci_tune.model.gpt` for why."""

from paci_tune.model.gpt import (
    PRESETS,
    GPTConfig,
    build_units,
    model_flops_per_token,
    num_units,
    unit_flops,
    unit_names,
)
from paci_tune.model.loader import LoadedModel, load_model

__all__ = [
    "PRESETS",
    "GPTConfig",
    "LoadedModel",
    "build_units",
    "load_model",
    "model_flops_per_token",
    "num_units",
    "unit_flops",
    "unit_names",
]
