"""A module in a stage's compute dtype, leaving alone the buffers that must stay exact.

``module.to(torch.bfloat16)`` converts every floating buffer too: a Llama rotary ``inv_freq`` in bf16
puts cos at position 4095 off by up to 1.89, and a complex rotary table (torchtitan's ``freqs_cis``)
cast to bf16 loses its imaginary part. The rule here: parameters convert (the optimizer keeps fp32
masters, :mod:`.optim`); a buffer converts unless it is complex or non-persistent. Non-persistent
buffers (``register_buffer(..., persistent=False)``) are caches a module derives from its config, not
state a checkpoint holds; the modules that make them (transformers' and torchtitan's rotary
embeddings) compute with them in fp32 and cast the result to the activations' dtype. A persistent
floating buffer (a BatchNorm's running statistics) is state and converts as before. The built-in GPT
has no buffers. May import: torch.
"""

from __future__ import annotations

import torch
from torch import nn


def keeps_fp32(module: nn.Module, name: str, buf: torch.Tensor) -> bool:
    """Whether ``module``'s buffer ``name`` stays as it is in a bf16 stage (module docstring).

    Complex buffers (a rotary table ``freqs_cis``: bf16 would drop its imaginary part) and non-persistent
    ones (``register_buffer(..., persistent=False)``: caches the module derives from its config, such as a
    rotary ``inv_freq``, not state a checkpoint holds; their module reads them at the precision it made
    them in) are never converted.
    """
    return buf.is_complex() or name in module._non_persistent_buffers_set


@torch.no_grad()
def to_compute_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``module`` to ``dtype`` in place, as ``module.to(dtype)`` would, except the buffers :func:`keeps_fp32`.

    Floating parameters are converted in place (``.data``: a parameter shared by units stays one), and
    so are floating buffers under a module's own name for them; the ones a module keeps (and every
    integer or bool tensor) are left alone.
    """
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.is_floating_point() and not keeps_fp32(sub, name, buf):
                sub._buffers[name] = buf.to(dtype)
