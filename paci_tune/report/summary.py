"""The report's words and tables, shared by the terminal and the HTML page.

One sentence for the verdict, then tables as plain rows (lists of strings): the chosen point of
each schedule, its confirmation per seed, the trial counts with the reasons for pruned and failed
trials, the compute spent. Both renderers (rich in :mod:`paci_tune.cli.report`, HTML in
:mod:`.page`) show exactly these, so the two cannot disagree. May import: :mod:`.gather` and
:mod:`paci_tune.config` (its byte formatter).
"""

from __future__ import annotations

from dataclasses import dataclass

from .gather import Evidence


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


def _g(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.4g}{unit}"


def verdict_sentence(ev: Evidence) -> str:
    """What the search found, in one sentence a user can act on (and where its trials started)."""
    warm = ev.best.warm_start if ev.best is not None else None
    start = f" Every trial was {warm['note']}." if warm and warm.get("note") else ""
    return _verdict(ev) + start


def _verdict(ev: Evidence) -> str:
    best = ev.best
    if best is None:
        return (
            f"No recommendation yet: study {ev.name} has no best.yaml (run `paci-tune search` to finish it); "
            "the tables show its trials as they stand."
        )
    r = best.recommended
    d = r.layout.data_parallel
    where = f" x D={d} on {r.devices if r.devices is not None else r.layout.devices} devices" if d != 1 else ""
    bw = r.backward_weights
    w = f" w={bw}" if bw not in (None, "forward") else ""  # as a trial's label: only the non-default value
    point = f"{r.schedule} P={r.stages}{where} a={r.window} b={r.microbatch_size}{w} lr={r.lr:.3g}"
    v = f" v={r.extra['chunks']}" if r.extra.get("chunks") else ""
    point = point.replace(f" P={r.stages}", f" P={r.stages}{v}", 1)
    if r.optimizer:  # the optimizer it trains with, and PACI's staleness controls that are on
        controls = [k for k in ("stage_momentum", "predict_weights", "stale_lr") if r.extra.get(k) not in (None, False)]
        point += f" on {r.optimizer.get('name')}" + "".join(f" +{k}" for k in controls)
    comparison = best.verdict_record
    if comparison is None:
        if best.verdict:  # a file from before the comparison record: its verdict as written
            return f"Verdict: {best.verdict}. Recommended: {point} on the {ev.clock} clock."
        return f"Recommended {point}; no PACI and synchronous pair finished, so there is no comparison."
    notes = "".join(f" Note: {n}." for n in comparison.notes)
    return (
        f"Verdict: {comparison.sentence()}. Method: {comparison.method}.{notes} "
        f"Recommended: {point} on the {ev.clock} clock."
    )


def comparison_table(ev: Evidence) -> Table | None:
    """The verdict's evidence: each compared point, and the ratio on every paired seed."""
    c = ev.best.verdict_record if ev.best is not None else None
    if c is None:
        return None
    rows = [
        [side["schedule"], side["point"], side["trial"], _g(side["mean"], "s"), f"{side['reached']}/{side['runs']}"]
        for side in (c.paci, c.baseline)
    ]
    rows += [
        [f"seed {seed}", f"{c.baseline_name} / PACI", "-", f"{ratio:.4g}x", "-"] for seed, ratio in c.ratios.items()
    ]
    iv = f"[{c.interval[0]:.4g}, {c.interval[1]:.4g}]" if c.interval else "none"
    rows.append(["all", f"geometric mean, interval {iv}", c.stopped_by or "-", f"{c.speedup:.4g}x", f"n = {c.n}"])
    return Table(f"Comparison: {c.method}", ["side", "point", "trial", "mean score / ratio", "reached"], rows)


def chosen_points(ev: Evidence) -> Table:
    rows = []
    for s in ev.studies:
        w = ev.winner(s)
        if w is None:
            rows.append([s, "no finished trial", "-", "-", "-", "-"])
            continue
        conf = ev.confirmations(s, w.number)
        scores = [c.score for c in conf if c.score is not None]
        mean = sum(scores) / len(scores) if scores else None
        rows.append(
            [
                s,
                f"#{w.number} {w.label}",
                _g(w.score, "s"),
                _g(w.time_to_target, "s"),
                _g(w.best_val_loss),
                f"{_g(mean, 's')} over {len(scores)} seeds" if scores else "-",
            ]
        )
    return Table(
        "Chosen point per schedule",
        ["schedule", "trial", "search score", "time to target", "best val loss", "confirmed mean"],
        rows,
    )


def confirmation(ev: Evidence) -> Table:
    rows = []
    for s in ev.studies:
        w = ev.winner(s)
        for c in ev.confirmations(s, w.number) if w else []:
            reached = "yes" if c.time_to_target is not None else "no"
            rows.append([s, str(c.seed), f"#{c.number}", c.state, _g(c.score, "s"), reached, _g(c.best_val_loss)])
    return Table(
        "Confirmation: the chosen points on fresh seeds",
        ["schedule", "seed", "trial", "state", "score", "reached target", "best val loss"],
        rows,
    )


def counts(ev: Evidence) -> Table:
    rows = []
    for s, c in ev.counts().items():
        reasons = "; ".join(f"{k} x{n}" for k, n in ev.reasons(s).items()) or "-"
        rows.append(
            [
                s,
                str(c["complete"]),
                str(c["pruned"]),
                str(c["failed"]),
                str(c.get("infeasible", 0)),
                str(c["confirmation"]),
                reasons,
            ]
        )
    header = [
        "schedule",
        "complete",
        "pruned",
        "failed",
        "outside budget",
        "confirmation",
        "why pruned / failed / unrun",
    ]
    return Table("Trials", header, rows)


def compute(ev: Evidence) -> Table:
    prov = (ev.best.provenance if ev.best else None) or {}
    used = prov.get("compute") or {}
    rows = [[k.removesuffix("_s").replace("_", " "), _g(v, " s")] for k, v in used.items()]
    rows.append(["storage", ev.storage])
    rows.append(["study", ev.name])
    if ev.note:  # no storage opened: the trials' tables are best.yaml's counts, and this says how to add them
        rows.append(["note", ev.note])
    return Table("Compute and provenance (trial processes' wall seconds)", ["what", "value"], rows)


def candidates(ev: Evidence) -> Table:
    """best.yaml's ranked table: each schedule's best points, with step time and predicted peak memory."""
    from ..config.memory import format_bytes

    ranked = (ev.best.candidates if ev.best else None) or {}
    rows = [
        [
            s,
            str(r["rank"]),
            f"#{r['trial']} {r['point']}",
            "-" if r.get("step_time_s") is None else f"{r['step_time_s'] * 1e3:.1f} ms",
            "-" if r.get("predicted_peak_bytes") is None else format_bytes(r["predicted_peak_bytes"]),
            _g(r.get("score"), "s"),
            "yes" if r.get("reached_target") else "no",
        ]
        for s, table in ranked.items()
        for r in table
    ]
    return Table(
        "Candidates: each schedule's best points (search draws)",
        ["schedule", "rank", "trial", "step", "predicted peak per device", "score", "reached target"],
        rows,
    )


def memory_dropped(ev: Evidence) -> Table:
    """The points ``hardware.memory`` dropped before any trial, each with its predicted peak."""
    from ..config.memory import format_bytes

    mem = (ev.best.memory if ev.best else None) or {}
    rows = [
        [
            d["schedule"],
            d["reason"].split(":")[0],
            format_bytes(d["predicted_peak_bytes"]),
            str(d["stage"]),
            format_bytes(d["memory_bytes"]),
        ]
        for d in mem.get("dropped") or []
    ]
    return Table(
        f"Dropped for memory: predicted above hardware.memory ({mem.get('memory')})",
        ["schedule", "point", "predicted peak", "on stage", "hardware.memory"],
        rows,
    )


def tables(ev: Evidence) -> list[Table]:
    out = [chosen_points(ev), candidates(ev), confirmation(ev), counts(ev), compute(ev)]
    if (compared := comparison_table(ev)) is not None:
        out.insert(1, compared)
    if ev.best is not None and ev.best.memory:
        out.insert(2, memory_dropped(ev))
    return out
