"""The checks of a run's model and data that commands other than ``train`` need before they start.

``calibrate`` measures a model at micro-batch sizes of its own choosing, and a search validates
its trials before any runs: both must refuse, as a trial or ``train`` would (:func:`.factory.load_pieces`),
a depth beyond the model's units or a batch the data cannot supply, without building the model.
May import: :mod:`paci_tune.data`, :mod:`paci_tune.model`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.config`, :mod:`paci_tune.errors`. Also the one place a run to be trained here checks
that its model's weights fit this machine (:func:`check_trainable_here`, used by :mod:`.factory`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config.schema import RunConfig
from ..data import TokenSource, load_source
from ..data.limits import check_fits_data
from ..errors import ConfigError
from ..model import LoadedModel, load_model
from ..model.loader import check_fits
from ..schedule import check_depth


def check_trainable_here(meta: LoadedModel) -> None:
    """A built-in GPT every stage of which is built on this machine must fit its memory (weights alone)."""
    if meta.gpt is not None:
        check_fits(meta.gpt, list(range(meta.n_units)))


def check_model_and_data(
    cfg: RunConfig, microbatch_sizes: Sequence[int] = (), key: str = "--microbatch-sizes", *, built_here: bool = True
) -> tuple[TokenSource, LoadedModel]:
    """The data source and the model's shape (no units built), every size checked against them.

    ``built_here=False`` (``simulate``: a plan, possibly of hardware this machine is not) skips the
    check that the model's weights fit this machine.
    """
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    meta = load_model(cfg.model, source.vocab_size, cfg.training.seed, indices=[])
    if built_here:
        check_trainable_here(meta)
    check_depth(cfg.pipeline.stages, meta.n_units)
    t = cfg.training
    check_fits_data(source, meta.block_size, t.global_batch, cfg.pipeline.microbatch_size, t.eval_sequences)
    for b in microbatch_sizes:
        try:
            check_fits_data(source, meta.block_size, 1, b, 1)
        except ConfigError as e:
            raise ConfigError(key, b, e.allowed) from None
    return source, meta
