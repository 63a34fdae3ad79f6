"""SchedulePACI takes torchtitan 0.3.0's ``step()`` call: pre-split micro-batches, per-micro-batch module
kwargs and loss kwargs; torch's own ``Schedule1F1B`` on the same micro-batches is the oracle.

torchtitan's trainer calls ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
return_outputs=False)``. torch 2.13's public ``step()`` has no such keywords (they reach the module as
model kwargs), so the oracle runs torch's pre-split entry point, ``_step_microbatches``, where the
public one does not take them. One process, one stage: in-process and fast (no launch).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from paci_tune.pipelining import SchedulePACI

N = 4  # micro-batches per step()


class Scaled(nn.Module):
    """A stage whose forward takes a keyword per micro-batch, as torchtitan's take ``positions``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x) * (1.0 if scale is None else scale)


def loss_fn(out: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    return nn.functional.mse_loss(out, y) * (1.0 if weight is None else weight)


def _batches(steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(steps):
        out.append(
            {
                "arg_mbs": [(torch.randn(2, 4, generator=gen),) for _ in range(N)],
                "kwarg_mbs": [{"scale": torch.tensor(1.0 + 0.1 * i)} for i in range(N)],
                "target_mbs": [torch.randn(2, 4, generator=gen) for _ in range(N)],
                "loss_kwargs": {"weight": torch.tensor(1.0 + k)},
            }
        )
    return out


def _torch_presplit(schedule: Schedule1F1B, losses: list, **call: object) -> None:
    """torch's schedule on pre-split micro-batches: its public step() where it takes them, else its entry point."""
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        schedule.step(**call, losses=losses, return_outputs=False)
    else:  # what step() does before it splits: the stage's backward flag, its per-step state cleared
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(**call, losses=losses, return_outputs=False)


def test_torchtitans_call_in_flush_mode_equals_torch_1f1b(single_rank: None) -> None:
    batches = _batches(3)
    torch.manual_seed(0)
    ref = Scaled()
    mine = Scaled()
    mine.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    oracle = Schedule1F1B(PipelineStage(ref, 0, 1, torch.device("cpu")), n_microbatches=N, loss_fn=loss_fn)
    sched = SchedulePACI(
        PipelineStage(mine, 0, 1, torch.device("cpu")),
        N,
        loss_fn,
        window=N,
        optimizer=torch.optim.AdamW(mine.parameters(), lr=1e-2),
        flush=True,
    )
    for batch in batches:
        want: list[torch.Tensor] = []  # torch's schedule refills the list at each step()
        ref_opt.zero_grad()
        _torch_presplit(oracle, want, **batch)
        ref_opt.step()
        got: list[torch.Tensor] = []
        sched.step(**batch, losses=got, return_outputs=False)  # torchtitan 0.3.0's trainer, word for word
        assert len(got) == len(want) == N
        assert torch.allclose(torch.stack(got), torch.stack([w.detach() for w in want]), atol=1e-6)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(mine.parameters(), ref.parameters(), strict=True))


def test_pre_split_and_whole_batches_train_alike_under_paci(single_rank: None) -> None:
    """Under PACI proper (window < n_microbatches): arg_mbs/target_mbs are the whole batch's chunks."""
    batches = _batches(3)
    results = []
    for presplit in (True, False):
        torch.manual_seed(0)
        mod = nn.Linear(4, 4)
        sched = SchedulePACI(
            PipelineStage(mod, 0, 1, torch.device("cpu")),
            N,
            nn.functional.mse_loss,
            window=2,
            optimizer=torch.optim.SGD(mod.parameters(), lr=0.1),
        )
        losses: list[torch.Tensor] = []
        with sched:
            for b in batches:
                if presplit:
                    sched.step(arg_mbs=b["arg_mbs"], target_mbs=b["target_mbs"], losses=losses)
                else:
                    x, y = torch.cat([a[0] for a in b["arg_mbs"]]), torch.cat(b["target_mbs"])
                    sched.step(x, target=y, losses=losses)
        results.append((torch.stack(losses), [p.detach().clone() for p in mod.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(p, q) for p, q in zip(results[0][1], results[1][1], strict=True))


def test_what_the_drop_in_does_not_take(single_rank: None) -> None:
    mod = nn.Linear(4, 4)
    stage = PipelineStage(mod, 0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="no multi-stage schedule such as Interleaved1F1B"):
        SchedulePACI([stage, stage], N, loss_fn, window=2, optimizer=torch.optim.SGD(mod.parameters()))  # type: ignore[arg-type]
    sched = SchedulePACI(stage, N, loss_fn, window=2, optimizer=torch.optim.SGD(mod.parameters(), lr=0.1))
    b = _batches(1)[0]
    with pytest.raises(ValueError, match="return_outputs=False"):
        sched.step(arg_mbs=b["arg_mbs"], target_mbs=b["target_mbs"], return_outputs=True)
    with pytest.raises(ValueError, match="not both"):
        sched.step(torch.randn(8, 4), arg_mbs=b["arg_mbs"], target_mbs=b["target_mbs"])
    with pytest.raises(ValueError, match="Expecting 4 arg_mbs but got 3"):
        sched.step(arg_mbs=b["arg_mbs"][:3], target_mbs=b["target_mbs"])
