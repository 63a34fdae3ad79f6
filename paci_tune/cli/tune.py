"""``paci-tune search`` and ``paci-tune apply``: the tuner's command line.

The work is the tune and verdict layers' (:mod:`paci_tune.tune.session`, :mod:`paci_tune.verdict.recommend`,
:mod:`paci_tune.tune.apply`); this module parses options and shows progress and the result. May import:
:mod:`paci_tune.tune`, :mod:`paci_tune.verdict`, :mod:`paci_tune.base`, :mod:`paci_tune.train` (``--log``'s
sinks), click, rich.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from ..base.credentials import STORAGE_ENV
from .common import stderr, train_with_view
from .options import log_option, overrides_from, run_options


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--out",
    default="best.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the recommendation.",
)
@click.option(
    "--storage",
    default=None,
    envvar=STORAGE_ENV,
    show_envvar=True,
    help="Optuna storage URL: sqlite:///f.db (default: WORKDIR/study.db), postgresql://..., "
    "mysql://..., or a journal file (journal:///f.log, or a path ending in .log). A URL with a password "
    "belongs in the environment variable, not on the command line (which every user can read).",
)
@click.option("--study-name", default=None, help="Study name (default: search.study_name, else the config's stem).")
@click.option(
    "--workdir",
    default=None,
    type=click.Path(file_okay=False),
    help="Trial logs, the cost profile and the default storage (default: paci-search/STUDY).",
)
@click.option("--trials", type=int, default=None, help="Trials per schedule (overrides search.trials).")
@click.option("--space", default=None, help="Search space: a shipped name or a YAML path (overrides search.space).")
@click.option(
    "--strategy",
    type=click.Choice(["sample", "predict"]),
    default=None,
    help="How each study picks its next point: its sampler, or predict-then-verify (sim and rst clocks).",
)
@click.option("--sampler", type=click.Choice(["tpe", "random", "grid"]), default=None, help="Optuna sampler.")
@click.option(
    "--pruner",
    type=click.Choice(["hyperband", "successive_halving", "median", "none"]),
    default=None,
    help="Optuna pruner on the clock grid.",
)
@click.option("--seed", type=int, default=None, help="Sampler seed (overrides search.seed).")
@click.option(
    "--memory",
    default=None,
    help="Each device's memory, 24GiB or bytes (overrides hardware.memory): points predicted above it "
    "are dropped before any trial.",
)
@click.option("--live/--no-live", default=True, help="Rich live view (default on a terminal) or plain lines.")
def search(
    config: str,
    out: str,
    storage: str | None,
    study_name: str | None,
    workdir: str | None,
    trials: int | None,
    space: str | None,
    strategy: str | None,
    sampler: str | None,
    pruner: str | None,
    seed: int | None,
    memory: str | None,
    live: bool,
) -> None:
    """Tune window, micro-batch size and depth for time to target; write best.yaml.

    Running the same command again resumes the study from its storage; several workers (on one
    or many machines) may run it at once against a shared storage.
    """
    import optuna

    from ..base.credentials import shown
    from ..tune.session import open_search
    from ..verdict.recommend import recommend
    from .search_view import SearchView

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the view reports trials; Optuna's INFO lines repeat it
    given = {
        "search.trials": trials,
        "search.space": space,
        "search.strategy": strategy,
        "search.sampler": sampler,
        "search.pruner": pruner,
        "search.seed": seed,
        "hardware.memory": memory,
    }
    session = open_search(
        config,
        overrides={k: v for k, v in given.items() if v is not None},
        study_name=study_name,
        workdir=workdir,
        storage=storage,
        log=stderr,
        out=out,
    )
    tune, b = session.tune, session.tune.budget
    view = SearchView(float(b.seconds or 0), b.clock, float(tune.target.value or 0), live=live)
    view.seed(_existing_rows(session.studies, session.space.fixed_batch))
    srch = session.search(view.on_event)
    stderr(
        f"study {session.name} ({', '.join(session.space.schedules)}; {tune.search.trials} trials each) in "
        f"{shown(session.storage_url)}; trial logs in {session.workdir / 'trials'}"
    )
    with view:  # Ctrl-C: exit 130 from the one handler (.failures); finished trials stay in the storage
        srch.run()
    out_path = Path(out)
    _print_best(recommend(session, srch, out_path), out_path)


def _existing_rows(studies: dict[str, Any], fixed_batch: int | None) -> list[dict[str, Any]]:
    from ..tune.record import TrialRecord
    from ..verdict.best import params_of

    rows = []
    for schedule, study in studies.items():
        for t in study.get_trials(deepcopy=False):
            if not t.state.is_finished() or not t.params:
                continue
            state = t.state.name.lower().replace("fail", "failed")
            r = TrialRecord.read(t)
            note = r.fail_reason or (
                f"{'capped' if r.capped_at is not None else 'pruned'} at step {r.pruned_step}"
                if state == "pruned"
                else "from the storage"
            )
            rows.append(
                {
                    "schedule": schedule,
                    "number": t.number,
                    "point": params_of(t, schedule, fixed_batch).label(),
                    "state": state,
                    "ttt": r.time_to_target,
                    "note": note,
                    "value": t.value,
                }
            )
    return rows


def _outcome(best: dict[str, Any], schedule: str, search_ttt: float | None) -> str:
    """How a schedule's point did: over the confirmation's seeds when there is one, else its search trial."""
    rows = (best.get("confirmation") or {}).get(schedule)
    if rows:
        row = rows[0]  # the plan's first: the point the search ranked best
        reached = sum(v["time_to_target"] is not None for v in row["seeds"].values())
        return f"mean score {row['mean']:.3g}s over {len(row['seeds'])} fresh seeds (target reached on {reached})"
    if search_ttt is not None:
        return f"reaches val_loss {best['target']['value']:g} at {search_ttt:.3g}s (one draw)"
    return "misses the target (one draw)"


def _print_best(best: dict[str, Any], path: Path) -> None:
    from ..tune.choices import DEFAULT_BACKWARD_WEIGHTS

    r, e = best["recommended"], best["evidence"]
    bw = r.get("backward_weights")
    w = f"w={bw} " if bw not in (None, DEFAULT_BACKWARD_WEIGHTS) else ""  # as a trial's label says it
    v = f" v={r['chunks']}" if r.get("chunks") else ""
    stderr(
        f"recommended: {r['schedule']} P={r['stages']}{v} D={r.get('data_parallel', 1)} a={r['window']} "
        f"b={r['microbatch_size']} {w}"
        f"lr={r['lr']:.3g}: {_outcome(best, r['schedule'], e.get('time_to_target'))} on the "
        f"{best['budget']['clock']} clock"
    )
    from ..tune.comparison import Comparison

    if best.get("comparison"):
        c = Comparison.from_doc(best["comparison"])
        base = c.baseline
        runs = f"over {base['runs']} fresh seeds" if c.interval is not None or c.n > 1 else "(one draw)"
        stderr(
            f"strongest synchronous baseline ({c.baseline_name}): {base['point']}: "
            f"mean score {base['mean']:.3g}s {runs} (target reached on {base['reached']})"
        )
        stderr(f"verdict: {c.sentence()}")
        if c.interval is not None:
            ratios = ", ".join(f"{r:.4g}" for r in c.ratios.values())
            stderr(
                f"  {c.method}; n = {c.n} (min {c.min_seeds}, max {c.max_seeds}), stopped by {c.stopped_by}; "
                f"per-seed {c.baseline_name}/PACI ratios {ratios}; level of this look {c.look_level:.3g}"
            )
        for note in c.notes:
            stderr(f"  note: {note}")
    elif best.get("lr_edges"):
        for edge in best["lr_edges"]:
            stderr(f"  note: {edge['note']}")
    if best.get("warm_start"):
        stderr(f"warm start: every trial {best['warm_start']['note']}")
    from ..verdict.transfer import summary_line

    if (line := summary_line(best.get("transfer_check"))) is not None:
        stderr(line)
    _print_candidates(best)
    counts = best["provenance"]["trials"]
    stderr(
        "trials: "
        + "; ".join(
            f"{s} {c['complete']} complete, {c['pruned']} pruned"
            + (f" ({c['capped']} of them capped: they could not rank)" if c.get("capped") else "")
            + f", {c['failed']} failed"
            + (f", {c['infeasible']} outside the device budget (unrun)" if c.get("infeasible") else "")
            + (
                f", {c['other_layouts']} of them other layouts of a trained curve (unrun)"
                if c.get("other_layouts")
                else ""
            )
            for s, c in counts.items()
        )
    )
    stderr(f"wrote {path}; the trials' curves: {best['provenance'].get('plot')}")


def _print_candidates(best: dict[str, Any]) -> None:
    """The ranked table (each schedule's best points, best.yaml's ``candidates``) and the points the device
    budget dropped (``memory.dropped``), as an autotuner's closing summary lists them."""
    from rich.console import Console
    from rich.table import Table

    from .ui import fmt_bytes

    mem = best.get("memory") or {}
    title = "candidates: each schedule's best points (search draws)"
    if mem:
        title += f" · hardware.memory {mem.get('memory')} per device"
    table = Table(title=title, title_justify="left")
    for col in ("schedule", "#", "point", "step", "peak/device", "score", "target"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for schedule, rows in (best.get("candidates") or {}).items():
        for row in rows:
            peak, step = row.get("predicted_peak_bytes"), row.get("step_time_s")
            table.add_row(
                schedule,
                str(row["rank"]),
                row["point"],
                "-" if step is None else f"{step * 1e3:.1f} ms",
                "-" if peak is None else fmt_bytes(peak),
                f"{row['score']:.3g}",
                "reached" if row["reached_target"] else "missed",
            )
    dropped = mem.get("dropped") or []
    if dropped:
        table.caption = f"{len(dropped)} point(s) dropped before any trial, predicted above hardware.memory"
    Console(stderr=True, width=max(Console(stderr=True).width, 100)).print(table)
    for d in dropped:  # plain lines: a log or CI reader greps them, unwrapped
        stderr(f"  dropped: {d['reason']}")


# ------------------------------------------------------------------------------------ apply
@click.command()
@click.argument("best", type=click.Path(dir_okay=False))
@run_options
@click.option(
    "--until",
    type=click.Choice(["target", "budget"]),
    default="target",
    show_default=True,
    help="Stop at the first validation that reaches the target, or train through the whole budget.",
)
@click.option("--resume", is_flag=True, help="Resume from the newest checkpoint in the checkpoint folder.")
@click.option("--dry-run", is_flag=True, help="Write the run config, print it and the launch command; train nothing.")
@click.option("--metrics", type=click.Path(dir_okay=False), default=None, help="Write JSON-lines metrics here.")
@click.option("--live/--no-live", default=True, help="Rich live progress (default on a terminal) or plain lines.")
@log_option("--log")
@click.option(
    "--trust-entry",
    metavar="MODULE:FUNCTION",
    default=None,
    help="Import and run the user model BEST names (run.model.entry), which must be this one: a best.yaml "
    "alone never makes apply run code. Built-in models need nothing.",
)
def apply(
    best: str,
    until: str,
    resume: bool,
    dry_run: bool,
    metrics: str | None,
    live: bool,
    trust_entry: str | None,
    log_to: tuple[str, ...],
    **options: Any,
) -> None:
    """Train with the configuration recommended in BEST (a best.yaml from `paci-tune search`).

    Options override the recommendation (e.g. --steps for a different length, --runtime
    distributed --clock wall for the real pipeline). Checkpoints go to BEST's folder unless
    --checkpoint-dir says otherwise, so an interrupted run continues with --resume. A BEST whose
    model is your own code (model.entry) is applied only with --trust-entry naming it.
    """
    from ..train.sinks import parse_sinks
    from ..tune.apply import prepare_apply

    sinks = parse_sinks(log_to)  # before best.yaml is read or anything is trained
    prepared = prepare_apply(
        best,
        overrides_from(options),
        until=until,
        metrics=metrics,
        resume=resume,
        dry_run=dry_run,
        log=stderr,
        trust_entry=trust_entry,
    )
    if dry_run:
        click.echo(f"# {prepared.run_path}")
        click.echo(prepared.run_path.read_text(), nl=False)
        train, *workers = prepared.launch_commands(resume=resume, metrics=metrics, sinks=sinks)
        click.echo("# launch:")
        click.echo(shlex.join(train))
        for cmd in workers:
            click.echo("# which starts the pipeline workers as (torchrun, one process per stage x replica):")
            click.echo(shlex.join(cmd))
        return
    stderr(prepared.describe())
    train_with_view(prepared.run, metrics=metrics, resume=resume, live=live, sinks=sinks)


__all__ = ["apply", "search"]
