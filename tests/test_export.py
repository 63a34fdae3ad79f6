"""``paci-tune export RUN_OR_CHECKPOINT OUT``: a trained hf run as a Hugging Face model folder.

Oracle: transformers' own ``AutoModelForCausalLM.from_pretrained(OUT)``, whose logits must equal the
trained stages' units chained (their values read back from the checkpoint's stage files, weights-only),
to 1e-5 -- tied, and untied (saved with ``tie_word_embeddings: false``, so loading does not tie the
trained copies again). A preset's checkpoint is refused with exit 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import invoke_in, run_in_process
from helpers.configs import make_config

pytest.importorskip("transformers")

from helpers.hf_models import BLOCK, VOCAB, hf_doc

from paci_tune.model import load_model
from paci_tune.model.hf_verify import chain
from paci_tune.train.checkpoint import find, units_of


def _trained(tmp_path: Path, model: dict, stages: int = 2) -> Path:
    ckpt = tmp_path / "ckpt"
    doc = hf_doc(model, "1f1b", stages, steps=2, checkpoint_every=2, checkpoint_dir=str(ckpt))
    run_in_process(doc)
    return ckpt


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_export_round_trips_through_from_pretrained(tmp_path: Path, untie: bool) -> None:
    from transformers import AutoModelForCausalLM

    spec = {"hf": "tiny-gpt2", "block_size": BLOCK, "untie": untie}
    ckpt = _trained(tmp_path, spec)
    result = invoke_in(tmp_path, ["export", str(ckpt), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    loaded = load_model(spec, VOCAB, 0)
    _, entries = units_of(find(ckpt))
    with torch.no_grad():
        for i, unit in loaded.units.items():
            for name, p in unit.named_parameters():
                p.copy_(entries[(i, name)]["value"])
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert reloaded.config.tie_word_embeddings is not untie
    x = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = chain([loaded.units[i] for i in range(loaded.n_units)], x)
        got = reloaded(input_ids=x).logits
    assert (got - want).abs().max().item() <= 1e-5
    if untie:  # the copies trained apart: the export kept both
        emb, head = reloaded.get_input_embeddings().weight, reloaded.get_output_embeddings().weight
        assert not torch.equal(emb, head)


def test_export_refuses_a_preset_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_in_process(make_config(training={"steps": 2, "checkpoint_every": 2, "checkpoint_dir": str(ckpt)}))
    result = invoke_in(tmp_path, ["export", str(ckpt), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "RUN_OR_CHECKPOINT" in result.output and "Hugging Face models only" in result.output
