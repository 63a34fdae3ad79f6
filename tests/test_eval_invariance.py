"""Evaluation never changes training, and every run of a model is scored on the same validation tokens.

Oracles: the same run evaluated at other cadences (its per-batch training losses must not move, bit
for bit in one process, within 1e-6 across processes), a shorter run of the same constant-LR
config (its drained final model *is* "the model after update k at every stage", which an evaluation
inside the longer run must score), and the validation windows themselves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import check_ok, read_metrics, run_cli, run_in_process, summary_of, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import CONSTANT_LR
from helpers.profiles import make_profile, unit

CADENCES: list[dict[str, Any]] = [{"eval_every": 1}, {"eval_every": 3}, {"eval_every": 50}, {"eval_every_seconds": 0}]


def _profile(tmp_path: Path) -> str:
    path = tmp_path / "profile.yaml"
    units = [unit(1e-3, 2e-3, mb=2, opt=5e-4) for _ in range(4)]
    make_profile(units, p2p={"latency_s": 1e-4, "bandwidth_Bps": 1e9}, seq_len=32).save(path)
    return str(path)


def _doc(tmp_path: Path, stages: int, window: int, cadence: dict[str, Any], steps: int = 9) -> dict[str, Any]:
    training: dict[str, Any] = {"steps": steps, "clock": "rst", "profile": _profile(tmp_path), "eval_every": 1000}
    if "eval_every_seconds" in cadence:
        training["eval_every_seconds"] = 0.02  # a grid on the rst clock: a few evaluations inside the run
    else:
        training.update(cadence)
    return make_config(
        training=training, lr_schedule=CONSTANT_LR, pipeline={"schedule": "paci", "stages": stages, "window": window}
    )


def _evals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "eval"]


@pytest.mark.parametrize(("stages", "window"), [(3, 2), (4, 1)])
def test_training_is_the_same_whatever_the_evaluation_cadence_emulated(
    tmp_path: Path, stages: int, window: int
) -> None:
    runs = [run_in_process(_doc(tmp_path, stages, window, c)) for c in CADENCES]
    losses = [train_losses(r) for r in runs]
    assert all(x == losses[0] for x in losses[1:]), "an evaluation cadence changed a training loss"
    counts = [len(_evals(r)) for r in runs]
    assert counts[0] == 9 and counts[1] == 3 and counts[2] == 1 and counts[3] >= 3  # the cadences did differ
    clocks = [[t["clock"] for t in r if t["event"] == "train"] for r in runs]
    assert all(c == clocks[0] for c in clocks[1:]), "evaluation cost training time on the rst clock"
    summaries = [summary_of(r) for r in runs]
    assert len({s["analytic_bubble_fraction"] for s in summaries}) == 1  # no extra fill or drain
    # The simulated bubble (the rst clock's timeline) is exactly the same; the measured one is a
    # timing figure, compared side by side in bench/eval_bubble.py, not here.
    assert len({s["clock_bubble_fraction"] for s in summaries}) == 1
    for rec in _evals(runs[0]):
        assert rec["weights"]["updates"] == [rec["step"]] * stages  # the model after update k at every stage
    # A stage that steps again before its evaluation scores a snapshot: stages s > window here (away
    # from the run's end, where the last forward comes early and fewer steps intervene).
    inner = _evals(runs[0])[: 9 - stages]
    assert all(rec["weights"]["snapshot"] == [s > window for s in range(stages)] for rec in inner)


@pytest.mark.parametrize(("stages", "window"), [(3, 2), (4, 1)])
def test_an_evaluation_scores_the_model_after_update_k_at_every_stage(tmp_path: Path, stages: int, window: int) -> None:
    """Oracle: a run of k steps ends drained with exactly that model (constant LR: the same numerics)."""
    long = run_in_process(_doc(tmp_path, stages, window, {"eval_every": 1}))
    for k in (2, 5):
        short = run_in_process(_doc(tmp_path, stages, window, {"eval_every": 50}, steps=k))
        inside = next(r for r in _evals(long) if r["step"] == k)
        assert train_losses(short) == train_losses(long)[:k]
        assert inside["val_loss"] == pytest.approx(summary_of(short)["final_val_loss"], abs=1e-6, rel=0)


def test_two_runs_differing_only_in_micro_batch_size_score_the_same_tokens() -> None:
    from paci_tune.config import derive_run
    from paci_tune.pipeline.factory import build_setup
    from paci_tune.train.run import resolve_run

    vals = []
    for b in (1, 2, 4):
        cfg = derive_run(make_config(pipeline={"microbatch_size": b, "window": None, "stages": 2}))
        assert cfg.pipeline.microbatch_size == b
        vals.append(build_setup(resolve_run(cfg), lambda k: 1e-3).runtime.val)
    windows = [torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in v]) for v in vals]
    assert all(torch.equal(w, windows[0]) for w in windows[1:])
    assert len(windows[0]) == make_config()["training"]["eval_sequences"]


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "window"), [(3, 2)])  # (4, 1) too on emulated; the runtimes agree (test_runtimes)
def test_training_is_the_same_whatever_the_evaluation_cadence_distributed(
    tmp_path: Path, stages: int, window: int
) -> None:
    """The two ways a distributed run drains to evaluate -- every step (the most drains) and on the rst
    clock's grid -- against the emulated run; the emulated test above holds every cadence equal (a
    3-rank run is ~17 s here, so not all four again)."""
    want = train_losses(run_in_process(_doc(tmp_path, stages, window, CADENCES[0])))
    for i, cadence in enumerate((CADENCES[0], CADENCES[-1])):
        d = tmp_path / f"c{i}"
        d.mkdir()
        metrics = d / "m.jsonl"
        proc = run_cli(
            write_config(d, _doc(d, stages, window, cadence)), "--runtime", "distributed", "--metrics", metrics
        )
        check_ok(proc)
        records = read_metrics(metrics)
        got = train_losses(records)
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-6, f"cadence {cadence}"
        assert all(math.isfinite(r["val_loss"]) for r in _evals(records))
        assert all(r["weights"]["updates"] == [r["step"]] * stages for r in _evals(records))
        assert summary_of(records)["clock_bubble_fraction"] == pytest.approx(
            summary_of(run_in_process(_doc(d, stages, window, cadence)))["clock_bubble_fraction"], rel=1e-9
        )  # the simulated bubble of the distributed run is the emulated one, at every cadence


def test_the_old_eval_batches_spelling_means_a_fixed_number_of_sequences() -> None:
    from paci_tune.config import derive_run
    from paci_tune.errors import ConfigError

    for b in (1, 2, 4):  # whatever the micro-batch size
        doc = make_config(training={"eval_batches": 2}, pipeline={"microbatch_size": b, "window": None})
        del doc["training"]["eval_sequences"]
        cfg = derive_run(doc)
        assert cfg.training.eval_sequences == 2 * cfg.training.eval_microbatch_size
    with pytest.raises(ConfigError, match="eval_batches"):
        derive_run(make_config(training={"eval_batches": 2, "eval_sequences": 8}))
