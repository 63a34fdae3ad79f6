"""A dead worker's trial, enqueued again, is owed a run whatever the quota says.

Two workers that each stop at the quota can together pass it; the survivor must still run the retry of
the trial the other died in, or it waits forever (the multi-worker PostgreSQL test found this). Oracle:
Optuna's own trial states, set up by hand here.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from paci_tune.tune.record import RETRY_OF
from paci_tune.tune.study import retry_waiting


def _study() -> optuna.Study:
    study = optuna.create_study()
    dead = study.ask()
    study.tell(dead, state=TrialState.FAIL)
    return study


def test_an_enqueued_retry_of_a_failed_trial_is_owed() -> None:
    study = _study()
    assert not retry_waiting(study)
    study.enqueue_trial({}, user_attrs={RETRY_OF: 0})
    assert retry_waiting(study)
    trial = study.ask()  # the survivor runs it: then nothing is owed
    study.tell(trial, 1.0)
    assert not retry_waiting(study)


def test_a_queued_trial_that_retries_nothing_is_not_owed() -> None:
    study = _study()
    study.enqueue_trial({"x": 1})
    assert not retry_waiting(study)
