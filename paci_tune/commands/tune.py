"""``paci-tune search`` and ``paci-tune apply``: the tuner's command line."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from ..config import REMOVE, apply_overrides, load_run_config, read_yaml
from ..config.tune import load_tune_config
from ..errors import ConfigError
from ..options import overrides_from, run_options


def _stderr(msg: str) -> None:
    click.echo(msg, err=True)


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
    help="Optuna storage URL: sqlite:///f.db (default: WORKDIR/study.db), postgresql://..., "
    "mysql://..., or a journal file (journal:///f.log, or a path ending in .log).",
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
@click.option("--sampler", type=click.Choice(["tpe", "random", "grid"]), default=None, help="Optuna sampler.")
@click.option(
    "--pruner",
    type=click.Choice(["hyperband", "successive_halving", "median", "none"]),
    default=None,
    help="Optuna pruner on the clock grid.",
)
@click.option("--seed", type=int, default=None, help="Sampler seed (overrides search.seed).")
@click.option("--live/--no-live", default=True, help="Rich live view (default on a terminal) or plain lines.")
def search(config: str, out: str, storage: str | None, study_name: str | None, workdir: str | None,
           trials: int | None, space: str | None, sampler: str | None, pruner: str | None, seed: int | None,
           live: bool) -> None:  # fmt: skip
    """Tune window, micro-batch size and depth for time to target; write best.yaml.

    Running the same command again resumes the study from its storage; several workers (on one
    or many machines) may run it at once against a shared storage.
    """
    import optuna

    from ..tune.best import build_best, write_best
    from ..tune.runner import SubprocessRunner
    from ..tune.search import Search
    from ..tune.setup import bind_space, enqueue_start_points, fingerprint, profile_for
    from ..tune.study import open_storage, open_studies
    from ..tune.view import SearchView

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the view reports trials; Optuna's INFO lines repeat it
    doc = read_yaml(config)
    over = {"search.trials": trials, "search.space": space, "search.sampler": sampler, "search.pruner": pruner,
            "search.seed": seed}  # fmt: skip
    tune = load_tune_config(apply_overrides(doc, over), config)
    name = study_name or tune.search.study_name or Path(config).stem
    work = Path(workdir or Path("paci-search") / name).resolve()
    storage_url = storage or f"sqlite:///{work / 'study.db'}"
    space_ = bind_space(tune)
    stamp = fingerprint(tune, space_)
    # The storage first: a bad URL or a different stored search is refused before any measuring.
    studies = open_studies(open_storage(storage_url), name, space_.schedules, tune.search, space_, tune.budget.grid,
                           stamp)  # fmt: skip
    profile = profile_for(tune, space_, work)
    enqueue_start_points(tune, space_, studies)
    runner = SubprocessRunner(stall_seconds=tune.search.stall_seconds, timeout=tune.search.trial_timeout)
    b = tune.budget
    view = SearchView(float(b.seconds or 0), b.clock, float(tune.target.value or 0), live=live)
    view.seed(_existing_rows(studies, space_.fixed_batch))
    srch = Search(tune, space_, studies, runner, work, profile, on_event=view.on_event)
    _stderr(f"study {name} ({', '.join(space_.schedules)}; {tune.search.trials} trials each) in {storage_url}; "
            f"trial logs in {work / 'trials'}")  # fmt: skip
    try:
        with view:
            srch.run()
    except KeyboardInterrupt:
        _stderr("interrupted: finished trials are in the storage; run the same command again to resume")
        sys.exit(130)
    best = build_best(
        studies,
        run_doc_for=srch.trial_doc,
        base_lr=float(tune.run.optimizer.lr),
        fixed_batch=space_.fixed_batch,
        target={"metric": tune.target.metric, "value": tune.target.value},
        budget={"clock": b.clock, "seconds": b.seconds, "grid": b.grid},
        provenance={"study_name": name, "storage": storage_url, "clock": b.clock, "profile": profile,
                    "space": space_.describe(), "sampler": tune.search.sampler, "pruner": tune.search.pruner,
                    "seed": tune.search.seed, "config": str(Path(config).resolve())},
    )  # fmt: skip
    out_path = Path(out)
    from ..tune.plot import plot_search

    rec_number = int(str(best["evidence"]["trial"]).rsplit("#", 1)[-1])
    picture = plot_search(studies, target=float(tune.target.value or 0), budget=float(b.seconds or 0), clock=b.clock,
                          best=(best["recommended"]["schedule"], rec_number), path=work / "trials.png")  # fmt: skip
    best["provenance"]["plot"] = str(picture)
    write_best(out_path, best)
    _print_best(best, out_path)


def _existing_rows(studies: dict[str, Any], fixed_batch: int | None) -> list[dict[str, Any]]:
    from ..tune.best import params_of

    rows = []
    for schedule, study in studies.items():
        for t in study.get_trials(deepcopy=False):
            if not t.state.is_finished() or not t.params:
                continue
            state = t.state.name.lower().replace("fail", "failed")
            note = t.user_attrs.get("fail_reason") or (
                f"pruned at step {t.user_attrs.get('pruned_step')}" if state == "pruned" else "from the storage"
            )
            rows.append({"schedule": schedule, "number": t.number, "point": params_of(t, schedule, fixed_batch).label(),
                         "state": state, "ttt": t.user_attrs.get("time_to_target"), "note": note,
                         "value": t.value})  # fmt: skip
    return rows


def _print_best(best: dict[str, Any], path: Path) -> None:
    r, e = best["recommended"], best["evidence"]
    ttt = e.get("time_to_target")
    reached = f"reaches val_loss {best['target']['value']:g} at {ttt:.3g}s" if ttt is not None else "misses the target"
    _stderr(f"recommended: {r['schedule']} P={r['stages']} a={r['window']} b={r['microbatch_size']} "
            f"lr={r['lr']:.3g}: {reached} on the {best['budget']['clock']} clock")  # fmt: skip
    base = best.get("baseline")
    if base:
        bt = base.get("time_to_target")
        won = f", PACI {'won' if best.get('paci_won') else 'did not win'}" if "paci_won" in best else ""
        took = f"{bt:.3g}s" if bt is not None else "misses the target"
        _stderr(f"flush baseline: 1f1b P={base['stages']} m={base['window']} b={base['microbatch_size']}: {took}; "
                f"speedup_vs_flush {best['speedup_vs_flush']}x{won}")  # fmt: skip
    counts = best["provenance"]["trials"]
    _stderr("trials: " + "; ".join(f"{s} {c['complete']} complete, {c['pruned']} pruned, {c['failed']} failed"
                                  for s, c in counts.items()))  # fmt: skip
    _stderr(f"wrote {path}; the trials' curves: {best['provenance'].get('plot')}")


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
def apply(best: str, until: str, resume: bool, dry_run: bool, metrics: str | None, live: bool,
          **options: Any) -> None:  # fmt: skip
    """Train with the configuration recommended in BEST (a best.yaml from `paci-tune search`).

    Options override the recommendation (e.g. --steps for a different length, --runtime
    distributed --clock wall for the real pipeline). Checkpoints go to BEST's folder unless
    --checkpoint-dir says otherwise, so an interrupted run continues with --resume.
    """
    from ..cli import run_training
    from ..tune.best import read_best

    doc = read_best(best)
    run_doc = doc["run"]
    best_path = Path(best).resolve()
    over = overrides_from(options)
    if until == "budget":
        over["training.target_val_loss"] = REMOVE
    if over.get("training.checkpoint_dir") is None:
        over["training.checkpoint_dir"] = str(best_path.parent / f"{best_path.stem}-checkpoints")
    if over.get("training.checkpoint_every") is None and not run_doc["training"].get("checkpoint_every"):
        # About four checkpoints over the run: its length in steps, or the search's trial's.
        steps = over.get("training.steps") or (doc.get("evidence") or {}).get("steps") or 100
        over["training.checkpoint_every"] = max(1, int(steps) // 4)
    if over.get("training.steps") is not None:
        over["training.eval_every_seconds"] = REMOVE
        over["training.eval_every"] = max(1, int(over["training.steps"]) // 8)
    cfg = load_run_config(apply_overrides(run_doc, over))
    run_path = best_path.parent / f"{best_path.stem}.run.yaml"
    from ..pipeline.launch import write_resolved

    write_resolved(cfg, run_path)
    if dry_run:
        click.echo(f"# {run_path}")
        click.echo(run_path.read_text(), nl=False)
        cmd = ["paci-tune", "train", str(run_path)] + (["--resume"] if resume else [])
        if metrics:
            cmd += ["--metrics", metrics]
        click.echo("# launch:")
        click.echo(shlex.join(cmd))
        if cfg.pipeline.runtime == "distributed":
            from ..pipeline.launch import worker_command

            click.echo("# which starts the pipeline workers as (torchrun, one process per stage):")
            click.echo(shlex.join(["torchrun", *worker_command(run_path, cfg.pipeline.stages, [])[4:]]))
        return
    from ..train import checkpoint

    if not resume and cfg.training.checkpoint_dir and checkpoint.latest(Path(cfg.training.checkpoint_dir)):
        raise ConfigError("--resume", False, f"--resume, or a new --checkpoint-dir: {cfg.training.checkpoint_dir} "
                                             "already holds checkpoints of a run")  # fmt: skip
    _stderr(f"training {cfg.pipeline.schedule} P={cfg.pipeline.stages} a={cfg.pipeline.window} "
            f"b={cfg.pipeline.microbatch_size} from {best} (config {run_path})")  # fmt: skip
    run_training(cfg, metrics=metrics, resume=resume, live=live)


__all__ = ["apply", "search"]
