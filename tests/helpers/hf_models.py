"""Tiny Hugging Face models for the ``model: {hf: ...}`` tests: configs, a run doc, and the HF model's own loss.

The oracle is transformers itself: a model HF builds and initialises from a config, saved as
safetensors, is what ``model: {hf: FOLDER}`` must reproduce (its units chained give the model's
logits; a run's first loss is the model's own loss on the same micro-batches).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from helpers.configs import make_config

VOCAB = 64  # the synthetic data's vocabulary in BASE_CONFIG
BLOCK = 16
_NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    **_NO_IDS,
}
ARCHS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **_NO_IDS,
    },
    "llama": _LLAMA,
    "mistral": {**_LLAMA, "sliding_window": 8},  # narrower than the sequence: the sliding mask is exercised
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, "head_dim": 8},
    "gemma": {**_LLAMA, "head_dim": 8},
    "phi3": {**_LLAMA, "num_key_value_heads": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    "olmo2": _LLAMA,
    "gpt_neox": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **_NO_IDS,
    },
    "falcon": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **_NO_IDS,
    },
}
OPT = {
    "hidden_size": 32,
    "ffn_dim": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "word_embed_proj_dim": 32,
    "max_position_embeddings": 64,
    "dropout": 0.0,
    **_NO_IDS,
}
GEMMA2 = {**_LLAMA, "head_dim": 8, "sliding_window": 8}


def hf_model(model_type: str, fields: dict[str, Any], seed: int = 0) -> Any:
    """The model transformers builds and initialises itself from ``fields`` (eval mode, SDPA where it has it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **fields)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def saved(model: Any, folder: Path) -> Path:
    """``model`` written with save_pretrained (safetensors) into ``folder``."""
    model.save_pretrained(str(folder))
    return folder


def hf_doc(model: dict[str, Any], schedule: str = "1f1b", stages: int = 1, steps: int = 3, **training: Any) -> dict:
    """BASE_CONFIG's run (constant LR, a = 4, b = 2) with ``model`` as its model section."""
    doc = make_config(training={"steps": steps, **training}, pipeline={"schedule": schedule, "stages": stages})
    doc["model"] = copy.deepcopy(model)
    return doc


def hf_first_loss(model: Any, doc: dict[str, Any]) -> float:
    """The HF model's own loss (``labels=``, shifted inside transformers) on a run's first step's micro-batches.

    A micro-batch (x, y) has y = x shifted by one; HF shifts the labels itself, so it is fed the sequence
    one token longer, x then y's last token, whose first T positions' logits are the model's on x.
    """
    from paci_tune.data import MicroBatchStream, load_source

    t, p = doc["training"], doc["pipeline"]
    b = t["global_batch"] // p["window"]
    source = load_source(doc["data"], None)
    stream = MicroBatchStream(source.train, doc["model"]["block_size"], b, t["seed"])
    losses = []
    with torch.no_grad():
        for j in range(p["window"]):
            x, y = stream.get(j)
            assert torch.equal(x[:, 1:], y[:, :-1])
            ext = torch.cat([x, y[:, -1:]], dim=1)
            losses.append(model(input_ids=ext, labels=ext).loss.item())
    return sum(losses) / len(losses)
