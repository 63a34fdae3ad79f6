"""SchedulePACI, the drop-in for torch.distributed.pipelining, checked against torch and paci-tune.

Each multi-rank check launches ``examples/torch_pipelining.py`` under torchrun (so the example is
tested too) and reads the per-rank JSON it writes. The asynchronous losses are compared with
paci-tune's own trainer on the same config and the same ``backward_weights``, run in process with
the emulated runtime (which ``test_runtimes`` checks against ``paci-tune train --runtime
distributed``, and ``test_numerics`` against an independent simulation of PACI in both modes), to
save a launch.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import run_in_process, train_losses
from helpers.configs import make_config
from torch import nn
from torch.distributed.pipelining import PipelineStage

from paci_tune.pipelining import SchedulePACI
from paci_tune.schedule import actions as schedules
from paci_tune.schedule import copies_bound

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torch_pipelining.py"
SPEC = {"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32}

pytestmark = pytest.mark.slow


def _launch(out: Path, nproc: int, *args: str) -> list[dict]:
    """Run the example on ``nproc`` ranks; return each rank's JSON record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(EXAMPLE), "--json", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _paci_tune_losses(
    stages: int,
    window: int,
    microbatches: int,
    steps: int,
    *,
    backward_weights: str,
    mb_size: int = 4,
    precision: str = "fp32",
    optimizer: str = "adamw",
) -> list[float]:
    """Per-window mean losses (one per optimizer step) of the same run under paci-tune's own trainer.

    Emulated runtime, in process. Model, data, partition, optimizer and constant LR are those of the
    example; ``test_runtimes`` shows the distributed runtime (``paci-tune train --runtime
    distributed``) gives the same numbers.
    """
    bounds = [round(i * 4 / stages) for i in range(stages + 1)]  # the example's split of the 4 units
    doc = make_config(
        model=SPEC,
        data={"source": "synthetic", "vocab_size": 256, "n_train": 200_000, "n_val": 1_000},
        training={"global_batch": window * mb_size, "steps": steps * microbatches // window, "eval_sequences": 2},
        optimizer={"name": optimizer},
        pipeline={
            "schedule": "paci",
            "stages": stages,
            "window": window,
            "partition": [b - a for a, b in itertools.pairwise(bounds)],
            "runtime": "emulated",
            "device": "cpu",
            "precision": precision,
            "backward_weights": backward_weights,
        },
    )
    return train_losses(run_in_process(doc))


def _window_means(mb_losses: list[float], window: int) -> list[float]:
    """The example's per-micro-batch losses, averaged per window as the trainer records them."""
    return [sum(mb_losses[i : i + window]) / window for i in range(0, len(mb_losses), window)]


@pytest.mark.parametrize("stages", [2, 3])
def test_flush_mode_matches_torch_schedule_1f1b(tmp_path: Path, stages: int) -> None:
    """SchedulePACI(flush=True) == torch's Schedule1F1B + optimizer.step() per step (both example modes run)."""
    ref = _launch(tmp_path / "1f1b", stages, "--schedule", "1f1b", "--steps", "4")
    got = _launch(tmp_path / "flush", stages, "--schedule", "paci", "--flush", "--steps", "4")
    assert len(ref[-1]["losses"]) == 4
    assert got[-1]["losses"] == pytest.approx(ref[-1]["losses"], abs=1e-5)
    assert all(rec["max_drift"] == 0 and rec["ptrs_unchanged"] for rec in got)


@pytest.mark.parametrize(
    ("stages", "window", "microbatches", "backward_weights"), [(2, 2, 4, "current"), (3, 1, 3, "forward")]
)
def test_async_matches_paci_tune_and_drift_bound(
    tmp_path: Path, stages: int, window: int, microbatches: int, backward_weights: str
) -> None:
    """Async losses equal paci-tune's own PACI with the same ``backward_weights`` (and not with the
    other: late backwards happen here); drift reaches exactly ceil((P-s-1)/a); parameters never move.

    ``current`` reads the weights as they are (no copy); ``forward`` reads its forward's, holding
    exactly :func:`copies_bound` weight copies at the peak."""
    steps = 4
    args = ["--schedule", "paci", "--steps", str(steps), "--window", str(window), "--microbatches", str(microbatches)]
    ranks = _launch(tmp_path, stages, *args, "--backward-weights", backward_weights)
    got = _window_means(ranks[-1]["mb_losses"], window)
    other = "current" if backward_weights == "forward" else "forward"
    expected = _paci_tune_losses(stages, window, microbatches, steps, backward_weights=backward_weights)
    assert len(got) == steps * microbatches // window
    assert got == pytest.approx(expected, abs=1e-5)
    assert got != pytest.approx(
        _paci_tune_losses(stages, window, microbatches, steps, backward_weights=other), abs=1e-5
    )
    for s, rec in enumerate(ranks):
        assert rec["max_drift"] == math.ceil((stages - s - 1) / window) == schedules.drift_bound(s, stages, window)
        assert rec["updates"] == steps * microbatches // window
        assert rec["ptrs_unchanged"]
        copies = copies_bound("paci", s, stages, window) if backward_weights == "forward" else 0
        assert rec["weight_copies_peak"] == copies


def test_bf16_async_matches_paci_tune_bf16(tmp_path: Path) -> None:
    """bf16 modules: SchedulePACI keeps fp32 masters as paci-tune's stages do, so the losses agree.

    Tolerance 1e-5, as in fp32: the same operations on the same bf16 tensors in both, on one thread
    as the example's ranks run (with two, CPU bf16 kernels split their sums differently, and the
    losses move by ~2e-5 after one step)."""
    args = ["--schedule", "paci", "--steps", "4", "--window", "2", "--microbatches", "4", "--bf16"]
    ranks = _launch(tmp_path, 2, *args, "--backward-weights", "forward")
    got = _window_means(ranks[-1]["mb_losses"], 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = _paci_tune_losses(2, 2, 4, 4, backward_weights="forward", precision="bf16")
    finally:
        torch.set_num_threads(threads)
    assert got == pytest.approx(expected, abs=1e-5)
    assert got != pytest.approx(_paci_tune_losses(2, 2, 4, 4, backward_weights="forward"), abs=1e-5), "bf16 did not run"
    assert all(rec["ptrs_unchanged"] and rec["max_drift"] == 1 - s for s, rec in enumerate(ranks))
    assert [rec["weight_copies_peak"] for rec in ranks] == [1, 0]  # one bf16 copy, at stage 0


def test_a_users_own_muon_and_adamw_pair(tmp_path: Path) -> None:
    """A list of optimizers (Muon on the hidden matrices, AdamW on the rest) is stepped as one: flush with
    torch's own Muon equals torch's Schedule1F1B stepping the same pair, and PACI with paci-tune's Muon
    (fp32 Newton-Schulz on the CPU) equals paci-tune's own ``optimizer.name: muon``."""
    ref = _launch(tmp_path / "1f1b", 2, "--schedule", "1f1b", "--steps", "4", "--muon", "torch")
    flush = _launch(tmp_path / "flush", 2, "--schedule", "paci", "--flush", "--steps", "4", "--muon", "torch")
    assert flush[-1]["losses"] == pytest.approx(ref[-1]["losses"], abs=1e-5)
    args = ["--schedule", "paci", "--steps", "4", "--window", "2", "--microbatches", "4", "--muon", "paci"]
    got = _window_means(_launch(tmp_path / "paci", 2, *args)[-1]["mb_losses"], 2)
    expected = _paci_tune_losses(2, 2, 4, 4, backward_weights="forward", optimizer="muon")
    assert got == pytest.approx(expected, abs=1e-5)
    assert got != pytest.approx(_paci_tune_losses(2, 2, 4, 4, backward_weights="forward"), abs=1e-5), "AdamW's"


def test_misuse_raises_clear_errors(single_rank: None) -> None:
    def make(**kw: object) -> SchedulePACI:
        mod = nn.Linear(4, 4)
        stage = PipelineStage(mod, 0, 1, torch.device("cpu"))
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        args = {"window": 2, "optimizer": opt} | kw
        return SchedulePACI(stage, args.pop("n", 4), nn.functional.mse_loss, **args)

    with pytest.raises(ValueError, match="multiple of window"):
        make(n=3)
    with pytest.raises(ValueError, match="PipelineStage"):
        SchedulePACI(
            [object()], 4, nn.functional.mse_loss, window=2, optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))])
        )  # type: ignore[arg-type]
    sched = make()
    scheduler = torch.optim.lr_scheduler.LambdaLR(sched.optimizer, lambda k: 1.0)
    sched.lr_scheduler = scheduler
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match="target="):
        sched.step(x)
    with sched:
        sched.step(x, target=x)
    assert sched.updates == 2 == scheduler.last_epoch
    with pytest.raises(RuntimeError, match="restart"):
        sched.step(x, target=x)
    sched.restart()
    sched.step(x, target=x)
    sched.drain()
    assert sched.updates == 4

    with pytest.raises(ValueError, match="backward_weights"):
        make(backward_weights="stale")
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="PipelineStage's device"):
        SchedulePACI(
            PipelineStage(meta, 0, 1, torch.device("cpu")),
            4,
            nn.functional.mse_loss,
            window=2,
            optimizer=torch.optim.SGD(meta.parameters(), lr=0.1),
        )

    class Pair(nn.Linear):  # two inputs at stage 0 (further step() arguments); a tuple out
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return super().forward(x + y), y

    pair = Pair(4, 4)
    sched = SchedulePACI(
        PipelineStage(pair, 0, 1, torch.device("cpu")),
        4,
        lambda out, y: nn.functional.mse_loss(out[0], y),
        window=2,
        optimizer=torch.optim.SGD(pair.parameters(), lr=0.1),
    )
    with pytest.raises(RuntimeError, match="stage 0 returned tuple; SchedulePACI needs one tensor"):
        sched.step(x, x, target=x)


def test_bf16_state_dict_keeps_the_fp32_masters(single_rank: None) -> None:
    """A bf16 stage's optimizer steps fp32 masters; state_dict() carries them, so a resumed schedule
    continues bit for bit where ``optimizer.state_dict()`` alone would restart from rounded weights."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), y)

    def make(seed: int) -> tuple[nn.Module, SchedulePACI]:
        torch.manual_seed(seed)
        mod = nn.Linear(4, 4).to(torch.bfloat16)
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
        return mod, SchedulePACI(PipelineStage(mod, 0, 1, torch.device("cpu")), 4, loss, window=2, optimizer=opt)

    def train(sched: SchedulePACI, batches: list) -> None:
        with sched:
            for x, y in batches:
                sched.step(x.to(torch.bfloat16), target=y)

    mod_a, a = make(0)
    params = list(mod_a.parameters())
    train(a, data[:2])
    assert [p.dtype for p in a.optimizer.param_groups[0]["params"]] == [torch.float32] * 2
    saved_module, saved = copy.deepcopy(mod_a.state_dict()), copy.deepcopy(a.state_dict())
    # The user's module is as it was: its own keys, its parameters, in bf16, where they were.
    assert list(saved_module) == ["weight", "bias"] and list(mod_a.parameters()) == params
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params)
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in saved["masters"])
    mod_b, b = make(1)
    mod_b.load_state_dict(saved_module)
    b.load_state_dict(saved)
    train(a, data[2:])
    train(b, data[2:])
    assert all(torch.equal(p, q) for p, q in zip(mod_a.parameters(), mod_b.parameters(), strict=True))
    assert b.updates == a.updates == 8
