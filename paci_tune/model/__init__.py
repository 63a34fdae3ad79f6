"""Models as flat lists of pipeline units (see :mod:`paci_tune.model.gpt` for why) and their loss.

May import: torch, numpy, :mod:`paci_tune.base`, :mod:`paci_tune.errors` and the standard library.
"""

from paci_tune.model.gpt import (
    PRESETS,
    GPTConfig,
    build_units,
    model_flops_per_token,
    num_units,
    unit_flops,
    unit_names,
)
from paci_tune.model.loader import LoadedModel, input_grads, load_model, shared_parameters, trains
from paci_tune.model.loss import next_token_loss

__all__ = [
    "PRESETS",
    "GPTConfig",
    "LoadedModel",
    "build_units",
    "input_grads",
    "load_model",
    "model_flops_per_token",
    "next_token_loss",
    "num_units",
    "shared_parameters",
    "trains",
    "unit_flops",
    "unit_names",
]
