"""Which delay law predicts PACI's steps to target from the synchronous curve, and what predict-then-verify
would spend on the tuner-vs-grid tables.

Why: issue 57 asks the tuner to rank every PACI (P, a, LR) by a model of its statistical cost fitted on
the synchronous curve plus a few PACI runs, then train only the candidates the model cannot rule out.
That only pays if the model predicts held-out points better than the runs' own noise. This bench
measures both on the grids ``bench/tuner_vs_grid.py`` trained (``table.json``: shared curves, one
draw of each point; ``table-unshared.json``: one training per point, so its eight flush layouts of one
LR are replicates of one numerics under different data orders -- the noise floor).

1. **Noise floor**: the sd of log steps to target across the replicate flush runs of one LR.
2. **Held-out error** of each form of :mod:`paci_tune.tune.predict` (and of "no penalty": PACI = flush),
   leave-one-out over the PACI points of a table: median and 90th percentile of |log error| as a
   percentage, and the share of held-out points inside the 95% interval.
3. **Predict, then verify**, replayed on ``table.json``: train the flush curve of each LR, then the PACI
   point of best predicted time to target (steps x its layout's step time), capped at the best time so
   far, refit, and stop when no untrained point's lower bound at ``z`` beats the best. Reported: the
   answer over the grid's best and the compute spent over the grid's (the same sums as tuner_vs_grid).

    python bench/delay_law.py                 # prints the tables (under a second, no training)
    python bench/delay_law.py --quick         # the same, for CI
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paci_tune.tune.planner import Candidate, choose  # noqa: E402
from paci_tune.tune.point import TrialParams  # noqa: E402
from paci_tune.tune.predict import FORMS, DelayModel, Observation, leave_one_out  # noqa: E402

TABLES = ROOT / "bench" / "tuner_vs_grid"


@dataclass(frozen=True)
class Point:
    """One grid point of a table: its layout, its steps to target (None: missed) and its costs."""

    schedule: str
    stages: int
    window: int
    microbatch: int
    lr_scale: float
    step_s: float
    steps: float | None
    ttt: float | None
    trained_clock: float
    budget_steps: float
    curve: list[tuple[float, float]]

    @property
    def label(self) -> str:
        return f"{self.schedule} P={self.stages} a={self.window} b={self.microbatch} lr x{self.lr_scale:g}"


def load(path: Path) -> tuple[list[Point], dict[str, Any]]:
    doc = json.loads(path.read_text())
    points = []
    for p in doc["points"]:
        if p["evidence"].get("clock_step_time_s") is None:  # failed (diverged): no steps to compare
            continue
        step = float(p["evidence"]["clock_step_time_s"])
        ttt = p["time_to_target"]
        points.append(
            Point(
                p["schedule"],
                int(p["stages"]),
                int(p["window"]),
                int(p["microbatch_size"]),
                float(p["lr_scale"]),
                step,
                None if ttt is None else round(ttt / step),
                ttt,
                float(p.get("trained_clock") or 0.0),
                float(doc["budget"]) / step,
                [(float(c), float(v)) for c, v in p["curve"]],
            )
        )
    return points, doc


def sync_steps(points: list[Point]) -> dict[float, float]:
    """Per LR scale, the synchronous schedule's steps to target: the median over its layouts (one value when
    the layouts share a curve; the median of replicates when each trained its own)."""
    out = {}
    for lr in sorted({p.lr_scale for p in points}):
        reached = [p.steps for p in points if p.schedule != "paci" and p.lr_scale == lr and p.steps is not None]
        if reached:
            out[lr] = float(statistics.median(reached))
    return out


def observations(points: list[Point], sync: dict[float, float]) -> list[Observation]:
    out = []
    for p in points:
        if p.schedule == "paci" and p.lr_scale in sync:
            reached = p.steps is not None
            steps = p.steps if reached else p.budget_steps
            out.append(Observation(p.stages, p.window, p.lr_scale, float(steps) / sync[p.lr_scale], reached))
    return out


def noise_floor(points: list[Point]) -> float | None:
    """Pooled sd of log steps to target across one LR's synchronous layouts (replicates when unshared)."""
    logs = {}
    for p in points:
        if p.schedule != "paci" and p.steps is not None:
            logs.setdefault(p.lr_scale, []).append(math.log(p.steps))
    groups = [v for v in logs.values() if len(v) > 1]
    if not groups:
        return None
    ss = sum(sum((x - statistics.fmean(v)) ** 2 for x in v) for v in groups)
    dof = sum(len(v) - 1 for v in groups)
    return math.sqrt(ss / dof) if dof else None


def held_out_rows(obs: list[Observation]) -> list[tuple[str, float, float, float, int]]:
    """Leave-one-out error and 95% coverage of each form, with the product's own priors and floor."""
    rows = []
    for form in ("none", *FORMS):
        model = DelayModel(form="mean" if form == "none" else form)
        if form == "none":  # PACI = flush: the prior pinned at zero
            model = DelayModel(form="mean", prior_c=0.0, prior_sd=1e-9)
        pairs = leave_one_out(model, obs)
        errs = sorted(abs(math.log(o.ratio / pr.ratio)) for o, pr in pairs)
        inside = sum(pr.bounds(1.96)[0] <= o.ratio <= pr.bounds(1.96)[1] for o, pr in pairs)
        p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
        rows.append((form, _pct(statistics.median(errs)), _pct(p90), inside / len(pairs), len(pairs)))
    return rows


def _pct(log_err: float) -> float:
    return 100 * (math.exp(log_err) - 1)


def capped_cost(p: Point, cap: float) -> tuple[float, float | None]:
    """What training ``p`` costs with a cap at ``cap`` seconds of clock (stopped at the first validation past
    it without the target, as :mod:`paci_tune.tune.capping` does), and its time to target if it reached it.
    Uncapped, a run costs what the grid's run of it did (a layout the grid read off a shared curve: its own
    curve's last validation, at the target or the budget's end)."""
    full = p.trained_clock or (p.curve[-1][0] if p.curve else 0.0)
    if p.ttt is not None and p.ttt <= cap:
        return min(full, p.ttt) if p.trained_clock == 0 else full, p.ttt
    past = [c for c, _ in p.curve if c >= cap]
    return (min(past[0], full) if past else full), None


def predict_then_verify(points: list[Point], form: str, z: float) -> dict[str, Any]:
    """The procedure of the module docstring's item 3 on one table, each choice made by the product's own
    :func:`paci_tune.tune.planner.choose`; its answer, compute and trainings."""
    flush = [p for p in points if p.schedule != "paci"]
    paci = {p.label: p for p in points if p.schedule == "paci"}
    grid_best = min(p.ttt for p in points if p.ttt is not None)
    grid_cost = sum(p.trained_clock for p in points)
    # Each flush LR's curve trained once on its fastest layout, in the space's order, capped at the flush
    # study's best so far; a capped curve's steps are a lower bound (the planner's optimistic prediction).
    spent, answer, sync, bound = 0.0, None, {}, {}
    for lr in sorted({p.lr_scale for p in flush}):
        fastest = min((p for p in flush if p.lr_scale == lr), key=lambda p: p.step_s)
        cap = answer.ttt if answer is not None and answer.ttt is not None else math.inf
        cost, ttt = capped_cost(fastest, cap)
        spent += cost
        if ttt is not None:
            sync[lr] = ttt / fastest.step_s
        bound[lr] = sync.get(lr, cost / fastest.step_s)
        reached = [p for p in flush if p.lr_scale == lr and p.ttt is not None and ttt is not None]
        best_here = min(reached, key=lambda p: p.ttt, default=None)  # every layout read off the curve
        if best_here is not None and (answer is None or best_here.ttt < answer.ttt):
            answer = best_here
    overall = answer.ttt if answer is not None and answer.ttt is not None else math.inf
    sync_spent = spent
    untrained = [
        Candidate(
            TrialParams("paci", p.stages, p.window, p.microbatch, p.lr_scale),
            p.label,
            p.step_s,
            int(p.budget_steps),
            bound.get(p.lr_scale),
        )
        for p in paci.values()
    ]
    model, observed, best = DelayModel(form=form), [], math.inf  # the product's priors and floor
    while True:
        # PACI's own best, as the planner's study reads it
        pick = choose(untrained, {None: model.fit(observed)}, best, z)
        if pick is None:
            break
        untrained.remove(pick)
        p = paci[pick.key]
        cost, ttt = capped_cost(p, best)  # capping reads the study's own best too (tune/capping.py)
        spent += cost
        steps = (ttt / p.step_s) if ttt is not None else max(cost / p.step_s, 1.0)
        if p.lr_scale in sync:
            observed.append(Observation(p.stages, p.window, p.lr_scale, steps / sync[p.lr_scale], ttt is not None))
        if ttt is not None and ttt < best:
            best = ttt
        if ttt is not None and ttt < overall:
            overall, answer = ttt, p
    return {
        "answer": answer.label if answer else None,
        "ratio": overall / grid_best,
        "compute": spent / grid_cost,
        "sync_compute": sync_spent / grid_cost,
        "paci_trained": len(paci) - len(untrained),
    }


SHARED_TABLES = ("table.json", "table-muon.json")  # one draw of each point, shared curves: AdamW, then Muon


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same tables (the bench trains nothing)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    tables = {
        name: load(TABLES / name)[0] for name in (*SHARED_TABLES, "table-unshared.json") if (TABLES / name).exists()
    }
    floor = noise_floor(tables["table-unshared.json"]) or 0.1
    out: dict[str, Any] = {"noise_floor_log_sd": floor, "held_out": {}, "predict_then_verify": []}
    print(f"noise floor: sd of log steps to target across replicate flush runs (table-unshared) {floor:.3f}")
    for name, pts in tables.items():
        obs = observations(pts, sync_steps(pts))
        print(f"\n{name}: {len(obs)} PACI points, leave-one-out over the {sum(o.reached for o in obs)} that reached")
        print("| form | median error | p90 error | inside the 95% interval | points |\n|---|---|---|---|---|")
        out["held_out"][name] = rows = held_out_rows(obs)
        for form, med, p90, cover, n in rows:
            print(f"| {form} | {med:.0f}% | {p90:.0f}% | {cover:.0%} | {n} |")
    for name in (n for n in SHARED_TABLES if n in tables):
        print(f"\npredict, then verify, on {name}")
        print("| form | z | answer | / grid best | compute / grid | of it flush's | PACI points trained |")
        print("|---|---|---|---|---|---|---|")
        for form in FORMS:
            for z in (0.0, 0.5, 1.0, 1.96):
                r = predict_then_verify(tables[name], form, z)
                out["predict_then_verify"].append({"table": name, "form": form, "z": z, **r})
                figures = f"{r['ratio']:.3f} | {r['compute']:.3f} | {r['sync_compute']:.3f} | {r['paci_trained']}"
                print(f"| {form} | {z} | {r['answer']} | {figures} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
