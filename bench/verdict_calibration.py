"""The verdict's error rates, simulated: false winners under A/A, and power at a true difference.

Each simulated confirmation is what the example's confirmation runs look like (docs/benchmarks.md,
"Calibrating the verdict"): per fresh seed i and side, log time = log T_side + s_i + e_side,i, a seed
effect s_i ~ N(0, sigma_seed) shared by both sides (one model initialisation and data order for both:
the pairing) and run noise e ~ N(0, sigma_run) of each side's own. Measured on the shipped example's
four confirmation seeds (2026-12-06): log-time sd 0.13 (PACI) and 0.09 (flush), correlation 0.67,
sd of the log ratio 0.097; so sigma_seed = 0.09 and sigma_run = 0.07 (sd of the log ratio 0.099).

Every simulated confirmation goes through the real sequential rule, with the shipped defaults
(:class:`paci_tune.config.tune.ConfirmConfig`: 3 seeds, at most 8, tolerance 0.1) via
:meth:`paci_tune.tune.comparison.Design.settle` -- what :func:`paci_tune.tune.rounds.current_round` calls
after each round -- and through the rule it replaced (:func:`legacy_settle`: the percentile bootstrap of
the ratio of means, 4,000 resamples, decided when it excluded 1, one seed added otherwise), on the same
draws. A false winner is a ``paci`` or ``flush`` verdict when both sides' true times are equal; power is
the share of correct verdicts at a true ratio.

    python bench/verdict_calibration.py            # the table in docs/benchmarks.md (about a minute)
    python bench/verdict_calibration.py --quick    # seconds (CI)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from paci_tune.config.tune import ConfirmConfig
from paci_tune.tune.comparison import Design

SIGMA_SEED, SIGMA_RUN = 0.09, 0.07
"""The example's confirmation noise (module docstring)."""


def shipped_design() -> Design:
    c = ConfirmConfig()
    return Design(c.seeds, c.cap, c.tolerance)


def legacy_paired_ratio(num: np.ndarray, den: np.ndarray, draws: int = 4000) -> tuple[float, float, float]:
    """The rule before 2026-12-06: mean(num) / mean(den) and its percentile-bootstrap 95% interval."""
    idx = np.random.default_rng(0).integers(0, len(num), size=(draws, len(num)))
    ratios = num[idx].mean(axis=1) / den[idx].mean(axis=1)
    lo, hi = np.nanquantile(ratios, [0.025, 0.975])
    return float(num.mean() / den.mean()), float(lo), float(hi)


def legacy_settle(base: np.ndarray, paci: np.ndarray, design: Design) -> tuple[str, int]:
    """The old rounds on the same seeds: (verdict, seeds used)."""
    for n in range(max(2, design.min_seeds), design.max_seeds + 1):
        point, low, high = legacy_paired_ratio(base[:n], paci[:n])
        if low > 1.0 or high < 1.0:
            return ("paci" if low > 1.0 else "flush"), n
        if math.isfinite(point) and high - low < design.tolerance * point:
            return "tie", n
    return "tie", design.max_seeds


@dataclass(frozen=True)
class Rates:
    """Verdicts over ``sims`` simulated confirmations at one true ratio (the baseline's time over PACI's)."""

    sims: int
    ratio: float
    paci: float  # share of `paci` verdicts
    flush: float
    seeds: float  # mean seeds used

    @property
    def winners(self) -> float:
        """Share of confirmations that named a winner: the false-winner rate when ``ratio`` is 1."""
        return self.paci + self.flush

    @property
    def correct(self) -> float:
        """Share of correct verdicts: the power when ``ratio`` is not 1."""
        return self.paci if self.ratio > 1 else self.flush if self.ratio < 1 else 1 - self.winners


def draws(sims: int, ratio: float, sigma_seed: float, sigma_run: float, max_seeds: int, seed: int = 2026):
    """Simulated confirmation times (sims x max_seeds) of the baseline and of PACI."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(0.0, sigma_seed, size=(sims, max_seeds))
    base = 3.0 * np.exp(shared + rng.normal(0.0, sigma_run, size=(sims, max_seeds)))
    paci = 3.0 / ratio * np.exp(shared + rng.normal(0.0, sigma_run, size=(sims, max_seeds)))
    return base, paci


def simulate(
    sims: int,
    ratio: float = 1.0,
    *,
    sigma_seed: float = SIGMA_SEED,
    sigma_run: float = SIGMA_RUN,
    design: Design | None = None,
    legacy: bool = False,
    seed: int = 2026,
) -> Rates:
    """The verdicts of ``sims`` confirmations through the real rule (or, ``legacy``, the one it replaced)."""
    design = design or shipped_design()
    base, paci = draws(sims, ratio, sigma_seed, sigma_run, design.max_seeds, seed)
    counts = {"paci": 0, "flush": 0, "tie": 0, "undecided": 0}
    used = 0
    for b, p in zip(base, paci, strict=True):
        if legacy:
            verdict, n = legacy_settle(b, p, design)
        else:
            look = design.settle(list(b / p), [False] * design.max_seeds)
            verdict, n = look.verdict, look.n
        counts[verdict] += 1
        used += n
    return Rates(sims, ratio, counts["paci"] / sims, counts["flush"] / sims, used / sims)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=4000, help="Simulated confirmations per row.")
    ap.add_argument("--quick", action="store_true", help="300 simulations per row, two rows: a smoke run.")
    args = ap.parse_args()
    t0 = time.time()
    sims = 300 if args.quick else args.sims
    noises = [SIGMA_RUN] if args.quick else [0.05, SIGMA_RUN, 0.10]
    ratios = [1.0, 1.2] if args.quick else [1.0, 1.1, 1.2, 1.5]
    d = shipped_design()
    print(
        f"shipped design: seeds {d.min_seeds}..{d.max_seeds}, tolerance {d.tolerance}; per-look alpha "
        + ", ".join(f"n={n}: {d.alpha_at(n):.4f}" for n in range(d.first, d.max_seeds + 1))
    )
    print(f"\n{sims} simulated confirmations per row; seed effect sd {SIGMA_SEED}\n")
    print("| run noise sd | true ratio | rule | paci | flush | false winners / correct | mean seeds |")
    print("|---|---|---|---|---|---|---|")
    for noise in noises:
        for ratio in ratios:
            for legacy in (False, True):
                r = simulate(sims, ratio, sigma_run=noise, design=d, legacy=legacy)
                what = f"{r.winners:.1%} false winners" if ratio == 1.0 else f"{r.correct:.1%} correct"
                rule = "bootstrap (before)" if legacy else "sequential t (now)"
                print(f"| {noise:g} | {ratio:g} | {rule} | {r.paci:.1%} | {r.flush:.1%} | {what} | {r.seeds:.2f} |")
    print(f"\npython bench/verdict_calibration.py {' '.join(sys.argv[1:])}: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
