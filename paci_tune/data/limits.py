"""What a run may ask of its data: batches and a validation set the token source can supply.

The stream samples windows with replacement, so any micro-batch size "works" until its tensors do
not fit; the line drawn here is what cannot be meant. A global batch holds at most the training
split's tokens (one optimizer step never needs every token twice), and the validation set at most
as many sequences as the held-out split has distinct windows (more would score the same windows
again). Everything below those bounds is allowed, however large. May import: numpy (through the
token source), :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def check_fits_data(source: Any, block_size: int, global_batch: int, microbatch_size: int, eval_sequences: int) -> None:
    """Refuse a batch or validation set the source ``source`` cannot supply (module docstring)."""
    train, val = len(source.train), len(source.val)
    smaller = min(train, val)
    if smaller < block_size + 1:
        raise ConfigError("model.block_size", block_size, f"at most {smaller - 1}: a data split has {smaller} tokens")
    most = max(train // block_size, 1)
    why = f"at most {most}: the training split has {train} tokens, {most} sequences of {block_size}"
    if global_batch > most:
        raise ConfigError("training.global_batch", global_batch, why)
    if microbatch_size > most:
        raise ConfigError("pipeline.microbatch_size", microbatch_size, why)
    windows = max(val - block_size, 1)
    if eval_sequences > windows:
        raise ConfigError(
            "training.eval_sequences",
            eval_sequences,
            f"at most {windows}: the distinct windows of the {val}-token validation split",
        )
