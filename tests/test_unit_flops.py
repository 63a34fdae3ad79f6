"""A model with no cost of its own is cut by its units' forward FLOPs, counted on the check's sample.

The oracle is analytic: 2 * in * out FLOPs per token per linear layer, none for a table lookup. A toy with
a huge embedding and vocabulary head around equal blocks, cut by parameter count, would crowd the blocks
onto the stages without the embedding or the head; cut by FLOPs, they are spread evenly.
"""

from __future__ import annotations

import pytest
from helpers.configs import make_config
from helpers.probe_models import analytic_flops

from paci_tune.config import load_run_config
from paci_tune.model import load_model
from paci_tune.pipeline.checks import check_units
from paci_tune.pipeline.factory import resolve_pieces
from paci_tune.schedule.partition import balanced_partition

SIZE = {"vocab_size": 2048, "d_model": 32, "n_layer": 24}
"""The head costs 8 blocks (2 * 32 * 2048 = 8 * 2 * 8 * 32 * 32), the embedding nothing: 32 blocks' worth."""
SPEC = {"entry": "helpers.probe_models:build_wide_vocab", "kwargs": SIZE, "block_size": 16}


def test_check_units_counts_each_units_forward_flops_per_token() -> None:
    meta = load_model(SPEC, 64, 0)
    assert meta.flops is None
    check_units(meta, 64, SPEC["entry"])
    assert meta.flops == pytest.approx(analytic_flops(**SIZE), rel=0, abs=0)


def test_an_entry_model_is_cut_by_flops_not_parameter_count() -> None:
    doc = make_config(pipeline={"stages": 4, "window": 4, "partition": "auto"})
    doc["model"] = dict(SPEC)
    sizes = resolve_pieces(load_run_config(doc), distributed=False).config.pipeline.partition
    want = balanced_partition(analytic_flops(**SIZE), 4)
    assert sizes == want == [9, 8, 8, 1]  # 8 blocks' worth a stage: the head alone, the blocks spread evenly
