"""Two workers that draw one point at once train it once (:func:`paci_tune.tune.repeats.wait_for_earlier`).

Oracles: Optuna's trial states in a real in-memory study, a real ``sleep`` process standing for the
earlier trial's live worker, and a thread that finishes the earlier trial as that worker would. Fails on
the code before wait_for_earlier: the later trial found no finished trial of its point and trained it
again (two searches on one work folder then counted a point twice, CI of 4a713e5).
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from collections.abc import Iterator

import optuna
import pytest
from optuna.trial import TrialState

from paci_tune.tune.liveness import identity, start_time
from paci_tune.tune.record import Claim
from paci_tune.tune.repeats import answer_repeat, wait_for_earlier

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def worker() -> Iterator[Claim]:
    """The claim of another live worker on this machine (a real ``sleep`` process)."""
    me = identity()
    if me.boot is None or me.start is None or me.pidns is None:
        pytest.skip("no /proc here: a claim is judged live by its pid only with the boot id and pid namespace")
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield dataclasses.replace(me, pid=proc.pid, start=start_time(proc.pid), worker="another-worker")
    finally:
        proc.kill()
        proc.wait()


def _drawn(study: optuna.Study, claim: Claim) -> optuna.Trial:
    """The study's next queued point, drawn by the worker ``claim`` names."""
    trial = study.ask()
    trial.suggest_categorical("b", [1, 2])
    claim.write(trial)
    return trial


def _study_with(b: int) -> optuna.Study:
    study = optuna.create_study()
    for _ in range(2):
        study.enqueue_trial({"b": b})
    return study


def test_the_later_trial_waits_for_the_earlier_run_of_its_point_and_is_answered_from_it(worker: Claim) -> None:
    study = _study_with(2)
    earlier, later = _drawn(study, worker), _drawn(study, identity())
    assert earlier.params == later.params == {"b": 2}

    def finish() -> None:
        time.sleep(1.0)
        study.tell(earlier, 0.5)

    threading.Thread(target=finish).start()
    began = time.monotonic()
    wait_for_earlier(study, later, grace=60.0, lost=threading.Event())
    assert time.monotonic() - began >= 0.9, "it did not wait for the earlier trial"
    assert study.trials[earlier.number].state == TrialState.COMPLETE
    told = answer_repeat(study, later)
    assert told is not None and told.state == "complete" and told.value == 0.5
    assert study.trials[later.number].user_attrs["repeat_of"] == earlier.number


def test_the_earlier_trial_never_waits_for_the_later_one(worker: Claim) -> None:
    study = _study_with(1)
    earlier, later = _drawn(study, identity()), _drawn(study, worker)
    began = time.monotonic()
    wait_for_earlier(study, earlier, grace=60.0, lost=threading.Event())
    assert time.monotonic() - began < 0.5
    assert study.trials[later.number].state == TrialState.RUNNING


def test_an_earlier_trial_whose_worker_died_is_not_waited_for(worker: Claim) -> None:
    """Its worker gone (another pid start time: the pid was reused), the later trial trains at once."""
    study = _study_with(1)
    dead = dataclasses.replace(worker, start=(worker.start or 0) + 1)
    _drawn(study, dead)
    later = _drawn(study, identity())
    began = time.monotonic()
    wait_for_earlier(study, later, grace=60.0, lost=threading.Event())
    assert time.monotonic() - began < 0.5
    assert answer_repeat(study, later) is None, "nothing finished to answer from: it must train"


def test_a_trial_of_another_point_does_not_wait_and_a_reaped_one_stops_waiting(worker: Claim) -> None:
    study = optuna.create_study()
    study.enqueue_trial({"b": 1})
    study.enqueue_trial({"b": 2})
    study.enqueue_trial({"b": 1})
    _drawn(study, worker)
    other = _drawn(study, identity())
    same = _drawn(study, identity())
    began = time.monotonic()
    wait_for_earlier(study, other, grace=60.0, lost=threading.Event())
    assert time.monotonic() - began < 0.5
    lost = threading.Event()
    threading.Timer(0.5, lost.set).start()
    wait_for_earlier(study, same, grace=60.0, lost=lost)
    assert lost.is_set()
