"""Parameters shared by units on different stages (tied weights): flush sums their gradient, PACI refuses them.

The model: docs/guide.md's head tied to the embedding (tests/helpers/guide_models.py ``build_tied``: unit
5 multiplies by unit 0's ``tok.weight``), so every cut of 2 or more stages splits the tied pair.
Oracle: plain training in one process (tests/helpers/oracles.py ``plain_training``): one module, AdamW
over ``net.parameters()``, where the tied weight is one parameter whose gradient autograd sums over its
two uses. Under 1F1B-flush and GPipe the pipeline keeps a copy per stage and sums the copies' gradients
before the step (paci_tune/pipeline/tied.py), which must give the same numbers within 1e-5 on both
runtimes, at P = 2 and 4, with data parallelism and with a whole-model gradient clip; and the copies
must be bitwise equal at the end (read back from the last checkpoint's stage files).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.bf16 import plain_bf16_training, torch_threads
from helpers.cli import check_ok, invoke_in, run_in_process, summary_of, train_losses
from helpers.configs import write_config
from helpers.guide_models import SMALL
from helpers.guide_runs import assert_plain, doc_for, guide_env, model, run_distributed
from helpers.searches import guide_model_search, quick_search, run, search_cmd

from paci_tune.base.processes import threads_per_process
from paci_tune.errors import ConfigError
from paci_tune.tune.narrow import skip_tied
from paci_tune.tune.record import FAIL_REASON, INFEASIBLE
from paci_tune.tune.space import SearchSpace

TIED = "build_tied"
FLUSH_CUTS = [
    ("1f1b", [3, 3]),
    ("gpipe", [3, 3]),
    ("1f1b", [1, 2, 2, 1]),
    ("gpipe", [2, 1, 1, 2]),
]


def tied_doc(schedule: str, cut: list[int], **kw: Any) -> dict[str, Any]:
    return doc_for(schedule, cut, entry=TIED, **kw)


def one_process(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as plain training sees it: the same sequences per step in one replica."""
    single = copy.deepcopy(doc)
    p = single["pipeline"]
    p.update(window=p["window"] * p.get("data_parallel", 1), data_parallel=1)
    return single


def copies_of_the_tied_weight(folder: Path) -> list[torch.Tensor]:
    """Every stage's copy of ``tok.weight`` in checkpoint ``folder`` (stage files, by the cut in meta.json)."""
    import json

    sizes = json.loads((folder / "meta.json").read_text())["partition"]
    out, start = [], 0
    for s, n in enumerate(sizes):
        module = torch.load(folder / f"stage_{s}.pt", map_location="cpu", weights_only=False)["module"]
        for u in (0, 5):
            if start <= u < start + n:
                out.append(module[f"{u - start}.tok.weight"])
        start += n
    return out


# ------------------------------------------------------------------ flush schedules equal plain training


@pytest.mark.parametrize(("schedule", "cut"), FLUSH_CUTS, ids=str)
def test_flush_with_a_tied_head_equals_plain_training(schedule: str, cut: list[int]):
    doc = tied_doc(schedule, cut)
    records = run_in_process(doc)
    assert_plain(doc, records)
    assert all(st["max_drift"] == 0 and st["updates"] == 4 for st in summary_of(records)["stages"])


def test_a_whole_model_clip_counts_the_tied_weight_once():
    """grad_clip 0.5 bites at every step: a norm counting the tied gradient twice would clip differently."""
    doc = tied_doc("1f1b", [1, 2, 2, 1])
    doc["optimizer"]["grad_clip"] = 0.5
    assert_plain(doc, run_in_process(doc))


@pytest.mark.parametrize(("schedule", "cut"), [("1f1b", [3, 3]), ("gpipe", [1, 2, 2, 1])], ids=str)
def test_two_replicas_with_a_tied_head_equal_plain_training(schedule: str, cut: list[int]):
    """D = 2: each stage's gradients averaged over its replicas, then the holders' summed (Megatron's order)."""
    doc = tied_doc(schedule, cut, data_parallel=2, window=2)
    doc["optimizer"]["grad_clip"] = 0.5
    assert_plain(one_process(doc), run_in_process(doc))


def test_the_copies_stay_equal_and_resume_exactly(tmp_path: Path):
    """1F1B P=4 checkpointed every 2 steps: the two stages' copies are bitwise equal; a resume from step 2
    gives the uninterrupted run's losses."""
    doc = tied_doc("1f1b", [1, 2, 2, 1])
    doc["training"].update(checkpoint_every=2, keep_checkpoints=5, checkpoint_dir=str(tmp_path))
    full = run_in_process(doc)
    first, last = copies_of_the_tied_weight(tmp_path / "batch_00000004")
    assert torch.equal(first, last)
    (tmp_path / "LATEST").write_text("batch_00000002\n")
    assert train_losses(run_in_process(doc, resume=True)) == train_losses(full)


@pytest.mark.parametrize(
    ("written", "read"),
    [([3, 3], [6]), ([3, 3], [1, 2, 2, 1]), ([6], [3, 3])],
    ids=["split-to-one-stage", "P2-to-P4", "one-stage-to-split"],
)
def test_a_reshard_continues_the_uninterrupted_run(tmp_path: Path, written: list[int], read: list[int]):
    """A checkpoint at step 2 of one cut, read by another (``init_from``), continues as the uninterrupted run
    of the first: both copies, or the one parameter, carry the value and the AdamW moments -- also from a
    cut with the tie inside one stage, where the second unit's name has no optimizer state of its own."""
    doc = tied_doc("1f1b", written)
    doc["training"].update(checkpoint_every=2, keep_checkpoints=5, checkpoint_dir=str(tmp_path))
    whole = train_losses(run_in_process(doc))
    moved = tied_doc("1f1b", read)
    moved["training"]["init_from"] = str(tmp_path / "batch_00000002")
    rest = [r["loss"] for r in run_in_process(moved) if r["event"] == "train"]  # steps 3 and 4
    assert rest == pytest.approx(whole[2:], abs=1e-5, rel=0)


def test_bf16_tied_copies_step_on_the_fp32_sum_of_their_gradients():
    """bf16: each holder folds its use's bf16 gradient into its fp32 master and the masters' gradients are
    summed in fp32 (Megatron's fp32 main grads). Plain bf16 training in one process sums the two uses in
    bf16 first (autograd accumulates them on the one bf16 parameter), so it differs by that rounding:
    within 1e-5 at P = 1 (the same accumulation), within 5e-3 across stages."""
    for cut, tol in (([6], 1e-5), ([3, 3], 5e-3)):
        doc = tied_doc("1f1b", cut, precision="bf16")
        want, want_val = plain_bf16_training(doc)
        records = run_in_process(doc)
        assert train_losses(records) == pytest.approx(want, abs=tol, rel=0)
        assert summary_of(records)["final_val_loss"] == pytest.approx(want_val, abs=tol, rel=0)


# --------------------------------------------------------------------------------------- PACI


def test_paci_refuses_a_tied_parameter_across_stages(tmp_path: Path):
    """Exit 2, one line naming the parameter, its stages and why; nothing written."""
    write_config(tmp_path, tied_doc("paci", [1, 2, 2, 1]))
    r = invoke_in(tmp_path, ["train", "run.yaml", "--no-live", "--metrics", "m.jsonl"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: pipeline.schedule: got 'paci'; allowed: 1f1b or gpipe for this cut")
    assert "unit 0's 'tok.weight' (stage 0) and unit 5's 'tok.weight' (stage 3)" in lines[0]
    assert "held by stages 0, 3" in lines[0] and "step at their own cadence with no synchronisation" in lines[0]
    assert not (tmp_path / "m.jsonl").exists()


def test_interleaved_on_the_distributed_runtime_refuses_a_tie_across_its_pieces(tmp_path: Path):
    """Rank s of torch's interleaved 1F1B holds pieces s, s + P, ...; the runtime sums a tied parameter over
    one stage per rank, so a tie across pieces is refused before any worker starts (exit 2, one line naming
    the pieces). The emulated runtime, training 1F1B's numbers on P stages, keeps training it."""
    doc = tied_doc("interleaved", [1, 2, 2, 1])
    doc["pipeline"].update(stages=2, chunks=2, runtime="distributed")
    write_config(tmp_path, doc)
    r = invoke_in(tmp_path, ["train", "run.yaml", "--no-live", "--metrics", "m.jsonl"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: pipeline.runtime: got 'distributed'; allowed: emulated for schedule interleaved")
    assert "held by pieces 0, 3" in lines[0]
    assert not (tmp_path / "m.jsonl").exists()


def frozen_tied(**kwargs: Any) -> list[torch.nn.Module]:
    """The tied model with its embedding frozen: the shared weight never changes."""
    from helpers.guide_models import build_tied

    units = build_tied(**kwargs)
    units[0].requires_grad_(False)
    return units


def test_paci_trains_a_frozen_tied_parameter_across_stages():
    """A frozen shared parameter is never stepped, so its copies stay equal under PACI too: not refused."""
    doc = doc_for("paci", [3, 3])
    doc["model"] = {"entry": "test_tied:frozen_tied", "kwargs": SMALL, "block_size": SMALL["block_size"]}
    records = run_in_process(doc)
    assert [st["updates"] for st in summary_of(records)["stages"]] == [4, 4]


def test_a_tie_inside_one_stage_trains_like_plain_training_under_paci():
    doc = tied_doc("paci", [6])
    assert_plain(doc, run_in_process(doc))


# ------------------------------------------------------------------------------------- searches


def test_a_search_space_skips_paci_points_that_split_a_tied_parameter():
    """PACI keeps P = 1 only (a trial's cut is chosen when it starts); flush keeps every point; no P = 1 refuses."""
    space = SearchSpace("s", ("paci", "1f1b"), 8, (1, 2, 4), (2,), (), None)
    tied = skip_tied(space, "unit 0's 'tok.weight' and unit 5's 'tok.weight'")
    assert [(q.schedule, q.stages) for q in tied.grid()] == [("paci", 1), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4)]
    assert any("paci P=2" in d and "PACI refuses to split across stages" in d for d in tied.dropped)
    assert skip_tied(space, None) == space
    with pytest.raises(ConfigError) as e:
        skip_tied(SearchSpace("s", ("paci", "1f1b"), 8, (2, 4), (2,), (), None), "unit 0's 'w'")
    assert e.value.key == "space.schedules" and "schedules without paci, or stages including 1" in e.value.allowed


def _search_config(tmp_path: Path, stages: list[int]) -> Path:
    """bench/search_seeds.py's quick search (rst clock, hand-written profile) on the tied model."""
    return guide_model_search(tmp_path, model(TIED, vocab_size=quick_search().QUICK["data"]["vocab_size"]), stages)


@pytest.mark.slow
def test_a_search_of_only_split_points_refuses_paci_up_front(tmp_path: Path):
    proc = run(search_cmd(_search_config(tmp_path, [2, 4]), tmp_path), env=guide_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: space.schedules: got ['paci', '1f1b']; allowed: schedules without paci")
    assert not (tmp_path / "work" / "trials").exists()


@pytest.mark.slow
def test_a_search_on_a_tied_model_trains_flush_and_single_stage_paci(tmp_path: Path):
    """PACI's split points are answered unrun; no trial that runs fails, flush at P = 2 included."""
    proc = run(search_cmd(_search_config(tmp_path, [1, 2]), tmp_path), env=guide_env())
    check_ok(proc)
    assert "internal error" not in proc.stdout + proc.stderr
    import optuna

    storage = f"sqlite:///{tmp_path / 'work' / 'study.db'}"
    for schedule in ("paci", "1f1b"):
        trials = optuna.load_study(study_name=f"model.{schedule}", storage=storage).trials
        ran = [t for t in trials if not t.user_attrs.get(INFEASIBLE)]
        refused = [t for t in trials if t.user_attrs.get(INFEASIBLE)]
        split = [t for t in refused if schedule == "paci" and t.params["stages"] > 1]
        assert all("PACI refuses to split across stages" in t.user_attrs[FAIL_REASON] for t in split), [
            t.user_attrs for t in refused
        ]
        assert ran and all(t.state != optuna.trial.TrialState.FAIL for t in ran), [
            (t.params, t.state, t.user_attrs.get(FAIL_REASON)) for t in trials
        ]  # completed, or pruned by the pruner after training
        stages = {t.params["stages"] for t in ran}
        if schedule == "paci":
            assert stages == {1}
        else:
            assert 2 in stages


# ------------------------------------------------------------------------------ processes (slow)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "cut", "replicas"),
    [("1f1b", [3, 3], 1), ("gpipe", [1, 2, 2, 1], 1), ("1f1b", [3, 3], 2)],
    ids=str,
)
def test_distributed_flush_with_a_tied_head_equals_plain_training(tmp_path, schedule, cut, replicas):
    """One process per stage and replica: the holders' all-reduce in its own group, after the replicas' average."""
    doc = tied_doc(schedule, cut, data_parallel=replicas, window=4 // replicas)
    doc["optimizer"]["grad_clip"] = 0.5
    doc["training"].update(checkpoint_every=4, checkpoint_dir=str(tmp_path / "ckpt"))
    records = run_distributed(tmp_path, doc)
    assert_plain(one_process(doc), records)
    first, last = copies_of_the_tied_weight(tmp_path / "ckpt" / "batch_00000004")
    assert torch.equal(first, last)
    if replicas == 1:  # two holders sum two terms: the emulated runtime's numbers bit for bit
        emulated = copy.deepcopy(doc)
        emulated["training"]["checkpoint_dir"] = str(tmp_path / "emulated")
        assert train_losses(run_in_process(emulated)) == train_losses(records)


@pytest.mark.slow
def test_distributed_bf16_with_a_tied_head_equals_emulated(tmp_path: Path):
    """bf16: the holders' fp32 master gradients summed by the all-reduce as in one process. The emulated run
    computes with a worker's threads (CPU bf16 kernels round by thread count, tests/test_bf16.py)."""
    doc = tied_doc("1f1b", [3, 3], precision="bf16")
    with torch_threads(threads_per_process(2)):
        emulated = run_in_process(doc)
    assert train_losses(run_distributed(tmp_path, doc)) == pytest.approx(train_losses(emulated), abs=1e-5, rel=0)
