"""The written contracts hold: both runtimes are :class:`Runtime` s, both clocks :class:`Clock` s.

Oracle: the Protocol classes themselves, read with ``inspect`` -- every member a Protocol declares
exists on each implementation: a method with the same parameters (names, kinds, defaults,
annotations; its return may be narrower), a property or attribute as a non-callable. And the training
loop asks of its runtime and clock nothing the contracts do not promise (its ``self.runtime.X``
and ``self.clock.X`` reads, parsed with ``ast``). In-process, nothing is run.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from paci_tune.config.layout import Layout
from paci_tune.pipeline.distributed import DistributedRuntime
from paci_tune.pipeline.emulated import EmulatedRuntime
from paci_tune.pipeline.runtime import Runtime
from paci_tune.pipeline.torch_schedules import TorchScheduleRuntime
from paci_tune.train import loop
from paci_tune.train.clock import Clock, ProfileClock, WallClock


def _members(proto: type) -> dict[str, object]:
    """What ``proto`` declares: its methods and properties, and its annotated attributes (as None)."""
    out: dict[str, object] = {k: v for k, v in vars(proto).items() if not k.startswith("_")}
    out.update(dict.fromkeys(k for k in vars(proto).get("__annotations__", {}) if k not in out))
    return out


def _params(fn: object) -> list[tuple]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def _attribute(cls: type, name: str, instance: object | None) -> object:
    if name in getattr(cls, "__dict__", {}) or any(name in vars(b) for b in cls.__mro__):
        return inspect.getattr_static(cls, name)
    assert instance is not None and hasattr(instance, name), f"{cls.__name__} has no {name}"
    return getattr(instance, name)


def _check(proto: type, cls: type, instance: object | None = None) -> None:
    for name, declared in _members(proto).items():
        have = _attribute(cls, name, instance)
        if inspect.isfunction(declared):
            assert inspect.isfunction(have), f"{cls.__name__}.{name} is not a method"
            assert _params(have) == _params(declared), (
                f"{cls.__name__}.{name}{inspect.signature(have)} != {name}{inspect.signature(declared)}"
            )
        else:
            assert isinstance(have, property) or not callable(have), f"{cls.__name__}.{name} is a method, not a value"


@pytest.mark.parametrize("cls", [EmulatedRuntime, DistributedRuntime, TorchScheduleRuntime])
def test_each_runtime_keeps_the_runtime_contract(cls: type) -> None:
    assert _members(Runtime), "the Protocol declares nothing"
    _check(Runtime, cls)


def test_each_clock_keeps_the_clock_contract() -> None:
    from paci_tune.sim.profile import P2PCost, Profile, UnitCost, UnitProfile

    _check(Clock, WallClock, WallClock())
    unit = UnitProfile("u", 4, 0.001, {1: UnitCost(0.001, 0.002, 8, 8)})
    prof = Profile([unit, unit], P2PCost(0.0, float("inf")), seq_len=8)
    clock = ProfileClock("sim", prof, Layout("paci", 2, window=2, microbatch_size=1, partition=(1, 1)))
    _check(Clock, ProfileClock, clock)


def _reads(attr: str) -> set[str]:
    """Names the trainer reads off ``self.<attr>``."""
    tree = ast.parse(Path(loop.__file__).read_text())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == attr
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "self"
    }


@pytest.mark.parametrize(("attr", "proto"), [("runtime", Runtime), ("clock", Clock)])
def test_the_trainer_asks_only_what_the_contract_promises(attr: str, proto: type) -> None:
    used = _reads(attr)
    assert used, f"the trainer reads nothing off self.{attr}: the check looks at the wrong thing"
    assert used <= set(_members(proto)), f"not in {proto.__name__}: {sorted(used - set(_members(proto)))}"
