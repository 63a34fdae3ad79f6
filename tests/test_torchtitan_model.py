"""``model: {torchtitan: llama3}``: torchtitan 0.3.0's Llama as pipeline units (paci_tune/model/titan.py).

Without torchtitan installed only the refusal runs (an exit-2 line naming ``model.torchtitan``); the
rest needs ``pip install torchtitan==0.3.0 triton`` (the ``torchtitan`` extra) and runs in process.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.cli import run_in_process, train_losses
from helpers.configs import make_config

from paci_tune.errors import ConfigError
from paci_tune.model import load_model

SPEC = {"torchtitan": "llama3", "flavor": "debugmodel", "block_size": 16, "n_layers": 2}


def test_without_torchtitan_the_model_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from paci_tune.model import titan

    monkeypatch.setattr(titan.metadata, "version", lambda name: titan.VERSION)
    monkeypatch.setitem(sys.modules, "torchtitan.models.llama3", None)  # an import that fails, as without triton
    with pytest.raises(ConfigError) as err:
        load_model(SPEC, 64, 0, indices=[])
    assert err.value.key == "model.torchtitan" and "pip install torchtitan==0.3.0" in err.value.allowed


def _titan() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional extra")
    try:
        import torchtitan.models.llama3  # noqa: F401  (needs triton too)
    except ImportError as exc:
        pytest.skip(f"torchtitan does not import here: {exc}")


@pytest.mark.slow  # importing torchtitan takes seconds; building and training its layers more
def test_units_chained_equal_torchtitans_model_and_do_not_depend_on_the_cut() -> None:
    _titan()
    from paci_tune.model.titan import titan_config, whole_model

    whole = load_model(SPEC, 64, 0)
    assert whole.n_units == 4 and whole.names == ["embed", "layer0", "layer1", "head"]
    whole.verify()  # the loader's own check: chained units == Llama3Model's forward to 1e-5
    units = [whole.units[i] for i in range(4)]
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = x
        for unit in units:
            h = unit(h)
        want = whole_model(titan_config(SPEC, 64), units)(x)
    assert h.shape == (2, 16, 64) and torch.equal(h, want)
    assert units[1].layers["0"].attention.rope.cache.shape == (16, 8)  # freqs_cis for block_size positions
    alone = load_model(SPEC, 64, 0, indices=[2])  # a rank building one unit gets the same weights
    assert list(alone.units) == [2]
    assert all(torch.equal(a, b) for a, b in zip(alone.units[2].parameters(), units[2].parameters(), strict=True))
    units[1].to(torch.bfloat16)  # a cast keeps the rotary table complex
    assert units[1].layers["0"].attention.rope.cache.dtype == torch.complex64


def test_refusals_name_the_key() -> None:
    _titan()
    for bad, key in [
        ({"flavor": "1B"}, "model.flavor"),  # tied embedding: torchtitan refuses it under PP too
        ({"flavor": "tiny"}, "model.flavor"),
        ({"n_layers": 7}, "model.n_layers"),
        ({"vocab_size": 10}, "model.vocab_size"),
        ({"torchtitan": "llama4"}, "model.torchtitan"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_model({**SPEC, **bad}, 64, 0, indices=[])
        assert err.value.key == key


@pytest.mark.slow  # importing torchtitan takes seconds; building and training its layers more
def test_two_stage_1f1b_equals_one_stage() -> None:
    """The cut changes nothing in a flush schedule: P=2 1F1B's losses are P=1's (the emulated runtime)."""
    _titan()
    losses = {}
    for stages in (1, 2):
        doc = make_config(training={"steps": 2}, pipeline={"schedule": "1f1b", "stages": stages})
        doc["model"] = dict(SPEC)
        losses[stages] = train_losses(run_in_process(doc))
    assert losses[2] == pytest.approx(losses[1], abs=1e-5)
    assert 3.0 < losses[1][0] < 6.0 and losses[1][-1] < losses[1][0]  # near ln 64 at the start, falling
