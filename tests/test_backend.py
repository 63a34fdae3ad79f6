"""Backend choice for the distributed runtime, against the two rules it exists for.

Gloo sends host memory only; NCCL needs a GPU per rank (paci_tune/pipeline/backend.py). The GPU
counts are passed in, so every case runs on a machine without one.
"""

from __future__ import annotations

import pytest
import torch

from paci_tune.errors import ConfigError
from paci_tune.pipeline.backend import choose_backend, shares_gpus, wire_device


@pytest.mark.parametrize(
    ("requested", "device", "ranks", "gpus", "want"),
    [
        ("auto", "cpu", 4, 8, "gloo"),  # cpu asked for, whatever the machine has
        ("auto", "auto", 4, 0, "gloo"),  # no GPU: auto is cpu
        ("auto", "auto", 4, 4, "nccl"),  # a GPU per stage
        ("auto", "cuda", 8, 8, "nccl"),
        ("auto", "cuda", 4, 1, "gloo"),  # stages share one GPU: host-staged gloo, not a failing NCCL
        ("auto", "auto", 2, 1, "gloo"),
        ("gloo", "cuda", 4, 4, "gloo"),  # an explicit choice is kept where it works
        ("nccl", "cuda", 2, 2, "nccl"),
    ],
)
def test_choice(requested: str, device: str, ranks: int, gpus: int, want: str):
    assert choose_backend(requested, device, ranks, gpus) == want


@pytest.mark.parametrize(("device", "ranks", "gpus"), [("cpu", 2, 2), ("auto", 2, 0), ("cuda", 4, 1)])
def test_nccl_where_it_cannot_work_names_the_key(device: str, ranks: int, gpus: int):
    with pytest.raises(ConfigError) as err:
        choose_backend("nccl", device, ranks, gpus)
    assert err.value.key == "pipeline.backend" and err.value.value == "nccl"
    assert "gloo or auto" in err.value.allowed


def test_sharing_is_reported_only_when_stages_outnumber_gpus():
    assert shares_gpus("gloo", "cuda", 4, 1)
    assert not shares_gpus("gloo", "cuda", 4, 4)
    assert not shares_gpus("gloo", "cpu", 4, 0)
    assert not shares_gpus("nccl", "cuda", 4, 4)


def test_gloo_tensors_travel_through_host_memory():
    assert wire_device("gloo", torch.device("cuda", 1)) == torch.device("cpu")
    assert wire_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert wire_device("gloo", torch.device("cpu")) == torch.device("cpu")
