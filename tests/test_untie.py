"""``model.untie: true``: every parameter several units share gets a copy per unit, so PACI can train the model.

Oracles: plain training of the same (untied) model in one process (tests/helpers/oracles.py), and the
parameter counts of the model's own shapes (the tied matrix is vocabulary x width). A tied model at
P = 2 under PACI is refused naming ``model.untie: true`` and its cost; untied, it trains; the cost is
the run's opening line.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run_in_process, train_losses
from helpers.guide_models import SMALL
from helpers.guide_runs import assert_plain, doc_for

from paci_tune.config import load_run_config
from paci_tune.errors import ConfigError
from paci_tune.model import load_model, shared_parameters
from paci_tune.train.run import resolve_run

pytest.importorskip("transformers")

from helpers.hf_models import hf_doc

TIED_COST = SMALL["vocab_size"] * SMALL["d_model"]  # the guide's tied head: the embedding's matrix


def tied_entry(schedule: str, cut: list[int], untie: bool) -> dict:
    doc = doc_for(schedule, cut, entry="build_tied")
    doc["model"]["untie"] = untie
    return doc


def test_an_untied_entry_model_holds_a_copy_per_unit() -> None:
    spec = tied_entry("1f1b", [3, 3], True)["model"]
    tied = load_model({k: v for k, v in spec.items() if k != "untie"}, 64, 0)
    untied = load_model(spec, 64, 0)
    assert shared_parameters([tied.units[i] for i in range(tied.n_units)])
    assert not shared_parameters([untied.units[i] for i in range(untied.n_units)])
    head, embed = untied.units[untied.n_units - 1], untied.units[0]
    assert torch.equal(head.tok.weight, embed.tok.weight)  # starts equal ...
    assert head.tok.weight is not embed.tok.weight  # ... as its own parameter
    assert untied.untied is not None and f"+{TIED_COST:,} parameters" in untied.untied


def test_paci_refuses_a_tied_entry_model_naming_untie_and_trains_it_untied() -> None:
    with pytest.raises(ConfigError) as e:
        run_in_process(tied_entry("paci", [3, 3], False))
    assert "model.untie: true" in str(e.value) and f"+{TIED_COST:,} parameters" in str(e.value)
    assert all(torch.isfinite(torch.tensor(train_losses(run_in_process(tied_entry("paci", [3, 3], True))))))


def test_an_untied_model_under_1f1b_equals_its_plain_training() -> None:
    doc = tied_entry("1f1b", [3, 3], True)
    assert_plain(doc, run_in_process(doc))


def test_hf_gpt2_refuses_paci_tied_and_states_the_cost_untied() -> None:
    tiny = {"hf": "tiny-gpt2", "block_size": 16}
    cost = 64 * 64  # the data's 64 tokens x tiny-gpt2's n_embd 64 (paci_tune/base/share/hf/tiny-gpt2.json)
    with pytest.raises(ConfigError) as e:
        run_in_process(hf_doc(tiny, "paci", 2))
    assert e.value.key == "pipeline.schedule" and "model.untie: true" in str(e.value)
    doc = hf_doc({**tiny, "untie": True}, "paci", 2)
    said: list[str] = []
    resolve_run(load_run_config(doc), log=said.append)
    assert said and said[0].startswith(f"untie: +{cost:,} parameters")
    losses = train_losses(run_in_process(doc))
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
