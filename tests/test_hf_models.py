"""``model: {hf: ...}``: transformers causal LMs cut into pipeline units, checked against transformers itself.

Oracle: the model transformers builds and initialises from a tiny config (tests/helpers/hf_models.py),
saved as safetensors and handed to the tool as a folder. Its units chained must give the model's own
logits (1e-5, fp32, SDPA); a run's first loss must be the model's own ``labels=`` loss on the same
micro-batches; and a P = 2 1F1B run must train exactly what P = 1 trains. OPT and Gemma 2 (eager
attention, a final logit soft-cap) are handled; a split that does not equal its model, a non-causal
chain, and bad specs are refused as ``model.hf`` before any run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from helpers.cli import run_in_process, train_losses
from helpers.hf_models import ARCHS, BLOCK, GEMMA2, OPT, VOCAB, hf_doc, hf_first_loss, hf_model, saved

from paci_tune.errors import ConfigError
from paci_tune.model import load_model
from paci_tune.model.hf_verify import chain

QUICK = ("gpt2", "llama")  # the quick tier's; every architecture runs in the slow tier


def _arch_params() -> list:
    return [pytest.param(a, marks=() if a in QUICK else pytest.mark.slow) for a in ARCHS]


def _units(spec: dict, indices: list[int] | None = None) -> list[torch.nn.Module]:
    loaded = load_model(spec, VOCAB, 0, indices)
    return [loaded.units[i] for i in sorted(loaded.units)]


def _equal_to_model(model_type: str, fields: dict, tmp_path: Path) -> None:
    model = hf_model(model_type, fields)
    spec = {"hf": str(saved(model, tmp_path / "hf")), "block_size": BLOCK}
    load_model(spec, VOCAB, 0, indices=[]).verify()  # the tool's own check passes
    x = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=x).logits
        got = chain(_units(spec), x)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", _arch_params())
def test_split_equals_model_and_trains_its_loss(arch: str, tmp_path: Path) -> None:
    model = hf_model(arch, ARCHS[arch])
    spec = {"hf": str(saved(model, tmp_path / "hf")), "block_size": BLOCK}
    x = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (chain(_units(spec), x) - model(input_ids=x).logits).abs().max().item() <= 1e-5
    one = train_losses(run_in_process(hf_doc(spec, "1f1b", 1)))
    two = train_losses(run_in_process(hf_doc(spec, "1f1b", 2)))
    assert two == pytest.approx(one, abs=1e-5, rel=0)
    assert one[0] == pytest.approx(hf_first_loss(model, hf_doc(spec)), abs=1e-5, rel=0)


@pytest.mark.parametrize(("model_type", "fields"), [("opt", OPT), ("gemma2", GEMMA2)], ids=["opt", "gemma2"])
def test_opt_and_gemma2_are_handled(model_type: str, fields: dict, tmp_path: Path) -> None:
    _equal_to_model(model_type, fields, tmp_path)


def test_an_opt_projection_after_the_norm_is_refused() -> None:
    spec = {"hf": {"model_type": "opt", **OPT, "word_embed_proj_dim": 16}, "block_size": BLOCK}
    with pytest.raises(ConfigError) as e:
        load_model(spec, VOCAB, 0, indices=[]).verify()
    assert e.value.key == "model.hf" and "OPTForCausalLM" in str(e.value)


def test_a_broken_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from paci_tune.model import hf_split

    real = hf_split.HFHead.forward
    monkeypatch.setattr(hf_split.HFHead, "forward", lambda self, h: real(self, h) + 1e-3)
    with pytest.raises(ConfigError) as e:
        load_model({"hf": "tiny-llama", "block_size": BLOCK}, VOCAB, 0, indices=[]).verify()
    assert e.value.key == "model.hf" and "LlamaForCausalLM" in str(e.value) and "differ" in str(e.value)


def test_a_split_that_sees_the_future_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A block unit that reads the next position (what eager attention without a mask does) is refused
    before any run, as model.hf, by the causality probe every model's units pass."""
    from paci_tune.config import load_config
    from paci_tune.model import hf_split
    from paci_tune.pipeline.checks import check_model_and_data

    real = hf_split.HFBlock.forward
    monkeypatch.setattr(hf_split.HFBlock, "forward", lambda self, h: real(self, h + 0.5 * h.roll(-1, dims=1)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(hf_doc({"hf": "tiny-llama", "block_size": BLOCK})))
    with pytest.raises(ConfigError) as e:
        check_model_and_data(load_config(str(config)))
    assert e.value.key == "model.hf" and "causal" in str(e.value), e.value


def test_a_rank_builds_only_its_units_and_a_tied_weight_starts_equal() -> None:
    spec = {"hf": "tiny-gpt2", "block_size": BLOCK}
    whole = load_model(spec, VOCAB, 7)
    last = whole.n_units - 1
    mine = load_model(spec, VOCAB, 7, indices=[last])
    assert sorted(mine.units) == [last]
    assert whole.units[last].lm_head.weight is whole.units[0].model.wte.weight  # one parameter in one process
    for a, b in zip(whole.units[last].parameters(), mine.units[last].parameters(), strict=True):
        assert torch.equal(a, b)  # the head's copy of the embedding is the embedding unit 0 builds
    middle = load_model(spec, VOCAB, 7, indices=[1])
    assert all(not p.is_meta for p in middle.units[1].parameters())
    assert torch.equal(next(middle.units[1].parameters()), next(whole.units[1].parameters()))


def test_shipped_configs_take_the_datas_vocabulary() -> None:
    for name in ("tiny-gpt2", "tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma"):
        loaded = load_model({"hf": name, "block_size": 8}, 50, 0, indices=[0])
        assert loaded.n_units == 4 and loaded.block_size == 8
    for name in ("tiny-phi3", "tiny-olmo2", "tiny-gpt-neox", "tiny-falcon"):
        assert load_model({"hf": name}, 50, 0, indices=[]).block_size == 128  # the config's longest


@pytest.mark.parametrize(
    ("spec", "key", "words"),
    [
        ({"hf": "no-such-model"}, "model.hf", "tiny-gpt2"),
        ({"hf": {"n_layer": 2}}, "model.hf", "model_type"),
        ({"hf": {"model_type": "no-such-type"}}, "model.hf", "transformers refused"),
        ({"hf": {"model_type": "llama", "vocab_size": 10}}, "model.hf vocab_size", "at least the data's vocabulary"),
        ({"hf": "tiny-llama", "untie": "yes"}, "model.untie", "true or false"),
        ({"hf": "tiny-llama", "block_size": 4096}, "model.block_size", "max_position_embeddings"),
        ({"hf": "tiny-llama", "n_layer": 2}, "model.n_layer", "hf"),
    ],
)
def test_bad_specs_are_refused(spec: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_model(spec, VOCAB, 0, indices=[])
    assert e.value.key == key and words in str(e.value)


def test_a_folder_with_pickled_weights_only_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **ARCHS["llama"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match=r"pickled \.bin weights are never loaded"):
        load_model({"hf": str(tmp_path)}, VOCAB, 0, indices=[])
