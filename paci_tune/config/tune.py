"""The tuning sections of ``model.yaml``: ``target``, ``budget``, ``hardware`` and ``search``.

A search file is a run configuration (model, data, training, optimizer, lr_schedule, pipeline)
plus these four sections. ``paci-tune train`` accepts the same file and ignores them (after
checking them), so one file describes both the search and the run it tunes. A space whose
``schedules`` names one the simulator times (:data:`~.schema.TIMED_SCHEDULES`: those built as
torch's classes order them) is refused here, before any trial starts, where its trials could not
run it: on the wall clock on the emulated runtime (they run for real on the distributed runtime, through
torch's own classes; the space's other values are :mod:`paci_tune.tune.space`'s to check). May import:
:mod:`.schema`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..base.files import read_yaml
from ..base.shipped import resolve_path, shipped, shipped_dir, shipped_names
from ..errors import ConfigError
from .schema import TIMED_ONLY, TIMED_SCHEDULES, RunConfig, from_dict, load_run_config

TUNE_SECTIONS = ("target", "budget", "hardware", "search")
MAX_CONFIRM = 1000
"""Confirmed points and seeds: each one is a training run per schedule; more is not a search."""
MAX_GRID = 10_000
"""Pruner rungs per trial: each is an Optuna report and a validation; beyond this a trial is all evaluation."""
MAX_TRANSFER_TOP = 50
"""Points per schedule a transfer check trains at the longer budget: each costs ``factor`` trials."""
MAX_TRANSFER_FACTOR = 100.0
MAX_JOBS = 256
"""Trials one worker runs side by side: each is a process with its threads; past this, more workers."""
MAX_DRIFT = 4096
"""A drift bound is below the pipeline depth; one beyond any depth is a typo."""
PACI_MAX_DRIFT: int | None = None
"""The default ``search.paci_max_drift``: off. The statistical-efficiency map (docs/benchmarks.md)
found no drift bound that separates the PACI points that can win from those that cannot: at its
short budgets the depth decided (P = 4 at bound 1 lost like P = 8 at bound 7), so a cut on the
bound would drop nothing that a cut should. The knob is for a user whose own map shows one."""


@dataclass
class TargetConfig:
    """What "accurate enough" means: the first validation at or below ``value`` ends a trial."""

    metric: Literal["val_loss"] = "val_loss"
    value: float | None = None

    def check(self, key: str, require: bool = True) -> None:
        if self.value is None:
            if require:
                raise ConfigError(f"{key}.value", None, "the validation loss a trial must reach (a positive number)")
        elif self.value <= 0:
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

    def check(self, key: str, require: bool = True) -> None:
        if (self.seconds is None and require) or (self.seconds is not None and self.seconds <= 0):
            raise ConfigError(f"{key}.seconds", self.seconds, "a positive number of seconds on budget.clock")
        if self.grid < 2:
            raise ConfigError(f"{key}.grid", self.grid, "an integer >= 2 (validations over the budget)")
        if self.grid > MAX_GRID:
            raise ConfigError(f"{key}.grid", self.grid, f"at most {MAX_GRID} validations over the budget")
        if self.clock == "rst" and not self.profile:
            raise ConfigError(f"{key}.profile", None, "a cost profile of the reference system for the rst clock")
        if self.profile is not None:  # profiles/NAME.yaml not found here: the shipped reference profile
            self.profile = str(resolve_path(self.profile))
            if not Path(self.profile).is_file():
                raise ConfigError(f"{key}.profile", self.profile, "an existing profile file (paci-tune calibrate)")


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

    MAX_DEVICES = 65_536  # more than any machine room; a simulated budget beyond it is a typo

    def check(self, key: str) -> None:
        if self.devices is not None and not 1 <= self.devices <= self.MAX_DEVICES:
            raise ConfigError(f"{key}.devices", self.devices, f"a positive integer up to {self.MAX_DEVICES}")


@dataclass
class ConfirmConfig:
    """Before recommending, train the ``top`` best points of each schedule again on fresh seeds: at least
    ``seeds``, then one paired seed more per look until PACI-vs-baseline is decided by the sequential paired
    t-test (its interval excludes 1, or is narrower than ``tolerance`` x its point estimate) or ``max_seeds``
    is reached (:mod:`paci_tune.tune.rounds`, :mod:`paci_tune.tune.comparison`). The verdict compares each
    side's best point as the search ranked it; the others are confirmed for the table.

    ``top: 0`` (or ``seeds: 0``) recommends from the search's single draws, as a quick look (no interval).
    """

    top: int = 1
    seeds: int = 3  # the minimum: every confirmation runs at least these
    max_seeds: int | None = None  # the cap (None: DEFAULT_MAX_SEEDS, or ``seeds`` when more)
    tolerance: float = 0.1  # an interval narrower than this x its point estimate counts as decided (a tie)

    DEFAULT_MAX_SEEDS = 8  # with the example's noise a 1.2x difference is decided 9 times in 10 within it

    def check(self, key: str) -> None:
        for name in ("top", "seeds"):
            if not 0 <= getattr(self, name) <= MAX_CONFIRM:
                raise ConfigError(f"{key}.{name}", getattr(self, name), f"an integer in [0, {MAX_CONFIRM}]")
        if self.max_seeds is not None and not max(self.seeds, 2) <= self.max_seeds <= MAX_CONFIRM:
            raise ConfigError(
                f"{key}.max_seeds",
                self.max_seeds,
                f"an integer in [{max(self.seeds, 2)}, {MAX_CONFIRM}]: at least {key}.seeds = "
                f"{self.seeds}, and at least 2 (a paired t-test needs two seeds to decide)",
            )
        if not (isinstance(self.tolerance, (int, float)) and 0 < self.tolerance <= 10):
            raise ConfigError(
                f"{key}.tolerance",
                self.tolerance,
                "a number in (0, 10]: the relative interval width below which the confirmation stops adding seeds",
            )

    @property
    def cap(self) -> int:
        """The most seeds a confirmation runs: ``max_seeds``, or the default cap (at least ``seeds``)."""
        return self.max_seeds if self.max_seeds is not None else max(self.DEFAULT_MAX_SEEDS, self.seeds)

    @property
    def enabled(self) -> bool:
        return self.top > 0 and self.seeds > 0


@dataclass
class TransferConfig:
    """After the search, train the ``top`` best distinct points of each schedule once more at ``factor``
    times the trial budget, and write how well the short trials' ranking predicts the long runs'
    (Spearman's rank correlation, :mod:`paci_tune.verdict.transfer`). ``top: 0`` (the default): off.
    """

    top: int = 0
    factor: float = 4.0

    def check(self, key: str) -> None:
        if not 0 <= self.top <= MAX_TRANSFER_TOP:
            raise ConfigError(f"{key}.top", self.top, f"an integer in [0, {MAX_TRANSFER_TOP}] (0: off)")
        if not 1.0 < self.factor <= MAX_TRANSFER_FACTOR:
            why = f"a number in (1, {MAX_TRANSFER_FACTOR:g}]: the longer runs' budget over the trials'"
            raise ConfigError(f"{key}.factor", self.factor, why)

    @property
    def enabled(self) -> bool:
        return self.top > 0


MAX_WARM_STEPS = 10**9


@dataclass
class WarmStartConfig:
    """Start every trial from a checkpoint of the run being tuned instead of from step 0
    (:mod:`paci_tune.tune.warm`): ``steps: N`` trains N steps of the config as written with a
    1F1B-flush schedule once, before the first trial; ``checkpoint: PATH`` names one of the user's
    run in progress (any layout). ``dir``: where the warm-up's checkpoint goes (default: beside a
    file storage, else in the work folder); workers on other machines need it on a shared file
    system. Neither given: off (trials start from scratch).
    """

    steps: int | None = None
    checkpoint: str | None = None
    dir: str | None = None

    def check(self, key: str) -> None:
        if self.steps is not None and self.checkpoint is not None:
            raise ConfigError(
                f"{key}.checkpoint",
                self.checkpoint,
                f"absent when {key}.steps is given (one or the other: train a warm-up, or start from a checkpoint)",
            )
        if self.steps is not None and not 1 <= self.steps <= MAX_WARM_STEPS:
            raise ConfigError(
                f"{key}.steps", self.steps, f"an integer in [1, {MAX_WARM_STEPS}]: the warm-up's global batches"
            )
        if self.checkpoint is not None:
            found = Path(self.checkpoint).expanduser()
            if not ((found / "meta.json").is_file() or (found / "LATEST").is_file()):
                raise ConfigError(
                    f"{key}.checkpoint",
                    self.checkpoint,
                    "a checkpoint folder (with meta.json) or a "
                    "checkpoint root with LATEST (paci-tune train --checkpoint-dir)",
                )
            self.checkpoint = str(found.resolve())
        if self.dir is not None and self.steps is None:
            with_what = f"with {key}.checkpoint" if self.checkpoint is not None else f"without {key}.steps"
            raise ConfigError(f"{key}.dir", self.dir, f"absent {with_what} (nothing is trained)")
        if self.dir is not None and not (isinstance(self.dir, str) and self.dir.strip()):
            raise ConfigError(f"{key}.dir", self.dir, "a folder for the warm-up's checkpoint")

    @property
    def enabled(self) -> bool:
        return self.steps is not None or self.checkpoint is not None

    def describe(self) -> dict[str, Any]:
        """What identifies the warm start in a search's fingerprint."""
        return {"steps": self.steps} if self.steps is not None else {"checkpoint": self.checkpoint}


@dataclass
class SearchConfig:
    """How the study runs. ``trials`` counts per schedule: PACI and the 1F1B-flush baseline get
    the same number of trials, sampler and pruner, so the comparison is fair."""

    space: str = "default"
    trials: int = 20
    # How a study picks its next point: "sample" (the sampler and pruner below) or "predict" (every layout priced
    # by the simulator, PACI's steps to target predicted from the synchronous curve, the candidates that could
    # beat the best trained: paci_tune.tune.planner; sim and rst clocks with shared curves)
    strategy: Literal["sample", "predict"] = "sample"
    verify_z: float = 1.0  # predict: standard deviations of optimism a candidate must beat the best with
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Literal["hyperband", "successive_halving", "median", "none"] = "hyperband"
    seed: int = 0
    startup_trials: int | None = None  # random trials before TPE models the results (default: max(2, trials // 3))
    stall_seconds: float = 300.0  # a trial silent this long on the wall is a hang
    trial_timeout: float | None = None  # wall seconds a trial may take in all
    retries: int = 1  # times a trial interrupted by a dead worker is run again
    # Seconds a running trial's heartbeat may stay unchanged, as another worker watches it, before its worker is
    # judged dead (any host; paci_tune.tune.liveness). A worker that has not watched it yet: its age on the wall
    # clock past grace + 60 s, so hosts' clocks may differ by up to 60 s (liveness.MAX_SKEW_S)
    heartbeat_grace: float = 60.0
    paci_max_drift: int | None = PACI_MAX_DRIFT  # PACI points with a larger drift bound are skipped; None: none
    study_name: str | None = None
    share_curves: bool = True  # on the sim and rst clocks: one training per curve (paci_tune.tune.sharing)
    # With shared curves: each curve a study trains is read on every other point of its space it holds
    # (paci_tune.tune.siblings); false: only on the points its sampler proposes
    every_layout: bool = True
    # With shared curves: validate every step-grid point only near the target (training.eval_far_every,
    # paci_tune.train.nearness); false: at every one, the whole run
    validate_near_target: bool = True
    # Stop a search trial once its clock passes the score of the study's k-th best point (k: confirm.top,
    # transfer_check.top, at least 1) without reaching the target (paci_tune.tune.capping); false: never
    adaptive_capping: bool = True
    # Trials this worker runs side by side ("auto": paci_tune.tune.setup.side_by_side); the sim and rst clocks only
    jobs: Literal["auto"] | int = "auto"
    confirm: ConfirmConfig = field(default_factory=ConfirmConfig)
    transfer_check: TransferConfig = field(default_factory=TransferConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

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
        if not 0 <= self.verify_z <= 5:
            raise ConfigError(f"{key}.verify_z", self.verify_z, "a number in [0, 5] (standard deviations)")
        if not 10 <= self.heartbeat_grace <= 86_400:
            why = "seconds in [10, 86400] (workers beat every 5 s: a live one must not look dead)"
            raise ConfigError(f"{key}.heartbeat_grace", self.heartbeat_grace, why)
        if self.paci_max_drift is not None and not 1 <= self.paci_max_drift <= MAX_DRIFT:
            why = f"null (keep every PACI point) or an integer in [1, {MAX_DRIFT}]: the largest drift bound PACI tries"
            raise ConfigError(f"{key}.paci_max_drift", self.paci_max_drift, why)
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"{key}.seed", self.seed, "an integer in [0, 2**32) (the samplers' seed)")
        if self.study_name is not None and (not self.study_name.strip() or "/" in self.study_name):
            raise ConfigError(f"{key}.study_name", self.study_name, "a non-empty name without '/'")
        if self.jobs != "auto" and not (isinstance(self.jobs, int) and 1 <= self.jobs <= MAX_JOBS):
            why = f"auto or an integer in [1, {MAX_JOBS}]: trials this worker runs side by side"
            raise ConfigError(f"{key}.jobs", self.jobs, why)
        if not space_exists(self.space):
            names = ", ".join(shipped_names("search_spaces"))
            raise ConfigError(f"{key}.space", self.space, f"a YAML file or one of the shipped spaces: {names}")
        self.confirm.check(f"{key}.confirm")
        self.transfer_check.check(f"{key}.transfer_check")
        self.warm_start.check(f"{key}.warm_start")


@dataclass
class TuneConfig:
    """A whole search: the run it tunes (``run_doc``, as written) and the four tuning sections."""

    run_doc: dict[str, Any]
    run: RunConfig
    target: TargetConfig = field(default_factory=TargetConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


def space_exists(name: str) -> bool:
    """What :func:`paci_tune.tune.space.resolve_space_path` finds: a file, or a shipped space's name."""
    return _space_file(name) is not None


def _space_file(name: str) -> Path | None:
    p = resolve_path(name)
    if not name.strip():
        return None
    return p if p.is_file() else shipped("search_spaces", name) if p.suffix not in (".yaml", ".yml") else None


def check_timed_schedules(search: SearchConfig, budget: BudgetConfig, hardware: HardwareConfig) -> None:
    """Refuse a space whose trials would run a schedule where it cannot run: a timed one on the
    wall clock on the emulated runtime (it trains 1F1B-flush's numbers there, timed by the simulator on
    the sim/rst clocks; both run for real only on the distributed runtime, through torch's own classes).
    A shipped space names every synchronous schedule the layers support, and binding it leaves these out
    there (:func:`paci_tune.tune.narrow.skip_untimed`). A space file that does not parse is left to the
    space's loader."""
    path = _space_file(search.space)
    if path is not None and path.resolve() in {p.resolve() for p in shipped_dir("search_spaces").glob("*.yaml")}:
        return
    doc = read_yaml(path, "search.space") if path is not None else None
    schedules = doc.get("schedules") if isinstance(doc, dict) else None
    timed = [s for s in schedules if s in TIMED_SCHEDULES] if isinstance(schedules, list) else []
    wall = budget.clock == "wall"
    runtime = hardware.runtime or ("distributed" if wall else "emulated")  # what a trial runs on
    if timed and wall and runtime == "emulated":
        raise ConfigError(
            "space.schedules",
            schedules,
            f"{' and '.join(timed)} on the wall clock only on the "
            f"distributed runtime ({TIMED_ONLY}); hardware.runtime is emulated",
        )


def check_strategy(search: SearchConfig, budget: BudgetConfig) -> None:
    """``predict`` reads every layout off a curve trained once: it needs shared curves, hence a budget in
    seconds of the sim or rst clock (:mod:`paci_tune.tune.sharing`)."""
    if search.strategy != "predict":
        return
    if budget.clock == "wall" or not search.share_curves:
        why = "sample on the wall clock or without search.share_curves: predict reads each layout off a shared curve"
        raise ConfigError("search.strategy", search.strategy, why)
    if search.sampler == "grid":
        raise ConfigError("search.strategy", search.strategy, "sample with search.sampler: grid (a grid plans itself)")


RUN_HARDWARE_KEYS = ("memory",)
"""Keys of ``hardware`` that belong to the run (:class:`paci_tune.config.memory.RunHardware`): ``train``
and ``apply`` keep to the device memory as a search does; the other keys only say what trials use."""


def split_tune_sections(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run sections, tuning sections) of a parsed ``model.yaml``; ``hardware.memory`` goes with the run."""
    run = {k: v for k, v in doc.items() if k not in TUNE_SECTIONS}
    tune = {k: v for k, v in doc.items() if k in TUNE_SECTIONS}
    hardware = tune.get("hardware")
    if isinstance(hardware, dict) and any(k in hardware for k in RUN_HARDWARE_KEYS):
        run["hardware"] = {k: v for k, v in hardware.items() if k in RUN_HARDWARE_KEYS}
        tune["hardware"] = {k: v for k, v in hardware.items() if k not in RUN_HARDWARE_KEYS}
    return run, tune


def parse_tune_sections(tune: dict[str, Any], *, require: bool) -> dict[str, Any]:
    """Validate the tuning sections; with ``require`` the search's must-haves too.

    Every value that is given is checked either way: ``paci-tune train`` ignores these sections,
    but a file it accepts must be one ``paci-tune search`` accepts too (up to what only a search needs).
    """
    out = {
        "target": from_dict(TargetConfig, tune.get("target"), "target"),
        "budget": from_dict(BudgetConfig, tune.get("budget"), "budget"),
        "hardware": from_dict(HardwareConfig, tune.get("hardware"), "hardware"),
        "search": from_dict(SearchConfig, tune.get("search"), "search"),
    }
    out["hardware"].check("hardware")
    out["search"].check("search")
    out["target"].check("target", require)
    out["budget"].check("budget", require)
    check_timed_schedules(out["search"], out["budget"], out["hardware"])
    check_strategy(out["search"], out["budget"])
    if out["budget"].clock == "wall" and out["search"].jobs not in (1, "auto"):
        why = "1 or auto on the wall clock: a wall-clock trial times itself, and a trial beside it would slow it"
        raise ConfigError("search.jobs", out["search"].jobs, why)
    if require and out["hardware"].devices is None:
        allowed = "the device budget of every trial, a positive integer (P x D = devices), e.g. 4"
        raise ConfigError("hardware.devices", None, allowed)
    return out


def load_tune_config(doc: Any, path: str = "config") -> TuneConfig:
    """Validate a parsed search file: its run sections as a run, then the tuning sections."""
    if not isinstance(doc, dict):
        raise ConfigError("config", path, "a YAML mapping with sections model, data, training, ..., target, budget")
    run_doc, tune = split_tune_sections(doc)
    run = load_run_config(run_doc)
    sections = parse_tune_sections(tune, require=True)
    check_warm_up_reaches_peak(run, sections["search"].warm_start)
    return TuneConfig(run_doc=run_doc, run=run, **sections)


def check_warm_up_reaches_peak(run: RunConfig, warm: WarmStartConfig) -> None:
    """Refuse a warm-up that ends inside the run's LR ramp.

    The warm-up ramps the LR as the run would (``warmup_fraction`` of ``training.steps``) and holds the
    peak after (:func:`paci_tune.tune.warm.warm_up_doc`); every trial then starts at the peak. A
    warm-up shorter than the ramp would hand the trials a checkpoint trained at a fraction of the
    LR they jump to, which is not a point of the run being tuned.
    """
    steps, total = warm.steps, run.training.steps
    if steps is None or total is None:  # no warm-up, or a budget in seconds: the ramp is the warm-up's own
        return
    ramp = run.lr_schedule.warmup_fraction * total
    if ramp >= steps:
        raise ConfigError(
            "search.warm_start.steps",
            steps,
            f"more than the run's LR warm-up, {ramp:g} global "
            f"batches (lr_schedule.warmup_fraction {run.lr_schedule.warmup_fraction:g} x "
            f"training.steps {total}): the warm-up must reach the peak LR of the trials",
        )
