"""PACI against the strongest synchronous baseline on paired fresh seeds: the test, its sequential rule, the record.

**The statistic.** Each confirmation seed is one model initialisation and data order, trained by both
compared points, so the comparison is paired. Per seed, r = the baseline's time to target over PACI's
(> 1: PACI is faster). Times are positive and their noise multiplicative, so the test is a one-sample
t-test of mean(log r) = 0 with n - 1 degrees of freedom (``scipy.stats.ttest_1samp``), its interval
exponentiated; the speedup shown is exp(mean log r), the geometric mean of the per-seed ratios.

**Adding seeds after looking is repeated testing.** The confirmation looks at n = first, first + 1, ...,
``max_seeds`` seeds. Look n tests at the alpha a Lan-DeMets O'Brien-Fleming-type spending function spends
between (n - 1) / max and n / max, alpha(t) = 2 - 2 Phi(z_{1 - alpha/2} / sqrt(t)), the first look all of
alpha(first / max). By the union bound the chance of a false winner over all looks is at most the sum,
alpha, however the looks correlate; the same bound makes each look's interval a repeated confidence
interval, all of them covering the true ratio together with probability 95%. Early looks spend little:
a large effect still stops early, a small one keeps most of alpha for the last look.

**Stopping** (``stopped_by``): ``decided``, the interval excludes 1; ``narrow``, it is narrower than
``tolerance`` x the speedup (about equal, and known to that precision: a tie); ``max_seeds``; ``missed``,
a compared run missed the target or failed. A miss is censored (its time is somewhere past the budget),
which a t-test on log times cannot take, so the verdict is ``undecided``; more seeds cannot undo it.

**Seeds.** The t-test needs n >= 2 (one seed estimates no spread), so the first look is at
max(2, ``min_seeds``); an exact sign-flip test could not reach p < 0.05 below 6 seeds. May import: numpy,
scipy, :mod:`paci_tune.schedule` (the baseline's label).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from ..schedule import REGISTRY

ALPHA = 0.05
LEVEL = 1 - ALPHA
"""The overall level: the chance that a confirmation names a winner when there is none is at most ALPHA."""
METHOD = (
    "paired t-test on log time ratios, group-sequential: Lan-DeMets O'Brien-Fleming alpha spending, "
    "Bonferroni across looks"
)
UNCONFIRMED = "single search draws: no interval (search.confirm gives one)"
MIN_PAIRED = 2
"""The fewest paired seeds a t-test can decide on."""
STOPPED_BY = ("decided", "narrow", "max_seeds", "missed")
VERDICTS = ("paci", "flush", "tie", "undecided")
"""``flush``: the synchronous baseline is faster, whichever synchronous schedule it is (``baseline.schedule``)."""
PACI_WINS, BASELINE_WINS, TIE, UNDECIDED = VERDICTS


def spent(t: float, alpha: float = ALPHA) -> float:
    """The alpha an O'Brien-Fleming-type spending function has spent by information fraction ``t``."""
    if t <= 0:
        return 0.0
    return float(2 - 2 * stats.norm.cdf(stats.norm.ppf(1 - alpha / 2) / math.sqrt(min(t, 1.0))))


@dataclass(frozen=True)
class Look:
    """The test at one look: the speedup, the look's interval, the verdict so far and why it stopped (None:
    add a seed)."""

    n: int
    speedup: float
    low: float | None
    high: float | None
    confidence: float  # the nominal level of this look's interval, 1 - the alpha spent at it
    verdict: str
    stopped_by: str | None


@dataclass(frozen=True)
class Design:
    """The confirmation's sequential paired test: looks from ``first`` to ``max_seeds`` seeds (module docstring)."""

    min_seeds: int
    max_seeds: int
    tolerance: float = 0.1
    alpha: float = ALPHA

    @property
    def first(self) -> int:
        """The first look: ``min_seeds``, at least :data:`MIN_PAIRED`."""
        return max(MIN_PAIRED, self.min_seeds)

    def alpha_at(self, n: int) -> float:
        """The alpha spent at look ``n`` (0 outside the looks)."""
        if not self.first <= n <= self.max_seeds:
            return 0.0
        before = 0.0 if n == self.first else spent((n - 1) / self.max_seeds, self.alpha)
        return spent(n / self.max_seeds, self.alpha) - before

    def look(self, ratios: Sequence[float], missed: int = 0) -> Look:
        """The test on the per-seed ratios of the first ``len(ratios)`` seeds; ``missed``: compared runs that
        missed the target or failed among them."""
        n = len(ratios)
        logs = np.log(np.asarray(ratios, dtype=float)) if n else np.zeros(0)
        speedup = float(np.exp(logs.mean())) if n and np.isfinite(logs).all() else math.nan
        if missed:
            return Look(n, speedup, None, None, math.nan, UNDECIDED, "missed")
        if n < self.first:
            return Look(n, speedup, None, None, math.nan, UNDECIDED, None)
        confidence = 1 - self.alpha_at(min(n, self.max_seeds))
        if np.ptp(logs) <= 1e-12 * max(1.0, abs(float(logs.mean()))):  # every seed the same ratio: no spread
            low = high = speedup
        else:
            ci = stats.ttest_1samp(logs, 0.0).confidence_interval(confidence_level=confidence)
            low, high = float(np.exp(ci.low)), float(np.exp(ci.high))
        if low > 1.0 or high < 1.0:
            return Look(n, speedup, low, high, confidence, PACI_WINS if low > 1.0 else BASELINE_WINS, "decided")
        if high - low < self.tolerance * speedup:
            return Look(n, speedup, low, high, confidence, TIE, "narrow")
        return Look(n, speedup, low, high, confidence, TIE, "max_seeds" if n >= self.max_seeds else None)

    def settle(self, ratios: Sequence[float], missed: Sequence[bool]) -> Look:
        """The sequential rule over the seeds run so far, in seed order: the first look that stops, else the
        look at all of them (stopped_by None: one more seed is due). ``missed[i]``: seed i's compared runs
        did not both reach the target."""
        for n in range(self.first, min(len(ratios), self.max_seeds) + 1):
            now = self.look(ratios[:n], sum(missed[:n]))
            if now.stopped_by is not None:
                return now
        return self.look(ratios[: self.max_seeds], sum(missed[: self.max_seeds]))


# ------------------------------------------------------------------------------------ the record
@dataclass(frozen=True)
class Side:
    """One compared point: which it is and how it did on the compared runs (the confirmation's seeds, or
    the search's single draw)."""

    schedule: str
    point: str  # its label, as the search shows it
    trial: str  # STUDY#NUMBER of the search trial it was chosen as
    stages: int
    scores: dict[int, float]  # per seed: time to target, or the not-reached penalty of a miss
    reached: dict[int, bool]

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.scores.values()))) if self.scores else math.inf

    @property
    def missed(self) -> int:
        return sum(not ok for ok in self.reached.values())

    def to_doc(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "point": self.point,
            "trial": self.trial,
            "stages": self.stages,
            "mean": self.mean,
            "reached": sum(self.reached.values()),
            "runs": len(self.scores),
        }


@dataclass(frozen=True)
class Comparison:
    """PACI's best pipelined point against the strongest synchronous point: best.yaml's ``comparison``,
    read by the summary, the report and ``apply``."""

    paci: dict[str, Any]  # Side.to_doc()
    baseline: dict[str, Any]
    method: str
    level: float
    n: int
    seeds: list[int]
    ratios: dict[int, float]  # the baseline's score over PACI's, per seed
    speedup: float
    interval: list[float] | None
    look_level: float | None  # the nominal level of the look the interval is from
    verdict: str
    stopped_by: str | None
    min_seeds: int | None = None
    max_seeds: int | None = None
    reason: str | None = None  # why undecided, when it is
    notes: list[str] = field(default_factory=list)

    @property
    def no_pipeline(self) -> bool:
        """The synchronous point that is not beaten runs the whole model on each device (P = 1)."""
        return self.verdict != PACI_WINS and int(self.baseline.get("stages") or 0) == 1

    @property
    def baseline_name(self) -> str:
        """How the sentences name the baseline: its registry label (``flush`` for 1F1B-flush), else as written."""
        s = str(self.baseline.get("schedule"))
        return REGISTRY[s].label if s in REGISTRY else s

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ratios"] = {int(k): float(v) for k, v in self.ratios.items()}
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Comparison:
        """The record of a best.yaml's ``comparison`` (its shape checked by the file's reader)."""
        known = {f for f in cls.__dataclass_fields__}
        out = {k: v for k, v in doc.items() if k in known}
        out["ratios"] = {int(k): float(v) for k, v in (doc.get("ratios") or {}).items()}
        return cls(**out)

    def sentence(self) -> str:
        """The verdict in one line: who wins, by how much, on what evidence."""
        name = self.baseline_name
        sp = f"{self.speedup:.4g}x"
        if self.interval is not None:
            sp += f" (95% interval {self.interval[0]:.4g}-{self.interval[1]:.4g}, {self.n} paired seeds)"
        elif self.method == UNCONFIRMED:
            sp += " (single search draws, no interval)"
        if self.verdict == UNDECIDED:
            return f"undecided -- {self.reason}"
        what = {PACI_WINS: "PACI wins", BASELINE_WINS: f"{name} wins", TIE: "a tie"}[self.verdict]
        if self.no_pipeline:
            what += " with no pipeline (P = 1: the whole model on each device)"
        return f"{self.verdict} -- {what}: {name}'s time to target over PACI's {sp}"


def build(paci: Side, baseline: Side, design: Design | None, *, spacing: float = 0.0, advice: str = "") -> Comparison:
    """The comparison of two sides: on their common confirmed seeds with ``design``, or their single search
    draws without (``design`` None). ``spacing``: time to target's resolution; a confirmed winner whose mean
    is closer than that to the other's is a tie (the times cannot tell them apart)."""
    notes: list[str] = []
    seeds = sorted(set(paci.scores) & set(baseline.scores))
    ratios = {s: baseline.scores[s] / paci.scores[s] for s in seeds if paci.scores[s] > 0}
    missed = sum(not paci.reached.get(s, False) or not baseline.reached.get(s, False) for s in seeds)
    missed += sum(not math.isfinite(baseline.scores[s]) or not math.isfinite(paci.scores[s]) for s in seeds)
    reason = None
    if design is None:
        r = baseline.mean / paci.mean
        verdict = TIE if abs(baseline.mean - paci.mean) < spacing else (PACI_WINS if r > 1 else BASELINE_WINS)
        look = Look(1, r, None, None, math.nan, verdict, None)
        method = UNCONFIRMED
    else:
        finite = [v for v in ratios.values() if math.isfinite(v) and v > 0]
        look = design.look(finite if not missed else list(ratios.values()), missed)
        method = METHOD
    verdict = look.verdict
    if missed:
        who = [
            f"{name} on {side.missed} of {len(side.scores)}"
            for name, side in (("PACI", paci), ("the baseline", baseline))
            if side.missed
        ]
        verdict = UNDECIDED
        reason = (
            f"{' and '.join(who)} compared run(s) missed the target (or failed): a miss is censored, its "
            f"time is past the budget, so there is no ratio of times to test; {advice}"
        ).rstrip("; ")
    elif verdict in (PACI_WINS, BASELINE_WINS) and abs(baseline.mean - paci.mean) < spacing:
        verdict = TIE
        notes.append(
            f"the interval excludes 1, but the mean times differ by less than one validation interval "
            f"({spacing:.3g}s), the resolution of time to target: a tie"
        )
    if paci.stages == 1:
        notes.append(
            "PACI's best is a single stage: the space has no pipelined point, and PACI at P = 1 trains "
            "flush's numbers (nothing is stale): the two sides are the same method"
        )
    interval = None if look.low is None or look.high is None else [round(look.low, 4), round(look.high, 4)]
    return Comparison(
        paci=paci.to_doc(),
        baseline=baseline.to_doc(),
        method=method,
        level=LEVEL,
        n=len(seeds) or 1,
        seeds=seeds,
        ratios={s: round(v, 6) for s, v in ratios.items()},
        speedup=round(look.speedup, 4),
        interval=interval,
        look_level=None if math.isnan(look.confidence) else round(look.confidence, 6),
        verdict=verdict,
        stopped_by=look.stopped_by,
        min_seeds=design.min_seeds if design else None,
        max_seeds=design.max_seeds if design else None,
        reason=reason,
        notes=notes,
    )
