"""The lock that keeps timing checks alone while the rest of the suite runs side by side.

Oracle: flock itself, seen from threads (each hold opens the lock files anew, so two holds in one
process conflict as two processes' would): a shared hold lets another shared one in and keeps an
``alone`` one out until it is released; a waiting ``alone`` hold keeps new shared ones out.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pinning import machine


@pytest.fixture
def config() -> Iterator[types.SimpleNamespace]:
    """What the lock reads of an xdist worker's pytest config: its run's id (a fresh one)."""
    run = f"lock-test-{uuid.uuid4().hex}"
    yield types.SimpleNamespace(workerinput={"testrunuid": run})
    shutil.rmtree(Path(tempfile.gettempdir()) / f"paci-tune-tests-{run}", ignore_errors=True)


def _hold(config: object, *, alone: bool, got: threading.Event, release: threading.Event) -> threading.Thread:
    def body() -> None:
        with machine(config, alone=alone, whole=False):  # type: ignore[arg-type]
            got.set()
            release.wait(30)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def test_shared_holds_overlap_and_an_alone_hold_waits_for_them(config: types.SimpleNamespace) -> None:
    first_in, first_out = threading.Event(), threading.Event()
    first = _hold(config, alone=False, got=first_in, release=first_out)
    assert first_in.wait(10)

    second_in, second_out = threading.Event(), threading.Event()
    second = _hold(config, alone=False, got=second_in, release=second_out)
    assert second_in.wait(10), "two shared holds must overlap"
    second_out.set()
    second.join(10)

    alone_in, alone_out = threading.Event(), threading.Event()
    alone = _hold(config, alone=True, got=alone_in, release=alone_out)
    assert not alone_in.wait(0.5), "an alone hold got in beside a shared one"

    # While it waits, a new shared hold queues behind it (the turnstile), not in front.
    late_in, late_out = threading.Event(), threading.Event()
    late = _hold(config, alone=False, got=late_in, release=late_out)
    assert not late_in.wait(0.5), "a shared hold overtook the waiting alone one"

    first_out.set()
    assert alone_in.wait(10), "the alone hold never got the machine"
    assert not late_in.is_set()
    alone_out.set()
    assert late_in.wait(10)
    late_out.set()
    for t in (first, alone, late):
        t.join(10)


def test_without_xdist_the_lock_is_a_no_op() -> None:
    none = types.SimpleNamespace()
    with machine(none, alone=True), machine(none, alone=True):  # type: ignore[arg-type]
        pass
