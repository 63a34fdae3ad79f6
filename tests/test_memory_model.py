"""The memory model against measurement (issue 38): each stage's predicted allocated peak within 10% of
what its own process measured, on the distributed runtime (one process per stage).

Oracles: the allocator's count, not the model. On the CPU the distributed runtime measures each stage
process's peak of live tensor storage bytes with its dispatch-mode meter (paci_tune/pipeline/meter.py,
``PACI_TUNE_TRACK_MEMORY=1``), itself checked here against the CPU profiler's allocator events; on CUDA
(tests/test_gpu.py) ``torch.cuda.max_memory_allocated`` of each stage process. The prediction comes
from a profile calibrated for the model in this module (its bytes, including the measured transients),
through :func:`paci_tune.pipeline.planning.predicted_stage_memory`.

The matrix: every schedule of bench/memory_model.py (1f1b, paci under both ``backward_weights``, gpipe,
zb-h1, interleaved with 2 chunks, zb-v, dualpipev); P = 2 and 4; fp32 and bf16 -- not the whole cross
product (32 runs) but a covering of every pair of factors (16, :data:`MATRIX`). All runs of one P go
through one torchrun launch (bench/memory_worker.py), so the module pays torch's start-up twice, not 16 times.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import REPO
from helpers.memory_probe import allocated_cpu

from paci_tune.pipeline.meter import AllocationMeter

pytestmark = pytest.mark.slow

PRECISIONS = ("fp32", "bf16")


def _bench() -> ModuleType:
    """bench/memory_model.py, which launches the runs and reads the prediction (one copy of both)."""
    spec = importlib.util.spec_from_file_location("memory_model_bench", REPO / "bench" / "memory_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCH = _bench()

MATRIX = [
    (stages, precision, variant)
    for i, variant in enumerate(BENCH.VARIANTS)
    for stages, precision in (((2, "fp32"), (4, "bf16")) if i % 2 == 0 else ((2, "bf16"), (4, "fp32")))
]
"""(P, precision, schedule) measured: each schedule at both depths and in both precisions, and each depth in
both precisions (a pairwise covering, half of the 32-run cross product). The prediction is a sum of per-stage
terms in which the schedule sets what is in flight (how many activations, saved tensors, weight copies: the
same count in either precision), the depth sets the cut and the stage's position, and the precision sets the
bytes of each (element size, fp32 masters): an error in any one factor, or in how two of them combine, shows
in a run the matrix holds. The left-out half (e.g. zb-h1 at P = 4 in fp32, beside zb-h1 at P = 4 in bf16 and
at P = 2 in fp32, and gpipe at P = 4 in fp32) adds no term of its own; it doubled the two launches' runs (115 s
of the 1550 s CI run)."""


def test_meter_counts_what_the_cpu_allocator_hands_out() -> None:
    """The meter's peak over a training step (forward, backward, AdamW's first step) equals the peak the
    CPU profiler's allocator events show for the same step: it counts tensor memory, not the process."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(net.parameters(), foreach=False)
    x = torch.randn(32, 64)

    def step() -> None:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _, want = allocated_cpu(step)  # the optimizer's state is made on the first step: a fresh one below
    opt.state.clear()
    with AllocationMeter() as meter:
        step()
    assert meter.peak == pytest.approx(want, rel=0.02)
    assert meter.live > 0  # the state it made is still there, counted until it dies


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model's profile per precision, calibrated here (its bytes: what the prediction reads)."""
    work = tmp_path_factory.mktemp("profiles")
    return {prec: BENCH.profile_for(BENCH.run_doc(2, prec, "1f1b"), work) for prec in PRECISIONS}


class Launches:
    """One torchrun launch per P, every precision and schedule in it, made when a test first asks."""

    def __init__(self, work: Path) -> None:
        self.work, self.done = work, {}

    def summary(self, stages: int, precision: str, variant: str) -> dict[str, Any]:
        if stages not in self.done:
            docs = {f"{p}-{v}": BENCH.run_doc(stages, p, v) for pp, p, v in MATRIX if pp == stages}
            folder = self.work / f"p{stages}"
            folder.mkdir()
            self.done[stages] = BENCH.launch(stages, docs, folder)
        return self.done[stages][f"{precision}-{variant}"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("memory-runs"))


@pytest.mark.parametrize(("stages", "precision", "variant"), MATRIX)
def test_predicted_allocated_peak_within_10_percent_per_stage(
    launches: Launches, profiles: dict[str, Any], tmp_path: Path, stages: int, precision: str, variant: str
) -> None:
    summary = launches.summary(stages, precision, variant)
    assert summary["memory_measured_per"] == "stage"
    assert summary["peak_allocated_measured_with"].startswith("dispatch-mode storage meter")
    measured = BENCH.measured_per_rank(summary)
    assert len(measured) == stages
    doc = BENCH.run_doc(stages, precision, variant)
    predicted = BENCH.predicted_per_rank(doc, profiles[precision], summary["partition"], tmp_path)
    for s, (pred, meas) in enumerate(zip(predicted, measured, strict=True)):
        weights = pred.params + pred.masters + pred.optimizer_state
        assert meas > weights, f"stage {s}: measured {meas} B is less than its weights and optimizer state"
        error = pred.allocated / meas - 1
        assert abs(error) <= BENCH.TOLERANCE, (
            f"P={stages} {precision} {variant} stage {s}: predicted {pred.allocated / 2**20:.2f} MiB "
            f"({pred.to_dict()}) vs measured {meas / 2**20:.2f} MiB: {error:+.1%}"
        )
