"""``paci-tune report``: a search's evidence in the terminal, and as pictures plus one HTML page.

The work is the report layer's (:mod:`paci_tune.report`); this module parses options and renders
its verdict and tables with rich (and which storage it opened is the report layer's rule,
:mod:`paci_tune.report.gather`). May import: :mod:`paci_tune.report`, :mod:`paci_tune.base`, click, rich.
"""

from __future__ import annotations

import click

from ..base.credentials import STORAGE_ENV


@click.command()
@click.argument("best", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--storage",
    default=None,
    help=f"Optuna storage URL of the search (default: {STORAGE_ENV}, or best.yaml's own SQLite or journal file "
    "beside it). The storage best.yaml names elsewhere is not opened unless you name it: the report is then "
    "best.yaml's alone. A SQLite or journal file must exist (a report creates none).",
)
@click.option("--study-name", default=None, help="The search's study name (default: best.yaml's).")
@click.option(
    "--out",
    default="paci-report",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the PNGs and index.html.",
)
def report(best: str | None, storage: str | None, study_name: str | None, out: str) -> None:
    """Show why the tuner chose what it chose: BEST (a best.yaml), or --storage and --study-name.

    The storage BEST names is opened only when you name it too (--storage, PACI_TUNE_STORAGE), or
    when it is a SQLite or journal file beside BEST (read-only); otherwise the report is BEST's alone.

    Prints the verdict, the chosen point per schedule, the confirmation per seed, the trial counts
    with the reasons for pruned and failed trials, and the compute used; writes the pictures and a
    self-contained OUT/index.html (opens from disk, no server, no network).
    """
    from pathlib import Path

    import optuna
    from rich.console import Console
    from rich.table import Table as RichTable

    from ..report import gather, make_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console(stderr=True)
    ev = gather(best, storage, study_name)
    rep = make_report(ev, Path(out))
    if ev.note:  # one line, unwrapped: a log or CI reader greps it
        click.echo(f"note: {ev.note}", err=True)
    console.print(f"[bold]{rep.verdict}[/bold]")
    for t in rep.tables:
        table = RichTable(title=t.title, title_justify="left")
        for h in t.header:
            table.add_column(h)
        for row in t.rows:
            table.add_row(*row)
        console.print(table)
    for p in rep.pictures:
        if p.path is None:
            console.print(f"[dim]{p.title}: not drawn ({p.caption})[/dim]")
    console.print(f"report: {rep.index} ({sum(p.path is not None for p in rep.pictures)} pictures)")
