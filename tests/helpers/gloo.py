"""A one-process gloo group for tests that build a torch ``PipelineStage`` in the test process."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank() -> Iterator[None]:
    """A one-process gloo group: enough for a one-stage PipelineStage under either schedule."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
