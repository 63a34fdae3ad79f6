"""The stored schema: a trial's user attributes through :mod:`paci_tune.tune.record`, best.yaml through
:class:`paci_tune.tune.bestfile.BestFile` -- written and read back unchanged, in the format old studies
and old files have (the same keys, absent and null kept apart, the same order)."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

from paci_tune.tune import record
from paci_tune.tune.bestfile import BestFile, write_best
from paci_tune.tune.record import Claim, Extra, Outcome, PointAttrs, Retry, StudyRecord, TrialRecord

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_a_trial_written_through_the_record_reads_back_with_the_stored_keys() -> None:
    study = optuna.create_study(direction="minimize")
    trial = study.ask()
    Claim("here", 42, 1.5).write(trial)
    PointAttrs("paci P=2 a=4 b=2", 1, 2).write(trial)  # no backward_weights: not written
    Outcome(None, 3.5, 2.0, 0.25, [[1.0, 4.0], [2.0, 3.5]], {"steps": 7, "partition": [1, 1]}).write(trial)
    record.mark_pruned(trial, 2, 2.0)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    t = study.trials[0]
    assert t.user_attrs["worker"] == {"host": "here", "pid": 42} and t.user_attrs["heartbeat"] == 1.5
    assert "backward_weights" not in t.user_attrs and t.user_attrs["time_to_target"] is None  # null is stored
    assert t.user_attrs["steps"] == 7 and t.user_attrs["predicted_peak_memory_bytes"] is None
    r = TrialRecord.read(t)
    assert (r.worker, r.label, r.data_parallel, r.pruned_step, r.pruned_clock) == (
        {"host": "here", "pid": 42},
        "paci P=2 a=4 b=2",
        1,
        2,
        2.0,
    )
    assert r.curve == [[1.0, 4.0], [2.0, 3.5]] and r.figure("partition") == [1, 1]
    assert not r.is_extra and not r.is_repeat and not r.infeasible and r.attempt == 0


def test_extra_runs_and_retries_are_queued_in_the_stored_format() -> None:
    study = optuna.create_study(direction="minimize")
    Extra(3, seed=5).enqueue(study, {})
    Extra(4, factor=2.0).enqueue(study, {})
    Retry(7, 1, {"transfer": {"of": 4, "factor": 2.0}}).enqueue(study, {})
    attrs = [t.user_attrs for t in study.trials]
    assert attrs == [
        {"confirm": {"of": 3, "seed": 5}},
        {"transfer": {"of": 4, "factor": 2.0}},
        {"retry_of": 7, "attempt": 1, "transfer": {"of": 4, "factor": 2.0}},
    ]
    conf, long, retry = map(TrialRecord.read, study.trials)
    assert (conf.confirm_of, conf.seed, conf.is_confirmation, conf.is_extra) == (3, 5, True, True)
    assert (long.transfer_of, long.factor, long.is_transfer) == (4, 2.0, True)
    assert (retry.retry_of, retry.attempt, retry.extra_attrs()) == (7, 1, {"transfer": {"of": 4, "factor": 2.0}})
    StudyRecord.write_fingerprint(study, {"target": 2.0}, "paci")
    StudyRecord.write_plan(study, record.CONFIRM_PLAN, [3])
    assert study.user_attrs == {"fingerprint": {"target": 2.0}, "schedule": "paci", "confirm_plan": [3]}
    assert StudyRecord.read(study) == StudyRecord({"target": 2.0}, "paci", [3], None)


def test_best_yaml_round_trips_through_its_dataclasses(tmp_path: Path) -> None:
    doc = {
        "recommended": {
            "schedule": "paci",
            "stages": 2,
            "data_parallel": 1,
            "devices": 2,
            "window": 4,
            "microbatch_size": 2,
            "partition": [1, 1],
            "global_batch": 8,
            "lr": 1e-3,
            "lr_scale": 1.0,
            "backward_weights": "forward",
            "inflight": None,
        },
        "evidence": {
            "trial": "s.paci#0",
            "time_to_target": 1.0,
            "reached_target": True,
            "best_val_loss": 2.0,
            "score": 1.0,
            "clock_used": 3.0,
            "partition": (1, 1),
            "steps": 9,
        },
        "verdict": "paci",
        "baseline_schedule": None,
        "comparison": None,
        "target": {"metric": "val_loss", "value": 2.0},
        "budget": {"clock": "sim", "seconds": 3.0, "grid": 3},
        "provenance": {"study_name": "s"},
        "run": {"pipeline": {"schedule": "paci"}},
    }
    best = BestFile.from_doc(doc)
    assert best.recommended.extra == {"inflight": None} and best.evidence is not None and best.evidence.steps == 9
    assert best.comparison is None and best.verdict_record is None and "lr_edges" not in best.keys
    out = best.to_doc()
    assert list(out) == list(doc) and list(out["recommended"]) == list(doc["recommended"])
    assert out["evidence"]["partition"] == [1, 1] and out["comparison"] is None
    legacy = BestFile.from_doc(
        {**doc, "paci_speedup_vs_flush": 2.0, "speedup_note": "x"}
    )  # before issue 53: read, not kept
    assert legacy.to_doc() == out
    write_best(tmp_path / "best.yaml", doc)
    assert yaml.safe_load((tmp_path / "best.yaml").read_text()) == out
