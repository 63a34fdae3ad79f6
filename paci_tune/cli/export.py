"""``paci-tune export``: a trained run's checkpoint as a Hugging Face model folder.

RUN_OR_CHECKPOINT is a checkpoint folder (with ``meta.json``) or a checkpoint root whose ``LATEST``
names one (a run's ``--checkpoint-dir``, or the folder ``apply`` checkpoints into). The stage files are
read weights-only (:mod:`paci_tune.train.checkpoint`); the model is rebuilt from the run's own
``model`` section, recorded in the checkpoint, and written with ``save_pretrained`` as safetensors
(:mod:`paci_tune.model.export`). Only ``model: {hf: ...}`` runs export: a preset or entry model has no
Hugging Face class to save into (exit 2). May import: :mod:`paci_tune.model`, :mod:`paci_tune.train`,
:mod:`paci_tune.errors`, click.
"""

from __future__ import annotations

from pathlib import Path

import click

from .common import stderr


@click.command()
@click.argument("run_or_checkpoint", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
def export(run_or_checkpoint: str, out: str) -> None:
    """Write the trained model of RUN_OR_CHECKPOINT (an hf model's run) to OUT with save_pretrained."""
    from ..errors import ConfigError
    from ..model.export import ARG, export_hf
    from ..train.checkpoint import check_files, find, units_of

    folder = find(Path(run_or_checkpoint), ARG)
    check_files(folder, ARG)  # nothing but data, refused before any unpickling
    meta, units = units_of(folder)
    spec = (meta.get("fingerprint") or {}).get("model")
    if not isinstance(spec, dict):
        raise ConfigError(ARG, str(folder), "a checkpoint that records its run's model section")
    export_hf(spec, units, Path(out), folder)
    stderr(f"exported {folder} to {out} (load it with AutoModelForCausalLM.from_pretrained({out!r}))")
