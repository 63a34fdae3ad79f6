"""The language-model loss every last pipeline unit's logits are scored with.

One definition, so training, evaluation and calibration compute the same thing: mean token
cross-entropy, in fp32 even when the forward ran in bf16 (the softmax over a large
vocabulary loses too much in bf16). May import: torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (..., vocab) against token ids ``targets`` (...)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
