"""``paci-tune export``'s work: a trained ``model: {hf: ...}`` run's units gathered back into its HF model.

The stages' checkpoint, read per model unit and parameter name (:func:`paci_tune.train.checkpoint.units_of`
reads it weights-only), fills the same model a run builds (:mod:`.hf_build`, untied as the run untied
it), whose units are views of it (:mod:`.hf_split`), so the whole ``*ForCausalLM`` then holds the trained
weights and ``save_pretrained`` writes it as safetensors with its config; an untied model is saved with
``tie_word_embeddings: false`` so that loading it does not tie the copies again. The vocabulary is the
checkpoint's own (its input embedding's rows), so the run's data need not be at hand. May import:
torch, transformers, the model layer's modules, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .hf import make_config, read_spec, untie_flag
from .hf_build import build_model
from .untie import untie_units

ARG = "RUN_OR_CHECKPOINT"


def _vocab(fields: Mapping[str, Any], units: Mapping[tuple[int, str], dict], where: object) -> int:
    """The vocabulary the run trained: its input embedding's rows, found by the split's name for it."""
    probe = make_config(fields, int(fields.get("vocab_size") or 8), where)
    model, split, _ = build_model(probe, 0, [], None, where)
    target = model.get_input_embeddings().weight
    for name, p in split.units[0].named_parameters():
        if p is target and (0, name) in units:
            return int(units[(0, name)]["value"].shape[0])
    raise ConfigError(ARG, str(where), "a checkpoint of this model's units (no input embedding in unit 0)")


def export_hf(spec: Mapping[str, Any], units: Mapping[tuple[int, str], dict], out: Path, where: object) -> Any:
    """Write the HF model of ``spec`` holding the checkpoint's ``units`` (keyed by (unit, name)) to ``out``.

    Returns the model written. Refused (ConfigError) when the checkpoint's units are not this model's.
    """
    if "hf" not in spec:
        kind = "entry" if "entry" in spec else "preset" if "preset" in spec else "other"
        raise ConfigError(
            ARG,
            str(where),
            f"a checkpoint of a `model: {{hf: ...}}` run (this one's model is a {kind} model; export writes "
            "Hugging Face models only)",
        )
    fields, _ = read_spec(spec["hf"])
    config = make_config(fields, _vocab(fields, units, where), spec["hf"])
    model, split, ties = build_model(config, 0, None, None, spec["hf"])
    by_unit = dict(enumerate(split.units))
    if untie_flag(spec):
        untie_units(by_unit, ties)
        model.config.tie_word_embeddings = False
    done: set[int] = set()
    with torch.no_grad():
        for i, unit in by_unit.items():
            for name, p in unit.named_parameters():
                if id(p) in done:
                    continue
                entry = units.get((i, name))
                if entry is None or tuple(entry["value"].shape) != tuple(p.shape):
                    raise ConfigError(ARG, str(where), f"a checkpoint of this model's units (unit {i} {name!r})")
                p.copy_(entry["value"])
                done.add(id(p))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return model
