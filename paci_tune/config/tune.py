"""The tuning sections of ``model.yaml``: ``target``, ``budget``, ``hardware`` and ``search``.

A search file is a run configuration (model, data, training, optimizer, lr_schedule, pipeline)
plus these four sections. ``paci-tune train`` accepts the same file and ignores them (after
checking them), so one file describes both the search and the run it tunes. May import:
:mod:`.schema`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from .schema import RunConfig, from_dict, load_run_config

TUNE_SECTIONS = ("target", "budget", "hardware", "search")


@dataclass
class TargetConfig:
    """What "accurate enough" means: the first validation at or below ``value`` ends a trial."""

    metric: Literal["val_loss"] = "val_loss"
    value: float | None = None

    def check(self, key: str) -> None:
        if self.value is None:
            raise ConfigError(f"{key}.value", None, "the validation loss a trial must reach (a positive number)")
        if self.value <= 0:
            raise ConfigError(f"{key}.value", self.value, "a positive number")


@dataclass
class BudgetConfig:
    """Each trial's budget on one clock; the LR schedule decays over it (No Train No Gain).

    ``grid`` validations are spread evenly over the budget; they are the points where a trial is
    reported to Optuna and may be pruned, so every trial is compared at the same clock readings.
    """

    clock: Literal["wall", "rst", "sim"] = "sim"
    seconds: float | None = None
    grid: int = 8
    profile: str | None = None

    def check(self, key: str) -> None:
        if self.seconds is None or self.seconds <= 0:
            raise ConfigError(f"{key}.seconds", self.seconds, "a positive number of seconds on budget.clock")
        if self.grid < 2:
            raise ConfigError(f"{key}.grid", self.grid, "an integer >= 2 (validations over the budget)")
        if self.clock == "rst" and not self.profile:
            raise ConfigError(f"{key}.profile", None, "a cost profile of the reference system for the rst clock")


@dataclass
class HardwareConfig:
    """What a trial may use. ``devices`` is the device budget, required by ``paci-tune search``.

    Every trial uses all of them, on every clock: D = devices / P data-parallel replicas of a
    P-stage pipeline. On the sim and rst clocks the devices are simulated (a budget larger than this
    machine is fine: that is what those clocks are for); on the wall clock the P x D processes run
    here, so the devices must exist (:mod:`paci_tune.tune.setup` checks the GPU or CPU count).
    """

    devices: int | None = None
    runtime: Literal["emulated", "distributed"] | None = None
    device: Literal["auto", "cpu", "cuda"] | None = None
    backend: Literal["auto", "gloo", "nccl"] | None = None

    def check(self, key: str) -> None:
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"{key}.devices", self.devices, "a positive integer")


@dataclass
class ConfirmConfig:
    """Before recommending, train the ``top`` best points of each schedule again on ``seeds`` fresh seeds.

    ``top: 0`` (or ``seeds: 0``) recommends from the search's single draws, as a quick look.
    """

    top: int = 2
    seeds: int = 3

    def check(self, key: str) -> None:
        for name in ("top", "seeds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}", getattr(self, name), "an integer >= 0")

    @property
    def enabled(self) -> bool:
        return self.top > 0 and self.seeds > 0


@dataclass
class SearchConfig:
    """How the study runs. ``trials`` counts per schedule: PACI and the 1F1B-flush baseline get
    the same number of trials, sampler and pruner, so the comparison is fair."""

    space: str = "default"
    trials: int = 20
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Literal["hyperband", "successive_halving", "median", "none"] = "hyperband"
    seed: int = 0
    startup_trials: int | None = None  # random trials before TPE models the results (default: trials // 3)
    stall_seconds: float = 300.0  # a trial silent this long on the wall is a hang
    trial_timeout: float | None = None  # wall seconds a trial may take in all
    retries: int = 1  # times a trial interrupted by a dead worker is run again
    study_name: str | None = None
    confirm: ConfirmConfig = field(default_factory=ConfirmConfig)

    def check(self, key: str) -> None:
        if self.trials < 1:
            raise ConfigError(f"{key}.trials", self.trials, "a positive integer (trials per schedule)")
        if self.startup_trials is not None and self.startup_trials < 0:
            raise ConfigError(f"{key}.startup_trials", self.startup_trials, "an integer >= 0")
        if self.stall_seconds <= 0:
            raise ConfigError(f"{key}.stall_seconds", self.stall_seconds, "a positive number of seconds")
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            raise ConfigError(f"{key}.trial_timeout", self.trial_timeout, "a positive number of seconds")
        if self.retries < 0:
            raise ConfigError(f"{key}.retries", self.retries, "an integer >= 0")
        self.confirm.check(f"{key}.confirm")


@dataclass
class TuneConfig:
    """A whole search: the run it tunes (``run_doc``, as written) and the four tuning sections."""

    run_doc: dict[str, Any]
    run: RunConfig
    target: TargetConfig = field(default_factory=TargetConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


def split_tune_sections(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run sections, tuning sections) of a parsed ``model.yaml``."""
    run = {k: v for k, v in doc.items() if k not in TUNE_SECTIONS}
    tune = {k: v for k, v in doc.items() if k in TUNE_SECTIONS}
    return run, tune


def parse_tune_sections(tune: dict[str, Any], *, require: bool) -> dict[str, Any]:
    """Validate the tuning sections; with ``require`` the search's must-haves too."""
    out = {
        "target": from_dict(TargetConfig, tune.get("target"), "target"),
        "budget": from_dict(BudgetConfig, tune.get("budget"), "budget"),
        "hardware": from_dict(HardwareConfig, tune.get("hardware"), "hardware"),
        "search": from_dict(SearchConfig, tune.get("search"), "search"),
    }
    out["hardware"].check("hardware")
    out["search"].check("search")
    if require:
        out["target"].check("target")
        out["budget"].check("budget")
        if out["hardware"].devices is None:
            allowed = "the device budget of every trial, a positive integer (P x D = devices), e.g. 4"
            raise ConfigError("hardware.devices", None, allowed)
    return out


def load_tune_config(doc: Any, path: str = "config") -> TuneConfig:
    """Validate a parsed search file: its run sections as a run, then the tuning sections."""
    if not isinstance(doc, dict):
        raise ConfigError("config", path, "a YAML mapping with sections model, data, training, ..., target, budget")
    run_doc, tune = split_tune_sections(doc)
    run = load_run_config(run_doc)
    return TuneConfig(run_doc=run_doc, run=run, **parse_tune_sections(tune, require=True))
