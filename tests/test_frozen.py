"""Models as users write them: frozen parameters, parameter-free units, what a unit may return.

Oracle: plain training in one process (tests/helpers/oracles.py ``plain_training``; in bf16
tests/helpers/bf16.py ``plain_bf16_training``), the units chained, torch's AdamW over every parameter:
a frozen one gets no gradient, so torch skips it, which is what ``requires_grad=False`` means in
plain PyTorch. Under a flush schedule the pipeline must equal it within 1e-5 whatever has nothing to
train; under PACI, where only the last stage trains (no stage that trains ever crosses an update),
too. The models are docs/guide.md's own code (tests/helpers/guide_models.py, checked verbatim here).
Tied weights are tests/test_tied.py's.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO
from helpers.bf16 import plain_bf16_training
from helpers.cli import check_ok, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import write_config
from helpers.guide_models import SMALL
from helpers.guide_runs import assert_plain, doc_for, guide_env, model, run_distributed
from helpers.searches import guide_model_search, quick_search, run, search_cmd
from torch import nn

from paci_tune.config import OptimizerConfig
from paci_tune.errors import ConfigError
from paci_tune.model import load_model
from paci_tune.pipeline.stage import Stage
from paci_tune.sim.memory import stage_memory
from paci_tune.sim.profile import Profile
from paci_tune.sim.simulator import simulate

PREFIX = (0, 1, 2)  # embedding and the first two blocks: a frozen backbone under trainable blocks and head


def trains(records: list[dict[str, Any]]) -> list[bool]:
    return [st["trains"] for st in summary_of(records)["stages"]]


def assert_nothing_to_drift(records: list[dict[str, Any]]) -> None:
    """A stage with nothing to train took no step, crossed no update, and its record says so."""
    for st in summary_of(records)["stages"]:
        if not st["trains"]:
            assert st["updates"] == 0 and st["max_drift"] == 0 and st["drift_bound"] == 0
            assert st["drift_histogram"] == {} and st["weight_copies_made"] == 0


# ------------------------------------------------------------------ flush schedules equal plain training

FLUSH_CASES = [
    # schedule, cut, frozen units, which stages train
    ("1f1b", [3, 3], PREFIX, [False, True]),
    ("gpipe", [3, 3], PREFIX, [False, True]),
    ("1f1b", [1, 1, 2, 2], PREFIX, [False, False, True, True]),
    ("gpipe", [1, 1, 2, 2], PREFIX, [False, False, True, True]),
    ("1f1b", [1, 2, 1, 2], (1, 2), [True, False, True, True]),  # a frozen middle passes gradients on
    ("gpipe", [3, 1, 1, 1], (3, 4, 5), [True, False, False, False]),  # only the first stage trains
]


@pytest.mark.parametrize(("schedule", "cut", "frozen", "stages_train"), FLUSH_CASES, ids=lambda v: str(v))
def test_flush_with_frozen_units_equals_plain_training(schedule, cut, frozen, stages_train):
    doc = doc_for(schedule, cut, frozen=list(frozen))
    records = run_in_process(doc)
    assert_plain(doc, records)
    assert trains(records) == stages_train
    assert_nothing_to_drift(records)


def test_a_parameter_free_unit_is_a_stage_with_nothing_to_train():
    """build_with_gelu: a Gelu unit (no parameters) alone on stage 1; 1F1B with a global-norm clip."""
    doc = doc_for("1f1b", [2, 1, 2, 2], entry="build_with_gelu")
    doc["optimizer"]["grad_clip"] = 0.5  # the whole model's norm: the empty stage adds 0 to it
    records = run_in_process(doc)
    assert_plain(doc, records)
    assert trains(records) == [True, False, True, True]


@pytest.mark.parametrize(("schedule", "cut"), [("1f1b", [3, 3]), ("gpipe", [1, 1, 1, 3])])
def test_two_replicas_with_a_stage_that_trains_nothing_equal_plain_training(schedule: str, cut: list[int]):
    """D = 2: the replicas of a stage with nothing to train average nothing (no all-reduce is made)."""
    doc = doc_for(schedule, cut, frozen=list(PREFIX), data_parallel=2, window=2)
    records = run_in_process(doc)
    single = copy.deepcopy(doc)
    single["pipeline"].update(window=4, data_parallel=1)  # the same sequences in one process
    assert_plain(single, records)
    assert trains(records) == [False] * (len(cut) - 1) + [True]


def test_paci_where_only_the_last_stage_trains_equals_plain_training():
    """No stage that trains crosses an update (the last stage never does), so PACI has no staleness."""
    doc = doc_for("paci", [1, 1, 2, 2], frozen=[0, 1, 2, 3])
    records = run_in_process(doc)
    assert_plain(doc, records)
    assert trains(records) == [False, False, False, True]
    assert_nothing_to_drift(records)
    assert summary_of(records)["max_drift"] == 0


def test_bf16_with_a_stage_that_trains_nothing_equals_plain_bf16_training():
    doc = doc_for("1f1b", [1, 1, 2, 2], frozen=list(PREFIX), precision="bf16")
    records = run_in_process(doc)
    want, want_val = plain_bf16_training(doc)
    assert train_losses(records) == pytest.approx(want, abs=1e-5, rel=0)
    assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)


def test_bf16_masters_cover_the_trainable_parameters_only():
    units = load_model(model(frozen=[0]), 64, 0).units
    stage = Stage(
        0,
        2,
        [units[0], units[1]],
        window=1,
        optimizer=OptimizerConfig(lr=1e-3),
        lr_at=None,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
    )
    trainable = [p for p in units[1].parameters()]
    assert [m.shape for m in stage.optim.master_weights()] == [p.shape for p in trainable]
    assert all(m.dtype == torch.float32 for m in stage.optim.master_weights())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in units[0].parameters())


# ---------------------------------------------------------------------- what runs, and what does not


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls (in :data:`BACKWARDS`, by name)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        BACKWARDS[ctx.name] = BACKWARDS.get(ctx.name, 0) + 1
        return grad, None


BACKWARDS: dict[str, int] = {}


class Counter(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _Count.apply(h, self.name)


def counted_model() -> list[nn.Module]:
    """Entry model: frozen embedding, counter, frozen block, counter | block, counter, head (3 stages of 2)."""
    from helpers.guide_models import build_frozen

    embed, b0, b1, head = build_frozen(frozen=(0, 1), **{**SMALL, "n_layer": 2})
    return [embed, Counter("stage0"), b0, Counter("stage1"), b1, Counter("stage2"), head]


def test_a_frozen_prefix_runs_no_backward():
    """Stages 0 and 1 are frozen and nothing before them trains: their backward never runs (their
    counters see no call), though stage 1's input is an activation; stage 2's runs every micro-batch."""
    doc = doc_for("paci", [2, 2, 3])
    doc["model"] = {"entry": "test_frozen:counted_model", "block_size": SMALL["block_size"]}
    BACKWARDS.clear()
    records = run_in_process(doc)
    microbatches = doc["training"]["steps"] * doc["pipeline"]["window"]
    assert {"stage2": microbatches + 3} == BACKWARDS  # and the warm-up's 3 (stage 0's in-flight depth)
    assert trains(records) == [False, False, True]


# ---------------------------------------------------------------------------------------- checkpoints


def test_resume_and_reshard_with_a_stage_that_trains_nothing(tmp_path: Path):
    """PACI P=4 (two stages train nothing) resumes exactly from its step-2 checkpoint; 1F1B cut [1, 1, 2, 2]
    checkpointed at step 2 continues at P=2 [3, 3] (``init_from``) as the uninterrupted P=4 run."""
    ckpt = {"checkpoint_every": 2, "keep_checkpoints": 5}
    doc = doc_for("paci", [1, 1, 2, 2], frozen=list(PREFIX))
    doc["training"].update(ckpt, checkpoint_dir=str(tmp_path / "paci"))
    full = run_in_process(doc)
    (tmp_path / "paci" / "LATEST").write_text("batch_00000002\n")
    resumed = run_in_process(doc, resume=True)
    assert train_losses(resumed) == train_losses(full)
    assert [st["updates"] for st in summary_of(resumed)["stages"]] == [0, 0, 4, 4]

    flush = doc_for("1f1b", [1, 1, 2, 2], frozen=list(PREFIX))
    flush["training"].update(ckpt, checkpoint_dir=str(tmp_path / "flush"))
    whole = [r["loss"] for r in run_in_process(flush) if r["event"] == "train"]
    moved = doc_for("1f1b", [3, 3], frozen=list(PREFIX))
    moved["training"]["init_from"] = str(tmp_path / "flush" / "batch_00000002")
    rest = [r["loss"] for r in run_in_process(moved) if r["event"] == "train"]
    assert rest == pytest.approx(whole[2:], abs=1e-5, rel=0)


# ---------------------------------------------------------------------------- the unit interface


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("build_tuple", "unit 1 (TupleBlock) returns a tuple of 2 (Tensor, Tensor)"),
        ("build_dict", "unit 1 (DictBlock) returns a dict with keys ['hidden_states']"),
    ],
)
def test_a_unit_that_returns_more_than_one_tensor_is_refused_with_how_to_wrap_it(entry: str, says: str):
    doc = doc_for("1f1b", [3, 3], entry=entry)
    with pytest.raises(ConfigError) as e:
        run_in_process(doc)
    assert e.value.key == "model.entry" and says in e.value.allowed
    assert "wrap it in a module whose forward returns one tensor" in e.value.allowed


def test_the_wrapped_tuple_block_trains_like_plain_training():
    doc = doc_for("1f1b", [3, 3], entry="build_wrapped")
    assert_plain(doc, run_in_process(doc))


def test_a_model_with_nothing_to_train_is_refused():
    doc = doc_for("1f1b", [3, 3], frozen=list(range(6)))
    with pytest.raises(ConfigError, match="a model with a parameter to train"):
        run_in_process(doc)


# ------------------------------------------------------------------ memory model, profile, simulator


def _profile(trainable: list[int] | None) -> Profile:
    """Six units of 1 MiB each; ``trainable`` gives each one's trainable bytes (None: key left out, as before)."""
    cost = {"forward_s": 0.001, "backward_s": 0.002, "activation_bytes": 1024, "saved_bytes": 4096}
    units = [{"name": f"u{i}", "param_bytes": 2**20, "optimizer_s": 0.001, "microbatch": {2: cost}} for i in range(6)]
    if trainable is not None:
        for u, t in zip(units, trainable, strict=True):
            u["trainable_bytes"] = t
    return Profile.from_dict({"seq_len": 32, "units": units, "p2p": {"latency_s": 1e-5, "bandwidth_Bps": 1e9}})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_memory_counts_optimizer_state_for_trainable_parameters_only(dtype: str):
    import dataclasses

    old, frozen = _profile(None), _profile([0, 0, 2**19, 2**20, 2**20, 2**20])
    old, frozen = dataclasses.replace(old, dtype=dtype), dataclasses.replace(frozen, dtype=dtype)
    every = stage_memory(old, [0, 1, 2], 2, 3, last=False, copies=1)
    some = stage_memory(frozen, [0, 1, 2], 2, 3, last=False, copies=1)
    assert old.units[0].trained_bytes == 2**20  # a profile without the key trains everything, as before
    assert some.params == every.params == 3 * 2**20 * (4 if dtype == "fp32" else 2) // 4  # weights: all
    assert some.grads == 2**19 and every.grads == 3 * 2**20
    assert some.optimizer_state == 2 * 2**19  # AdamW's two moments of the trainable half unit
    assert some.masters == (2**19 if dtype == "bf16" else 0)
    assert some.weight_copies == 2**19 * (4 if dtype == "fp32" else 2) // 4
    prefix, before = stage_memory(frozen, [0, 1], 2, 3, last=False), stage_memory(old, [0, 1], 2, 3, last=False)
    assert prefix.optimizer_state == prefix.grads == 0
    assert before.activations - prefix.activations == 3 * 1024  # no backward: its output is not held
    assert Profile.from_dict(frozen.to_dict()) == frozen  # the key round-trips
    with pytest.raises(ConfigError, match="trainable_bytes"):
        Profile.from_dict({**frozen.to_dict(), "units": [{**frozen.to_dict()["units"][0], "trainable_bytes": 2**21}]})


def test_the_simulator_gives_a_stage_with_nothing_to_train_no_step_drift_or_all_reduce():
    from paci_tune.config.layout import Layout

    profile = _profile([0, 0, 0, 2**20, 2**20, 2**20])
    layout = Layout(schedule="paci", stages=4, window=2, microbatch_size=2, data_parallel=2, partition=(1, 1, 2, 2))
    result = simulate(layout, profile, 8)
    assert [s.drift_bound for s in result.per_stage] == [0, 0, 1, 0]
    assert [s.max_drift for s in result.per_stage] == [0, 0, 1, 0]
    assert [s.allreduce_s > 0 for s in result.per_stage] == [False, False, True, True]


def test_calibration_times_what_a_frozen_prefix_runs():
    """The stage pattern and the isolated measurement: no backward before the first trainable unit, no
    optimizer step for a frozen one, and trainable bytes in the profile."""
    from paci_tune.calibrate.pattern import StagePattern
    from paci_tune.calibrate.units import measure_units

    loaded = load_model(model(frozen=list(PREFIX)), 64, 0)
    isolated = measure_units(loaded, 64, [2], device=torch.device("cpu"), dtype="fp32", repeats=1, warmup=0)
    assert [u.costs[2].backward_s > 0 for u in isolated] == [False, False, False, True, True, True]
    assert [u.costs[2].saved_bytes > 0 for u in isolated][:3] == [False, False, False]
    assert [u.optimizer_s > 0 for u in isolated] == [False, False, False, True, True, True]
    assert [u.trainable_bytes == (0 if i in PREFIX else u.param_bytes) for i, u in enumerate(isolated)] == [True] * 6
    pattern = StagePattern(
        [loaded.units[i] for i in range(6)],
        vocab_size=64,
        n_classes=64,
        seq_len=32,
        device=torch.device("cpu"),
        dtype="fp32",
        window=2,
        inflight=2,
        optimizer=OptimizerConfig(lr=1e-3),
    )
    pattern.measure(2, repeats=2, warmup=0)
    backward = pattern.samples.backward[2]
    assert all(s == 0.0 for i in PREFIX for s in backward[i])
    assert all(s > 0.0 for s in backward[3])


# ------------------------------------------------------------------------------------- the docs


def _guide_blocks() -> list[str]:
    """The ```python blocks of docs/guide.md's section 4, "Your own model"."""
    text = (REPO / "docs" / "guide.md").read_text()
    section = text.split("## 4. Your own model", 1)[1].split("\n## 5.", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_guides_model_code_is_what_the_tests_run():
    """Every python block of the guide's "Your own model" is tests/helpers/guide_models.py's text
    (import lines anywhere in it, the rest verbatim), so the examples there are the ones trained here."""
    source = (REPO / "tests" / "helpers" / "guide_models.py").read_text()
    blocks = _guide_blocks()
    assert len(blocks) >= 5, "the guide's model, frozen units, a parameter-free unit, a tuple, a tied head"
    for block in blocks:
        lines = block.splitlines()
        imports = [ln for ln in lines if ln.startswith(("import ", "from "))]
        assert all(ln in source.splitlines() for ln in imports), imports
        body = "\n".join(ln for ln in lines if ln not in imports).strip("\n")
        assert body in source, f"not in tests/helpers/guide_models.py:\n{body}"


# ------------------------------------------------------------------------------ processes (slow)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "cut", "replicas"), [("1f1b", [1, 1, 2, 2], 1), ("gpipe", [3, 3], 2)])
def test_distributed_flush_with_frozen_units_equals_plain_training(tmp_path, schedule, cut, replicas):
    doc = doc_for(schedule, cut, frozen=list(PREFIX), data_parallel=replicas, window=4 // replicas)
    records = run_distributed(tmp_path, doc)
    single = copy.deepcopy(doc)
    single["pipeline"].update(window=4, data_parallel=1)
    assert_plain(single, records)
    assert_nothing_to_drift(records)
    if replicas > 1:  # the replicas of a stage with nothing to train run no gradient all-reduce
        assert ["allreduce_wait_s" in st for st in summary_of(records)["stages"]] == trains(records)


@pytest.mark.slow
def test_distributed_paci_with_frozen_units_equals_emulated(tmp_path: Path):
    """PACI with two stages that train nothing and two that cross updates: the runtimes agree."""
    doc = doc_for("paci", [1, 1, 2, 2], steps=6, frozen=list(PREFIX), window=2)
    doc["training"]["eval_every"] = 3  # evaluations inside the run: the target news rides the empty gradients
    got, want = run_distributed(tmp_path, doc), run_in_process(doc)
    assert train_losses(got) == pytest.approx(train_losses(want), abs=1e-5, rel=0)
    evals = [[r["val_loss"] for r in rs if r["event"] == "eval"] for rs in (got, want)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-5, rel=0)
    assert [st["drift_histogram"] for st in summary_of(got)["stages"]] == [
        st["drift_histogram"] for st in summary_of(want)["stages"]
    ]
    assert summary_of(got)["stages"][2]["max_drift"] == 1


_SCHEDULE_PACI = '''
"""SchedulePACI, 2 ranks: stage 0 the guide's frozen prefix (optimizer=None), stage 1 the rest."""
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from helpers.guide_models import SMALL, build_frozen
from paci_tune.model.loss import next_token_loss
from paci_tune.pipelining import SchedulePACI

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
units = build_frozen(frozen=(0, 1, 2), **SMALL)
mine = torch.nn.Sequential(*(units[:3] if rank == 0 else units[3:]))
stage = PipelineStage(mine, rank, 2, torch.device("cpu"))
if rank == 1:
    try:
        SchedulePACI(stage, 4, next_token_loss, window=4, optimizer=None)
    except ValueError as e:
        refused = str(e)
opt = None if rank == 0 else torch.optim.AdamW(mine.parameters(), lr=3e-3)
sched = SchedulePACI(stage, 4, next_token_loss, window=4, optimizer=opt)
gen = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 64, (8, 33), generator=gen) for _ in range(4)]
losses = []
with sched:
    for b in batches:
        if rank == 0:
            sched.step(b[:, :-1])
        else:
            sched.step(target=b[:, 1:], losses=losses)
out = {"updates": sched.updates, "max_drift": sched.max_drift, "losses": [float(x) for x in losses]}
if rank == 1:
    out["refused"] = refused
json.dump(out, open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_schedule_paci_with_a_stage_that_trains_nothing_equals_plain_training(tmp_path: Path):
    """Stage 0 frozen (``optimizer=None``): it takes no step, and the last stage, which never crosses an
    update, trains exactly as plain training does on the same batches."""
    from helpers.guide_models import build_frozen

    from paci_tune.model.loss import next_token_loss

    script = tmp_path / "worker.py"
    script.write_text(_SCHEDULE_PACI)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=guide_env(), check=False)
    check_ok(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["updates"] == 0 and ranks[0]["max_drift"] == 0 and ranks[1]["updates"] == 4
    assert "optimizer=None is for a stage with nothing to train" in ranks[1]["refused"]

    torch.manual_seed(0)
    net = nn.Sequential(*build_frozen(frozen=(0, 1, 2), **SMALL))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    want = []
    for b in [torch.randint(0, 64, (8, 33), generator=gen) for _ in range(4)]:
        for x, y in zip(b[:, :-1].chunk(4), b[:, 1:].chunk(4), strict=True):
            loss = next_token_loss(net(x), y)
            (loss / 4).backward()
            want.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert ranks[1]["losses"] == pytest.approx(want, abs=1e-5, rel=0)


@pytest.mark.slow
def test_a_search_on_a_frozen_prefix_model_trains_every_point(tmp_path: Path):
    """bench/search_seeds.py's quick search (rst clock on a hand-written profile, 0.6 s per trial) on the
    guide's frozen-prefix model: every trial of both schedules completes, no internal error."""
    vocab = quick_search().QUICK["data"]["vocab_size"]
    config = guide_model_search(tmp_path, model(frozen=list(PREFIX), vocab_size=vocab), [2, 4], frozen=PREFIX)
    proc = run(search_cmd(config, tmp_path), env=guide_env())
    check_ok(proc)
    assert "internal error" not in proc.stdout + proc.stderr
    import optuna

    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    for schedule in ("paci", "1f1b"):
        study = optuna.load_study(study_name=f"model.{schedule}", storage=storage)
        assert study.trials and all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials), [
            (t.state, t.user_attrs.get("fail_reason")) for t in study.trials
        ]


@pytest.mark.slow
def test_a_tuple_crossing_a_cut_is_refused_by_the_cli_before_any_worker_starts(tmp_path: Path):
    doc = doc_for("1f1b", [3, 3], entry="build_tuple")
    proc = run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", tmp_path / "m.jsonl")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: model.entry: got 'helpers.guide_models:build_tuple'"), proc.stderr
