"""``index.html``: the whole report in one file that opens from disk, with no server and no network.

Every picture is embedded as a base64 ``data:`` URI (the PNGs are also written beside it, for
slides and chats), there is no script and no external style sheet, so the file can be mailed or
attached to a ticket and still shows everything. May import: :mod:`.summary`, :mod:`paci_tune.base`.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

from ..base.files import atomic_write_text
from .summary import Table

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
p.verdict { font-size: 1.1em; background: #f3f6fa; padding: .8em 1em; border-left: 4px solid #4477AA; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; }
th { background: #f0f0f0; } img { max-width: 100%; border: 1px solid #eee; }
p.note { color: #666; font-size: .9em; }
"""


@dataclass(frozen=True)
class Picture:
    """One picture of the report: its file (None when there was nothing to draw) and its caption."""

    key: str
    title: str
    path: Path | None
    caption: str


def _table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    if not t.rows:
        body = f'<tr><td colspan="{len(t.header)}">none</td></tr>'
    return f"<h2>{html.escape(t.title)}</h2>\n<table><tr>{head}</tr>{body}</table>"


def _picture(p: Picture) -> str:
    if p.path is None:
        return f'<h2>{html.escape(p.title)}</h2>\n<p class="note">Not drawn: {html.escape(p.caption)}</p>'
    data = base64.b64encode(p.path.read_bytes()).decode("ascii")
    return (
        f'<h2>{html.escape(p.title)}</h2>\n<img id="{p.key}" alt="{html.escape(p.title)}" '
        f'src="data:image/png;base64,{data}">\n<p class="note">{html.escape(p.caption)}</p>'
    )


def write_page(path: Path, *, title: str, verdict: str, tables: list[Table], pictures: list[Picture]) -> Path:
    """Write the page atomically; returns its path."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="verdict" id="verdict">{html.escape(verdict)}</p>',
        *(_table(t) for t in tables[:1]),
        *(_picture(p) for p in pictures),
        *(_table(t) for t in tables[1:]),
        "</body></html>",
    ]
    text = "\n".join(parts) + "\n"
    return atomic_write_text(path, text)
