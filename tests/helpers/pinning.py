"""pytest plugin (registered by tests/conftest.py): xdist workers pinned to their own CPUs, and the
``whole_machine`` and ``alone`` markers that lend a test more of the machine.

It exists so that tests side by side never oversubscribe a core, and timing tests run with the
machine to themselves; :func:`machine` is also what tests/test_machine_lock.py checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# ------------------------------------------------------------------ tests side by side (pytest-xdist)
# Side by side (``-n auto``, opt-in) the suite runs one worker per CPU, each pinned to its own CPUs: the affinity
# mask its children inherit, by which paci-tune sizes its thread counts, so the trainers, ranks and
# trials of two tests side by side never oversubscribe a core (unpinned, two workers of 2-thread
# trainers on 2 cores spent 40 % more CPU time than one worker and finished no sooner). Two markers
# give a test more: ``whole_machine`` -- every CPU, shared with the other worker (a wall-clock run
# of several devices needs a core each); ``alone`` -- every CPU and no other test beside it (it
# compares timings of this machine). For ``alone``, every other test holds a shared lock on one
# file and the ``alone`` one an exclusive lock; a turnstile taken before either keeps a waiting
# ``alone`` test from being starved by a stream of shared ones.

_ALL_CPUS: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None or not hasattr(os, "sched_setaffinity"):
        return
    _ALL_CPUS[:] = sorted(os.sched_getaffinity(0))
    mine = _ALL_CPUS[int(worker.removeprefix("gw")) % int(count) :: int(count)]
    if mine:
        _pin(mine)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Side by side, modules go to the workers in this order (``--no-loadscope-reorder`` keeps it):
    those holding an ``alone`` test, then for each other worker the module of quick tests with the
    most of them, then those with a ``slow`` test, then the rest. An ``alone`` module waits for the
    test beside it to end, its own CPU idle meanwhile: beside a quick module that is a second; beside
    a slow one it was 81 s (a bench's quick mode), late in the run a docs check of 90 s. And long
    modules early leave the short ones to even out the workers' ends. Serially the order is pytest's own."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return

    def modules(marker: str) -> set[Any]:
        return {item.module for item in items if item.get_closest_marker(marker) is not None}

    alone, slow = modules("alone"), modules("slow")
    sizes: dict[Any, int] = {}
    for item in items:
        if item.module not in alone | slow:
            sizes[item.module] = sizes.get(item.module, 0) + 1
    others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
    beside = set(sorted(sizes, key=sizes.__getitem__, reverse=True)[:others]) if alone else set()
    items.sort(key=lambda item: (item.module not in alone, item.module not in beside, item.module not in slow))


def _pin(cpus: list[int]) -> None:
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


@contextlib.contextmanager
def machine(config: pytest.Config, *, alone: bool, whole: bool = True) -> Iterator[None]:
    """Hold the machine: shared (``alone=False``) or to this test alone, among the xdist workers of
    this run, on every CPU (``whole``) or this worker's own. A no-op without xdist. Never nest two
    holds in one process (flock would deadlock)."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        yield
        return
    root = Path(tempfile.gettempdir()) / f"paci-tune-tests-{worker['testrunuid']}"
    root.mkdir(exist_ok=True)
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    with open(root / "turnstile", "a") as turn, open(root / "machine", "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            if whole and _ALL_CPUS and own != _ALL_CPUS:
                _pin(_ALL_CPUS)
            yield
        finally:
            if whole and own and own != _ALL_CPUS:
                _pin(own)
            fcntl.flock(lock, fcntl.LOCK_UN)


_MODULE_ALONE: list[bool] = []


@pytest.fixture(scope="module", autouse=True)
def _machine_of_this_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module with an ``alone`` test holds the machine alone from its first test to its last, its
    module fixtures included (a calibration is a timing too). Held test by test, the worker beside
    slipped a test of its own in between, and the next ``alone`` test waited for it (38 s measured)."""
    here = [item for item in request.session.items if item.module is request.module]
    if not any(item.get_closest_marker("alone") is not None for item in here):
        yield
        return
    with machine(request.config, alone=True):
        _MODULE_ALONE.append(True)
        try:
            yield
        finally:
            _MODULE_ALONE.clear()


@pytest.fixture(autouse=True)
def _cpus_of_this_test(request: pytest.FixtureRequest) -> Iterator[None]:
    if _MODULE_ALONE:  # the module holds every CPU to itself already
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    whole = alone or request.node.get_closest_marker("whole_machine") is not None
    with machine(request.config, alone=alone, whole=whole):
        yield
