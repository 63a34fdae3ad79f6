"""``best.yaml``'s schema: typed sections, the one reader and the writer.

A search's verdict (:mod:`paci_tune.verdict.best`) builds the document; :func:`write_best` writes it
through :class:`BestFile`, and :func:`read_best` -- the only reader, for ``paci-tune apply`` and for
``paci-tune report`` -- checks the whole file before anything runs and returns a :class:`BestFile`.

``apply`` trains ``run`` and reads ``evidence.steps`` (where its first checkpoint goes), so those
are validated as strictly as a run config; ``recommended``, ``evidence``, ``target`` and ``budget``
must have their known keys with values of the right kind, and ``recommended`` must describe the
same pipeline as ``run`` (a file edited by hand in one place and not the other is refused rather
than trained half-way). The purely informative sections (``provenance``, ``confirmation``,
``transfer_check``, ``baseline``, ...) need only be of the right shape: nothing reads their insides. A new field of
the run's ``pipeline`` section is accepted in ``recommended`` too, so the file grows with the schema.
``recommended.backward_weights`` is null (flush) or PACI's value, the run's ``pipeline.backward_weights``;
``recommended.optimizer`` the run's optimizer and the settings it reads; a file from before either key
has none and trains the run as written. A user model (``model.entry``) is code: read for ``apply``, the file
is refused unless the command line names its entry (:mod:`.trust`), before the run is derived.

A report reads the file with ``trainable=False``: every section is checked the same way except
``run``, which it only shows (it is not derived, so a report needs neither the model nor the data).
May import: :mod:`paci_tune.pipeline` (its checks), :mod:`paci_tune.model`, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors` and the tune layer's :mod:`.choices`, :mod:`.comparison` and
:mod:`.trust`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.files import read_mapping, write_yaml
from ..config import PipelineConfig, RunConfig, derive_run
from ..config.layout import Layout
from ..config.schema import from_dict
from ..config.tune import BudgetConfig, TargetConfig
from ..errors import ConfigError
from ..model.loader import MAX_UNITS
from ..pipeline.checks import check_model_and_data
from .choices import BACKWARD_WEIGHTS
from .comparison import VERDICTS, Comparison
from .trust import check_entries

EVIDENCE = (
    "clock_tokens_per_s",
    "clock_step_time_s",
    "clock_bubble_fraction",
    "tokens_per_s",
    "bubble_fraction",
    "max_drift",
    "measured_peak_memory_bytes",
    "memory_measured_per",
    "predicted_peak_memory_bytes",
    "clock_used",
    "partition",
)
"""A trial's figures ``best.yaml`` shows; the ``clock_`` ones are on the objective's clock."""

RECOMMENDED = (
    "schedule",
    "stages",
    "data_parallel",
    "devices",
    "window",
    "microbatch_size",
    "partition",
    "global_batch",
    "lr",
    "lr_scale",
    "backward_weights",
    "optimizer",
)
"""The keys of ``best.yaml``'s ``recommended`` (``apply`` checks them against the run it trains)."""

HEADER = "# Written by `paci-tune search`; train it with `paci-tune apply {name}`.\n"

EVIDENCE_KEYS = ("trial", "time_to_target", "reached_target", "best_val_loss", "score", *EVIDENCE, "steps")
INFORMATIVE: dict[str, tuple[type, ...]] = {
    "verdict": (str,),
    "baseline_schedule": (str,),
    "comparison": (dict,),
    "lr_edges": (list,),
    "confirmation": (dict,),
    "transfer_check": (dict,),
    "provenance": (dict,),
    "warm_start": (dict,),
    "candidates": (dict,),
    "memory": (dict,),
}
LEGACY: dict[str, tuple[type, ...]] = {
    "baseline": (dict,),
    "speedup_vs_flush": (int, float),
    "speedup_vs_baseline": (int, float),
    "paci_speedup_vs_flush": (int, float),
    "paci_speedup_interval": (list,),
    "paci_speedup_vs_baseline": (int, float),
    "paci_baseline_interval": (list,),
    "verdict_vs_flush": (str,),
    "verdict_reason": (str,),
    "paci_won": (bool,),
    "speedup_note": (str,),
}
"""Keys of files written before the verdict was one ``comparison`` record (issue 53): read (their shape
checked) and ignored; such a file's ``verdict`` still shows."""
TOP = ("recommended", "evidence", "target", "budget", "run", *INFORMATIVE)
WHAT = "a file written by `paci-tune search`: recommended, evidence, ..., run"


# ------------------------------------------------------------------------------------ the schema
@dataclass(frozen=True)
class Recommended:
    """``recommended``: the point ``apply`` trains (``extra``: other ``pipeline`` keys a file may carry)."""

    schedule: str | None = None
    stages: int | None = None
    data_parallel: int | None = None
    devices: int | None = None
    window: int | None = None
    microbatch_size: int | None = None
    partition: list[int] | None = None
    global_batch: int | None = None
    lr: float | None = None
    lr_scale: float | None = None
    backward_weights: str | None = None
    optimizer: dict[str, Any] | None = None  # the run's optimizer, its settings (absent before the key)
    extra: dict[str, Any] = field(default_factory=dict)
    keys: tuple[str, ...] = RECOMMENDED  # the keys present, in the file's order

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Recommended:
        return cls(
            **{k: doc[k] for k in RECOMMENDED if k in doc},
            extra={k: v for k, v in doc.items() if k not in RECOMMENDED},
            keys=tuple(doc),
        )

    def to_doc(self) -> dict[str, Any]:
        return {k: getattr(self, k) if k in RECOMMENDED else self.extra[k] for k in self.keys}

    @property
    def layout(self) -> Layout:
        """The recommended point's layout (D = 1 in files written before data parallelism)."""
        cut = tuple(self.partition) if self.partition else None
        return Layout(
            self.schedule or "",
            self.stages or 0,
            self.data_parallel or 1,
            self.window or 0,
            self.microbatch_size or 0,
            None,
            cut,
        )


@dataclass(frozen=True)
class BestEvidence:
    """``evidence``: the recommended point's search trial (``figures``: its :data:`EVIDENCE`)."""

    trial: str | None = None
    time_to_target: float | None = None
    reached_target: bool | None = None
    best_val_loss: float | None = None
    score: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    keys: tuple[str, ...] = EVIDENCE_KEYS

    _OWN = ("trial", "time_to_target", "reached_target", "best_val_loss", "score", "steps")

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> BestEvidence:
        return cls(
            **{k: doc[k] for k in cls._OWN if k in doc},
            figures={k: v for k, v in doc.items() if k not in cls._OWN},
            keys=tuple(doc),
        )

    def to_doc(self) -> dict[str, Any]:
        return {k: getattr(self, k) if k in self._OWN else self.figures[k] for k in self.keys}


@dataclass(frozen=True)
class BestFile:
    """``best.yaml``, typed: what :func:`read_best` returns and what :func:`write_best` writes.

    ``run`` is the run document as written; ``run_config`` the run derived and checked from it (read
    for ``apply``; None when read for a report or built for writing). The informative sections keep
    their plain mappings. ``keys``: the top-level keys present, in order (a section the search did not
    write stays absent, one it wrote as null stays null).
    """

    recommended: Recommended
    run: dict[str, Any]
    evidence: BestEvidence | None = None
    confirmation: dict[str, Any] | None = None
    transfer_check: dict[str, Any] | None = None
    verdict: str | None = None  # the comparison's verdict, for a reader that wants one word
    baseline_schedule: str | None = None  # the comparison's synchronous schedule (absent in older files: 1f1b)
    comparison: dict[str, Any] | None = None  # paci_tune.tune.comparison.Comparison's document
    lr_edges: list[dict[str, Any]] | None = None  # compared points at an edge of their LR grid (verdict/edges.py)
    target: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None
    warm_start: dict[str, Any] | None = None  # the checkpoint every trial started from (tune/warm.py)
    candidates: dict[str, Any] | None = None  # each schedule's best points, ranked (verdict/candidates.py)
    memory: dict[str, Any] | None = None  # hardware.memory and the points it dropped (verdict/candidates.py)
    keys: tuple[str, ...] = ("recommended", "evidence", "run")
    run_config: RunConfig | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_doc(cls, doc: dict[str, Any], run_config: RunConfig | None = None) -> BestFile:
        """The typed file of a document (its shape as :func:`read_best` checks it; nothing checked here)."""
        ev = doc.get("evidence")
        doc = {k: v for k, v in doc.items() if k not in LEGACY}
        return cls(
            recommended=Recommended.from_doc(doc["recommended"]),
            run=doc["run"],
            evidence=BestEvidence.from_doc(ev) if isinstance(ev, dict) else None,
            **{k: doc.get(k) for k in TOP if k not in ("recommended", "evidence", "run")},
            keys=tuple(doc),
            run_config=run_config,
        )

    def to_doc(self) -> dict[str, Any]:
        """The document, in its key order (YAML-safe: tuples as lists, numpy/torch scalars as numbers)."""
        out: dict[str, Any] = {}
        for k in self.keys:
            v = getattr(self, k)
            out[k] = v.to_doc() if isinstance(v, (Recommended, BestEvidence)) else v
        return _plain(out)

    @property
    def verdict_record(self) -> Comparison | None:
        """The typed comparison (None in a file without one: unconfirmed searches with one kind of schedule, and
        files written before the record)."""
        return Comparison.from_doc(self.comparison) if self.comparison else None

    @property
    def trial_steps(self) -> int | None:
        """The recommended trial's steps (where ``apply``'s first checkpoint goes)."""
        return self.evidence.steps if self.evidence is not None else None


# ------------------------------------------------------------------------------------ writing
def write_best(path: str | Path, best: BestFile | dict[str, Any]) -> None:
    """Write ``best.yaml`` from :class:`BestFile` (a document is typed first), atomically: a reader sees
    the old file or the whole new one."""
    typed = best if isinstance(best, BestFile) else BestFile.from_doc(best)
    write_yaml(path, typed.to_doc(), header=HEADER.format(name=Path(path).name))


def _plain(x: Any) -> Any:
    """YAML-safe copy: tuples to lists, numpy/torch scalars to Python numbers."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


# ------------------------------------------------------------------------------------ reading
def read_best(path: str | Path, *, trainable: bool = True, trust_entry: str | None = None) -> BestFile:
    """The typed file; a ConfigError naming ``best.yaml``'s key, the value and what is allowed otherwise.

    ``trainable`` (``apply``): ``run`` is derived and checked as a run config, with its model and data,
    and ``recommended`` compared with it; a user model only when ``trust_entry`` names it (:mod:`.trust`).
    Without (a report): ``run`` need only be a mapping, and no model is loaded.
    """
    doc = read_mapping(path, "best.yaml", WHAT)
    for k, v in doc.items():
        if k not in TOP and k not in LEGACY:
            raise ConfigError(f"best.yaml.{k}", v, "a key of " + ", ".join(TOP))
    for k in ("recommended", "run"):
        if not isinstance(doc.get(k), dict) or not doc[k]:
            raise ConfigError(f"best.yaml.{k}", doc.get(k), WHAT)
    for k, kinds in {**INFORMATIVE, **LEGACY}.items():
        v = doc.get(k)
        if v is not None and (not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool))):
            raise ConfigError(f"best.yaml.{k}", v, f"null or {' or '.join(t.__name__ for t in kinds)}")
    run: RunConfig | None = None
    if trainable:
        check_entries(doc, trust_entry)  # before anything of the run is derived, imported or written
        try:
            run = derive_run(doc["run"])
            check_model_and_data(run)  # the run as apply would train it: its model and data, before the rest
        except ConfigError as e:
            raise ConfigError(f"best.yaml.run.{e.key}", e.value, e.allowed) from None
    _check_recommended(doc["recommended"], run)
    _check_evidence(doc.get("evidence"))
    _check_comparison(doc.get("comparison"))
    for key, cls in (("target", TargetConfig), ("budget", BudgetConfig)):
        if doc.get(key) is not None:
            from_dict(cls, doc[key], f"best.yaml.{key}").check(f"best.yaml.{key}", require=False)
    return BestFile.from_doc(doc, run)


def _check_recommended(rec: dict[str, Any], run: RunConfig | None) -> None:
    """``recommended``'s keys and values; compared with ``run`` when there is one (``apply``)."""
    allowed = (*RECOMMENDED, *(f.name for f in dataclasses.fields(PipelineConfig) if f.name not in RECOMMENDED))
    for k, v in rec.items():
        if k not in allowed:
            raise ConfigError(f"best.yaml.recommended.{k}", v, "a key of " + ", ".join(allowed))
    p = run.pipeline if run is not None else None
    if run is not None:
        same = {
            **{k: getattr(p, k) for k in ("schedule", "stages", "window", "microbatch_size", "data_parallel")},
            "global_batch": run.training.global_batch,
            "lr": run.optimizer.lr,
            "devices": run.layout.devices,
        }
        for k, want in same.items():
            v = rec.get(k)
            if k in rec and (type(v) is bool or v != want):
                raise ConfigError(f"best.yaml.recommended.{k}", v, f"{want!r}, what the run apply trains says")
    part = rec.get("partition")
    stages = p.layout.virtual_stages if p is not None else None  # interleaved: v * P pieces
    if part is not None and (
        not isinstance(part, list)
        or (stages is not None and len(part) != stages)
        or any(type(n) is not int or not 1 <= n <= MAX_UNITS for n in part)
    ):
        raise ConfigError("best.yaml.recommended.partition", part, f"null or {stages or 'P'} positive unit counts")
    scale = rec.get("lr_scale")
    if scale is not None and not _number(scale, 1e3):
        raise ConfigError("best.yaml.recommended.lr_scale", scale, "a positive number up to 1000")
    opt = rec.get("optimizer")  # absent in files written before the key: nothing to compare
    if opt is not None and (not isinstance(opt, dict) or (run is not None and opt != run.optimizer.settings())):
        want = f"{run.optimizer.settings()!r}, what the run apply trains says" if run is not None else "a mapping"
        raise ConfigError("best.yaml.recommended.optimizer", opt, f"null or {want}")
    bw = rec.get("backward_weights")  # absent in files written before the key: nothing to compare
    if bw is not None and (
        not isinstance(bw, str) or bw not in BACKWARD_WEIGHTS or (p is not None and bw != p.backward_weights)
    ):
        want = f"{p.backward_weights!r}, what the run apply trains says (one of" if p is not None else "one of ("
        raise ConfigError(
            "best.yaml.recommended.backward_weights", bw, f"null or {want} {', '.join(BACKWARD_WEIGHTS)})"
        )


def _check_comparison(c: Any) -> None:
    """``comparison``, which apply and the report read: its verdict, its numbers and its two sides."""
    if c is None:
        return
    key = "best.yaml.comparison"
    if c.get("verdict") not in VERDICTS:
        raise ConfigError(f"{key}.verdict", c.get("verdict"), "one of " + ", ".join(VERDICTS))
    sp = c.get("speedup")
    if not (_number(sp, strict=False) or (isinstance(sp, float) and math.isnan(sp))):  # NaN: a failed run's
        raise ConfigError(f"{key}.speedup", sp, "a finite number >= 0 (or .nan where a compared run failed)")
    iv = c.get("interval")
    if iv is not None and (not isinstance(iv, list) or len(iv) != 2 or not all(_number(x, strict=False) for x in iv)):
        raise ConfigError(f"{key}.interval", iv, "null or [low, high], two finite numbers >= 0")
    ratios = c.get("ratios")
    seed = lambda k: (isinstance(k, int) and not isinstance(k, bool)) or (isinstance(k, str) and k.isdigit())  # noqa: E731
    if not isinstance(ratios, dict) or not all(
        seed(k) and not isinstance(v, bool) and isinstance(v, (int, float)) for k, v in ratios.items()
    ):
        raise ConfigError(f"{key}.ratios", ratios, "a mapping of seed (an integer) to a ratio (a number)")
    for side in ("paci", "baseline"):
        v = c.get(side)
        if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in ("schedule", "point", "trial")):
            raise ConfigError(f"{key}.{side}", v, "a mapping with the point's schedule, point and trial (strings)")
    for k in ("n", "notes", "method"):
        want = {"n": int, "notes": list, "method": str}[k]
        if not isinstance(c.get(k), want) or isinstance(c.get(k), bool):
            raise ConfigError(f"{key}.{k}", c.get(k), f"a {want.__name__}")


NUMBERS = (
    "time_to_target",
    "best_val_loss",
    "score",
    "clock_tokens_per_s",
    "clock_step_time_s",
    "clock_bubble_fraction",
    "tokens_per_s",
    "bubble_fraction",
    "max_drift",
)
"""Evidence figures that are numbers (null where the trial did not measure them)."""


def _number(v: Any, most: float = float("inf"), least_ok: float = 0.0, strict: bool = True) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        x = float(v)
    except OverflowError:
        return False
    return (least_ok < x if strict else least_ok <= x) and x <= most and x != float("inf")


def _check_evidence(ev: Any) -> None:
    if ev is None:
        return
    if not isinstance(ev, dict):
        raise ConfigError("best.yaml.evidence", ev, "a mapping of the recommended trial's figures")
    for k, v in ev.items():
        if k not in EVIDENCE_KEYS:
            raise ConfigError(f"best.yaml.evidence.{k}", v, "a key of " + ", ".join(EVIDENCE_KEYS))
    if ev.get("trial") is not None and not isinstance(ev["trial"], str):
        raise ConfigError("best.yaml.evidence.trial", ev["trial"], "null or the trial's name (STUDY#NUMBER)")
    for k in NUMBERS:
        v = ev.get(k)
        if v is not None and not _number(v, strict=False):
            raise ConfigError(f"best.yaml.evidence.{k}", v, "null or a finite number >= 0")
    if ev.get("reached_target") is not None and not isinstance(ev["reached_target"], bool):
        raise ConfigError("best.yaml.evidence.reached_target", ev["reached_target"], "true or false")
    steps = ev.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps < 2**63):
        raise ConfigError("best.yaml.evidence.steps", steps, "null or a positive integer (the trial's steps)")
