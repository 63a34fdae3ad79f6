"""Run configuration: the schema of ``model.yaml`` and its validation.

Every bad value is caught here, before any process starts, with a message that names the dotted
key, the value and what is allowed (:class:`~paci_tune.errors.ConfigError`). Sections map onto
dataclasses, built by the typed parsing of :mod:`.parsing`; ``model`` and ``data`` stay plain dicts
because their keys depend on the chosen preset or source and are validated by the loaders that own them.

A :class:`RunConfig` is frozen and checked when it is built (``__post_init__``): one that exists is
valid, window and micro-batch size are both known integers, and nothing downstream can change it
-- a different run is a new config (:func:`paci_tune.config.derive_run`). What each schedule allows
is the schedule registry's (:mod:`paci_tune.schedule`). May import: :mod:`paci_tune.errors`,
:mod:`paci_tune.schedule` and the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..schedule import NAMES, schedule_of
from .layout import Layout
from .memory import RunHardware  # hardware.memory: the device budget a run keeps to
from .optimizer import OptimizerConfig  # the optimizer section's own module
from .parsing import from_dict  # typed parsing of any section (re-exported: callers import it from here)

ScheduleName = Literal[NAMES]  # type: ignore[valid-type]  # every name in the schedule registry
TIMED_SCHEDULES: tuple[str, ...] = tuple(n for n in NAMES if not schedule_of(n).own_program)
"""Schedules the emulated runtime trains with 1F1B-flush's numerics while a profile clock (``sim``,
``rst``) times their own action lists: those built as torch's classes order them (the registry's
builders). They also run for real on the distributed runtime, through torch's own classes."""
TIMED_ONLY = (
    "the emulated runtime trains 1F1B's numbers for it, timed by the simulator on the sim/rst clocks; "
    "it runs for real with pipeline.runtime: distributed"
)
TORCH_RUN: tuple[str, ...] = tuple(n for n in NAMES if schedule_of(n).torch_class is not None)
"""Schedules the distributed runtime can run through torch's own classes (``1f1b`` only with
``pipeline.torch_schedule``; paci-tune's own 1F1B otherwise)."""


BackwardWeights = Literal["forward", "current"]
BACKWARD_WEIGHTS: tuple[str, ...] = typing.get_args(BackwardWeights)
"""``pipeline.backward_weights``'s values, the one list every layer checks against: what an in-flight
micro-batch's backward reads under PACI (its forward's weights, or the current ones)."""


@dataclass(frozen=True)
class LRScheduleConfig:
    """Linear warm-up, then cosine decay to ``min_ratio`` of peak over the whole budget.

    The peak LR is ``optimizer.lr`` at ``reference_batch`` sequences, scaled by sqrt (or linearly)
    with the global batch, as the PACI paper scales 3e-4 at batch 256.
    """

    warmup_fraction: float = 0.01
    min_ratio: float = 0.1
    reference_batch: int | None = None
    scaling: Literal["sqrt", "linear", "none"] = "sqrt"
    # Decay over this many steps from the run's first, whatever the budget; null: over the budget. On a
    # budget in seconds the schedule otherwise reads the run's own clock, so every layout decays at its
    # own pace and trains its own curve; a common horizon in steps lets layouts share one (tune/curves.py).
    horizon_steps: int | None = None

    def __post_init__(self) -> None:
        self.check("lr_schedule")

    def check(self, key: str) -> None:
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ConfigError(f"{key}.warmup_fraction", self.warmup_fraction, "a number in [0, 1)")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ConfigError(f"{key}.min_ratio", self.min_ratio, "a number in [0, 1]")
        if self.reference_batch is not None:
            _positive(f"{key}.reference_batch", self.reference_batch)
        if self.horizon_steps is not None:
            _positive(f"{key}.horizon_steps", self.horizon_steps)


@dataclass(frozen=True)
class TrainingConfig:
    global_batch: int = 32
    steps: int | None = None
    seconds: float | None = None
    seed: int = 0
    eval_every: int = 50
    eval_every_seconds: float | None = None  # evaluate on a grid of the clock instead of every N steps
    # Far from the target, validate only every this many steps (a multiple of eval_every); every eval_every
    # once near it (paci_tune.train.nearness): time to target at eval_every's resolution, for fewer validations.
    eval_far_every: int | None = None
    eval_sequences: int = 256  # the validation set: the same sequences for every run of a model and data
    eval_microbatch_size: int = 32  # sequences per evaluation forward (memory, not what is measured)
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    target_val_loss: float | None = None
    clock: Literal["wall", "rst", "sim"] = "wall"
    profile: str | None = None
    init_from: str | None = None  # a checkpoint (of any layout) this run starts from (train/checkpoint.reshard)

    def __post_init__(self) -> None:
        self.check("training")

    def check(self, key: str) -> None:
        _positive(f"{key}.global_batch", self.global_batch)
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"{key}.seed", self.seed, "an integer in [0, 2**63)")
        if self.steps is None and self.seconds is None:
            raise ConfigError(f"{key}.steps", None, "a budget: training.steps or training.seconds")
        if self.steps is not None:
            _positive(f"{key}.steps", self.steps)
        if self.seconds is not None:
            _positive(f"{key}.seconds", self.seconds)
        _positive(f"{key}.eval_every", self.eval_every)
        if self.eval_every_seconds is not None:
            _positive(f"{key}.eval_every_seconds", self.eval_every_seconds)
        if self.eval_far_every is not None:
            _positive(f"{key}.eval_far_every", self.eval_far_every)
            if self.eval_far_every % self.eval_every:
                raise ConfigError(
                    f"{key}.eval_far_every",
                    self.eval_far_every,
                    f"null or a multiple of training.eval_every ({self.eval_every})",
                )
            if self.eval_every_seconds is not None:
                raise ConfigError(
                    f"{key}.eval_far_every",
                    self.eval_far_every,
                    "null when training.eval_every_seconds sets a clock grid",
                )
        _positive(f"{key}.eval_sequences", self.eval_sequences)
        _positive(f"{key}.eval_microbatch_size", self.eval_microbatch_size)
        if self.checkpoint_every < 0:
            raise ConfigError(
                f"{key}.checkpoint_every", self.checkpoint_every, "0 (off) or a positive number of batches"
            )
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(f"{key}.checkpoint_dir", None, "a folder, needed when checkpoint_every > 0")
        _positive(f"{key}.keep_checkpoints", self.keep_checkpoints)
        if self.target_val_loss is not None and not (math.isfinite(self.target_val_loss) and self.target_val_loss > 0):
            raise ConfigError(f"{key}.target_val_loss", self.target_val_loss, "null or a positive, finite loss")
        if self.clock == "rst" and not self.profile:
            raise ConfigError(
                f"{key}.profile", None, "a cost profile of the reference system (paci-tune calibrate) for the rst clock"
            )
        if self.init_from is not None and not (isinstance(self.init_from, str) and self.init_from.strip()):
            raise ConfigError(f"{key}.init_from", self.init_from, "null or a checkpoint folder (or root with LATEST)")


STALENESS_KEYS = ("stage_momentum", "predict_weights", "stale_lr")
"""PACI's per-stage staleness controls in ``pipeline`` (:mod:`paci_tune.pipeline.staleness`)."""


@dataclass(frozen=True)
class PipelineConfig:
    schedule: ScheduleName = "paci"
    stages: int = 1
    window: int = 4  # in a file: derived from microbatch_size, 4 when neither is given
    microbatch_size: int = 8  # in a file: training.global_batch / (data_parallel * window)
    data_parallel: int = 1  # D replicas of the P-stage pipeline, on P x D devices
    inflight: int | None = None
    partition: Literal["auto"] | list[int] = "auto"
    runtime: Literal["emulated", "distributed"] = "emulated"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # PACI: what an in-flight micro-batch's backward reads -- the weights its forward used (one copy per
    # version still needed, as the reference code's autocast casts did), or the current ones (no copy).
    backward_weights: BackwardWeights = "forward"
    # v model chunks per stage: interleaved 1F1B's (null: DEFAULT_CHUNKS); fixed by the others (1; 2 for a V).
    chunks: int | None = None
    # Run the schedule through torch.distributed.pipelining's own class (distributed runtime; zb-h1 always does).
    torch_schedule: bool = False
    # PACI's staleness controls (pipeline/staleness.py), each acting at stage s by its bound tau_s = ceil((P-s-1)/a):
    stage_momentum: float | None = None  # beta1_max: beta1_s = beta1 + tau_s (beta1_max - beta1) / P; null: off
    predict_weights: bool = False  # forwards run on W - lr tau_s Delta (the optimizer's last step, extrapolated)
    stale_lr: float | None = None  # PipeMare's horizon T (a fraction of the budget): lr / tau_s^(1 - min(t/T, 1))

    def __post_init__(self) -> None:
        self.check("pipeline")

    def check(self, key: str) -> None:
        self.layout.check()
        spec = schedule_of(self.schedule)
        if self.chunks is not None and spec.chunks is not None and self.chunks != spec.chunks:
            why = f"null or {spec.chunks} for schedule {self.schedule} (it runs {spec.chunks} chunk(s) per stage)"
            raise ConfigError(f"{key}.chunks", self.chunks, why)
        if (why_not := spec.refusal(self.stages, self.window, self.layout.chunks)) is not None:
            setting, why = why_not
            raise ConfigError(f"{key}.{setting}", getattr(self, setting), why)
        if self.torch_schedule and not (self.runtime == "distributed" and self.schedule in TORCH_RUN):
            why = f"false unless pipeline.runtime is distributed and the schedule one of {', '.join(TORCH_RUN)}"
            raise ConfigError(f"{key}.torch_schedule", self.torch_schedule, f"{why} (torch's own classes)")
        if self.runs_torch_schedule:
            self._check_torch(key)
        self._check_staleness(key)

    def _check_staleness(self, key: str) -> None:
        """PACI's staleness controls: valid values, and PACI only (a synchronous schedule's are never late)."""
        if self.stage_momentum is not None and not 0.0 < self.stage_momentum < 1.0:
            raise ConfigError(
                f"{key}.stage_momentum",
                self.stage_momentum,
                "null or a number in (0, 1): the momentum of the stalest stage's limit (0.99 in Ajanthan et al.)",
            )
        if self.stale_lr is not None and not 0.0 < self.stale_lr <= 1.0:
            raise ConfigError(
                f"{key}.stale_lr",
                self.stale_lr,
                "null or a number in (0, 1]: PipeMare's horizon as a fraction of the budget",
            )
        if schedule_of(self.schedule).synchronous:
            for name in STALENESS_KEYS:
                value = getattr(self, name)
                if value not in (None, False):
                    raise ConfigError(
                        f"{key}.{name}",
                        value,
                        f"{'false' if name == 'predict_weights' else 'null'} for "
                        f"schedule {self.schedule}: a staleness control acts on PACI only (a "
                        "synchronous schedule's gradients are never late)",
                    )

    @property
    def staleness(self) -> dict[str, Any]:
        """The staleness controls that are on (empty: none), by key."""
        return {k: getattr(self, k) for k in STALENESS_KEYS if getattr(self, k) not in (None, False)}

    def _check_torch(self, key: str) -> None:
        """What torch's schedule class would refuse at its first step, refused here with the reason."""
        if self.inflight is not None:
            why = f"null for schedule {self.schedule} run by torch's class, which holds its own count in flight"
            raise ConfigError(f"{key}.inflight", self.inflight, why)
        why_not = schedule_of(self.schedule).torch_refusal(self.stages, self.window)
        if why_not is not None:
            raise ConfigError(f"{key}.window", self.window, why_not)

    @property
    def runs_torch_schedule(self) -> bool:
        """Whether the distributed runtime runs this schedule through torch's own class (:data:`TORCH_RUN`)."""
        return schedule_of(self.schedule).runs_torch(self.runtime, self.torch_schedule)

    @property
    def layout(self) -> Layout:
        """This pipeline's :class:`~.layout.Layout` (its cut None while ``partition: auto``)."""
        sizes = tuple(self.partition) if isinstance(self.partition, list) else None
        chunks = schedule_of(self.schedule).chunks_of(self.chunks)
        return Layout(
            self.schedule,
            self.stages,
            self.data_parallel,
            self.window,
            self.microbatch_size,
            self.inflight,
            sizes,
            chunks,
        )


@dataclass(frozen=True)
class RunConfig:
    """A whole training run: what ``paci-tune train`` and each pipeline worker execute."""

    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    data: dict[str, Any] = field(default_factory=lambda: {"source": "stdlib"})
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    hardware: RunHardware = field(default_factory=RunHardware)  # only ``memory``: see config/memory.py

    def __post_init__(self) -> None:
        self.pipeline.layout.check(self.training.global_batch)
        top = self.pipeline.stage_momentum
        if top is not None and top <= self.optimizer.beta1:
            raise ConfigError(
                "pipeline.stage_momentum",
                top,
                f"null or above the optimizer's first-moment "
                f"coefficient {self.optimizer.beta1:g} (it raises that at the stale stages)",
            )
        schedule, clock = self.pipeline.schedule, self.training.clock
        if schedule in TIMED_SCHEDULES and clock == "wall" and not self.pipeline.runs_torch_schedule:
            raise ConfigError(
                "training.clock",
                clock,
                f"rst or sim for pipeline.schedule {schedule} on the {self.pipeline.runtime} runtime ({TIMED_ONLY})",
            )

    @property
    def layout(self) -> Layout:
        return self.pipeline.layout

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_doc(self) -> dict[str, Any]:
        """The config as a YAML document that loads back to an equal config (tuples as lists)."""
        doc = self.to_dict()
        doc["optimizer"]["betas"] = list(doc["optimizer"]["betas"])
        if self.hardware.memory is None:
            del doc["hardware"]  # no budget: the document of a run that never had one, unchanged
        return doc


# ----------------------------------------------------------------------------- checks and document rules


SEED_LIMIT = 2**63
"""Seeds must be non-negative (the data stream's generator) and fit torch's 64-bit seed."""


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, value, "a positive number")


def resolve_batching(doc: dict[str, Any]) -> dict[str, Any]:
    """Fill in window or micro-batch size from the other in a parsed document: D * a * b = global batch
    (:meth:`.layout.Layout.for_batch`). Only well-typed positive values are resolved; anything else is
    left for the dataclasses to refuse with the key's own message.
    """
    training, pipeline = doc.get("training") or {}, doc.get("pipeline") or {}
    if not isinstance(training, dict) or not isinstance(pipeline, dict):
        return doc
    g = training.get("global_batch", TrainingConfig.global_batch)
    w, b = pipeline.get("window"), pipeline.get("microbatch_size")
    dp = pipeline.get("data_parallel", PipelineConfig.data_parallel)

    def ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if not ok(g) or not ok(dp) or not all(v is None or ok(v) for v in (w, b)):
        return doc
    layout = Layout.for_batch(g, schedule="", stages=1, data_parallel=dp, window=w, microbatch_size=b)
    return {**doc, "pipeline": {**pipeline, "window": layout.window, "microbatch_size": layout.microbatch_size}}


def _renamed(doc: dict[str, Any]) -> dict[str, Any]:
    """Old spellings still accepted. ``training.eval_batches: N`` (N chunks of the validation set) is
    ``eval_sequences: N * eval_microbatch_size``: the set no longer grows with the micro-batch size."""
    training = doc.get("training")
    if not isinstance(training, dict) or "eval_batches" not in training:
        return doc
    training = dict(training)
    n = training.pop("eval_batches")
    if "eval_sequences" in training:
        raise ConfigError("training.eval_batches", n, "absent when training.eval_sequences is given (its new name)")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError("training.eval_batches", n, "a positive integer (better: training.eval_sequences)")
    chunk = training.get("eval_microbatch_size", TrainingConfig.eval_microbatch_size)
    training["eval_sequences"] = n * chunk if isinstance(chunk, int) and chunk > 0 else n
    return {**doc, "training": training}


def load_run_config(data: Any) -> RunConfig:
    """Validate a parsed YAML document into a :class:`RunConfig` (checked as it is built)."""
    if isinstance(data, dict):
        data = resolve_batching(_renamed(data))
    return from_dict(RunConfig, data)
