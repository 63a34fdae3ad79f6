"""Validating densely only near the target (``training.eval_far_every``, :mod:`paci_tune.train.nearness`).

Oracles: the rule's cases worked by hand, and the same run validated at every point (its curve, read
through the rule, names the points the far run must validate: the word travels from the last stage to
stage 0 on the gradients in time, on both runtimes, and the values there are the dense run's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.cli import check_ok, read_metrics, run_cli, run_in_process, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import CONSTANT_LR
from helpers.profiles import make_profile, unit

from paci_tune.config import derive_run
from paci_tune.errors import ConfigError
from paci_tune.train.nearness import near_target, validated

STEPS, FAR = 14, 3


def test_the_rule_by_hand() -> None:
    assert not near_target([], 1.0)  # no far validation yet
    assert near_target([1.5, 0.9], 1.0)  # reached: the run ends anyway
    assert not near_target([3.0], 1.0)  # one far validation: no rate, and not half way
    assert near_target([3.0, 2.9, 1.9], 1.0)  # best 1.9 is 0.9 from the target: under half of the first's 2.0
    assert near_target([3.0, 2.6], 2.0)  # 0.4 a far interval: 2.6 - 2 * 0.4 = 1.8 <= 2.0
    assert not near_target([3.0, 2.6], 1.7)  # ...but not 1.7 (nor half way: 0.9 > 0.65)
    # A bump, then a steep fall: not half way from the first (0.6 > 0.5), the rate over two intervals
    # ((3.4 - 2.6) / 2 = 0.4) reaches it within two more: 2.6 - 0.8 = 1.8 <= 2.0.
    assert near_target([3.0, 3.2, 3.4, 3.0, 2.6], 2.0)
    assert not near_target([3.0, 3.1, 3.2], 1.0)  # getting worse: never near
    assert [s for s in range(1, 13) if validated(s, 2, 6, False)] == [6, 12]
    assert [s for s in range(1, 13) if validated(s, 2, 6, True)] == [2, 4, 6, 8, 10, 12]
    assert [s for s in range(1, 13) if validated(s, 2, None, False)] == [2, 4, 6, 8, 10, 12]


def test_eval_far_every_must_be_a_multiple_of_eval_every() -> None:
    with pytest.raises(ConfigError, match="eval_far_every"):
        derive_run(make_config(training={"eval_every": 2, "eval_far_every": 5}))
    with pytest.raises(ConfigError, match="eval_far_every"):
        derive_run(make_config(training={"eval_every": 2, "eval_far_every": 0}))
    with pytest.raises(ConfigError, match="eval_far_every"):
        derive_run(make_config(training={"eval_every_seconds": 0.5, "eval_far_every": 4}))


def _doc(tmp_path: Path, schedule: str, **training: Any) -> dict[str, Any]:
    path = tmp_path / "profile.yaml"
    make_profile(
        [unit(1e-3, 2e-3, mb=2, opt=5e-4) for _ in range(4)], p2p={"latency_s": 1e-4, "bandwidth_Bps": 1e9}, seq_len=32
    ).save(path)
    return make_config(
        training={"steps": STEPS, "clock": "rst", "profile": str(path), "eval_every": 1, **training},
        lr_schedule=CONSTANT_LR,
        pipeline={"schedule": schedule, "stages": 3, "window": 2},
    )


def _in_pipeline(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in records if r["event"] == "eval" and not r.get("drained")]


def _expected(dense: list[tuple[int, float]], target: float) -> list[tuple[int, float]]:
    """The points the rule picks from the dense run's curve, up to the first at or below the target."""
    out: list[tuple[int, float]] = []
    far: list[float] = []
    near = False
    for step, val in dense:
        if validated(step, 1, FAR, near):
            out.append((step, val))
            if step % FAR == 0:
                far.append(val)
                near = near_target(far, target)
            if val <= target:
                break
    return out


def _target(tmp_path: Path, schedule: str) -> tuple[float, list[tuple[int, float]]]:
    """A target the dense run reaches late (between its last two validations but one), and its curve."""
    curve = _in_pipeline(run_in_process(_doc(tmp_path, schedule)))
    assert [s for s, _ in curve] == list(range(1, STEPS + 1))
    return (curve[-3][1] + curve[-4][1]) / 2, curve


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_a_run_validates_far_apart_then_densely_near_the_target(tmp_path: Path, schedule: str) -> None:
    target, _ = _target(tmp_path, schedule)
    dense = run_in_process(_doc(tmp_path, schedule, target_val_loss=target))
    far = run_in_process(_doc(tmp_path, schedule, target_val_loss=target, eval_far_every=FAR))
    want = _expected(_in_pipeline(dense), target)
    steps = [s for s, _ in want]
    assert any(s % FAR for s in steps) and any(s % FAR and s not in steps for s in range(FAR, steps[-1]))
    got = _in_pipeline(far)[: len(want)]
    assert got == want  # the same points, the same values, bit for bit in one process
    assert train_losses(far) == train_losses(dense)  # validating less changed no training number; the same end


@pytest.mark.slow
def test_the_word_reaches_stage_0_in_time_on_the_distributed_runtime(tmp_path: Path) -> None:
    """Three processes: the last stage's word travels on real gradients (PACI: no flush between batches)."""
    target, _ = _target(tmp_path, "paci")
    want = _expected(_in_pipeline(run_in_process(_doc(tmp_path, "paci", target_val_loss=target))), target)
    metrics = tmp_path / "m.jsonl"
    doc = _doc(tmp_path, "paci", target_val_loss=target, eval_far_every=FAR)
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    got = _in_pipeline(read_metrics(metrics))[: len(want)]
    assert [s for s, _ in got] == [s for s, _ in want]
    assert max(abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)) <= 1e-6
