"""A transformers causal LM cut into pipeline units: embeddings, one unit per decoder block, the head.

Generic over the architectures that share the usual layout (GPT-2, Llama, Mistral, Qwen2/3, Gemma,
Phi-3, OLMo 2, GPT-NeoX, Falcon, ...): the blocks are the one ``nn.ModuleList`` of the base model whose
elements are the model's ``_no_split_modules`` classes. Unit 0 runs the base model's *own* forward
with that list emptied and its final norm replaced by identity, so each architecture keeps its own
embedding scale, position handling and dropout without this module knowing them. A block unit
rebuilds what the base model hands each layer (positions ``arange(T)``, rotary embeddings from the
model's rotary module, the causal or sliding-window mask from transformers' own mask functions); the
last unit is the final norm and the output embedding. Whatever this misses for an architecture
(a scale applied after the head, a projection after the norm) is caught by :func:`.hf_verify`, which
refuses the model before any run. The units are views: they hold the model's own modules (unit 0 a
shallow copy of the base model whose module table is its own), so the whole model stays intact for
the equality check and for ``paci-tune export``. May import: torch, transformers.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class SplitError(Exception):
    """The model's layout is not the one this split understands: ``what`` says which part is missing."""


class HFEmbed(nn.Module):
    """Unit 0: the base model's forward without blocks or final norm; token ids in, hidden states out."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.model = base

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).last_hidden_state


class HFBlock(nn.Module):
    """One decoder layer, called as its base model calls it; hidden states in, hidden states out.

    ``rotary`` is this unit's own copy of the model's rotary module (buffers only, no parameter), so
    a stage never shares a module with another stage.
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config: Any, sliding: bool) -> None:
        super().__init__()
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.mask_fn: Callable[..., Any] = create_sliding_window_causal_mask if sliding else create_causal_mask
        self.pass_positions = "position_ids" in inspect.signature(layer.forward).parameters

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        kwargs: dict[str, Any] = {}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(h, position_ids=pos)
        if self.pass_positions:
            kwargs["position_ids"] = pos
        mask = self.mask_fn(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
        out = self.layer(h, attention_mask=mask, **kwargs)
        return out[0] if isinstance(out, tuple | list) else out


class HFHead(nn.Module):
    """The last unit: final norm, output embedding, and Gemma 2's final logit soft-cap where configured."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass
class Split:
    """The units and where they came from in the model (``paths[i]``: unit i's modules' qualified names)."""

    units: list[nn.Module]
    names: list[str]
    layers_path: str


def _blocks(base: nn.Module, block_classes: set[str]) -> tuple[str, nn.ModuleList]:
    """The one ModuleList of the base model whose elements are all no-split (block) classes."""
    found = [
        (name, m)
        for name, m in base.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and all(type(x).__name__ in block_classes for x in m)
    ]
    if len(found) != 1:
        where = [n for n, _ in found] or "none"
        raise SplitError(f"one list of decoder blocks ({sorted(block_classes)}) in the base model (found {where})")
    return found[0]


def _hollow(base: nn.Module, layers_path: str, norm_name: str | None) -> nn.Module:
    """A shallow copy of ``base`` with the block list emptied and the final norm an identity.

    Every module on the way from ``base`` to the list's parent is copied with its own module table, so
    the original model keeps its blocks and norm; parameters and the other submodules are shared.
    """
    parts = layers_path.split(".")
    top = copy.copy(base)
    top._modules = dict(base._modules)
    node = top
    for part in parts[:-1]:
        child = copy.copy(node._modules[part])
        child._modules = dict(child._modules)
        node._modules[part] = child
        node = child
    node._modules[parts[-1]] = nn.ModuleList()
    if norm_name is not None:
        node._modules[norm_name] = nn.Identity()
    return top


def _sliding(config: Any, i: int) -> bool:
    """Whether layer ``i`` attends within a sliding window, as its base model decides."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[i] == "sliding_attention"
    return (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True) is not False
    )


def split_model(model: nn.Module) -> Split:
    """Cut a ``*ForCausalLM`` into units (module docstring); :class:`SplitError` where its layout is unusual."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise SplitError("a causal LM wrapping a base model (base_model_prefix)")
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    if not block_classes:
        raise SplitError("the model's _no_split_modules naming its decoder block class")
    layers_path, layers = _blocks(base, block_classes)
    parent_path = layers_path.rpartition(".")[0]
    body = base.get_submodule(parent_path) if parent_path else base
    norms = [n for n, m in body.named_children() if m is not None and "Norm" in type(m).__name__]
    if len(norms) > 1:
        raise SplitError(f"one final norm beside the blocks (found {norms})")
    rotaries = [m for m in body.children() if "Rotary" in type(m).__name__]
    if len(rotaries) > 1:
        raise SplitError(f"one rotary embedding module (found {len(rotaries)})")
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise SplitError("an output embedding (lm_head)")
    norm_name = norms[0] if norms else None
    config = model.config
    rotary = rotaries[0] if rotaries else None
    units: list[nn.Module] = [HFEmbed(_hollow(base, layers_path, norm_name))]
    for i, layer in enumerate(layers):
        units.append(HFBlock(layer, copy.deepcopy(rotary) if rotary is not None else None, config, _sliding(config, i)))
    norm = body.get_submodule(norm_name) if norm_name else nn.Identity()
    units.append(HFHead(norm, lm_head, getattr(config, "final_logit_softcapping", None)))
    names = ["embed", *(f"layer{i}" for i in range(len(layers))), "head"]
    return Split(units, names, f"{model.base_model_prefix}.{layers_path}")
