"""Storage URLs without their passwords: what paci-tune shows, records and hands on.

A study's storage URL may carry a database password (``postgresql+psycopg://user:PASSWORD@host/db``,
or ``?password=`` in its query). The password is needed to open the storage and nowhere else, so:

- what a person reads (the terminal, log and error lines, the report) shows the URL with the
  password as ``***`` (:func:`shown`), as SQLAlchemy's ``render_as_string(hide_password=True)`` does;
- what is kept (best.yaml's ``provenance.storage``) has no password at all (:func:`without_password`),
  so the same URL opens the storage again with libpq's own ``PGPASSWORD`` or ``~/.pgpass``, or with
  :data:`STORAGE_ENV` naming the full URL;
- every password a process has opened a storage with is remembered (:func:`remember`), and the one
  place that prints a failure scrubs it out of any text (:func:`scrub`): a database driver's message
  may quote its URL;
- no child process gets the URL: trials never open the storage, and :data:`STORAGE_ENV` is taken
  out of their environment (:func:`without_storage`, read by :func:`paci_tune.base.processes.child_environment`).

Parsed with the standard library (the ground floor loads nothing else): the user information of a
URL is everything before the last ``@`` of its authority, its password after the first ``:`` there,
percent-encoded. May import: the standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

STORAGE_ENV = "PACI_TUNE_STORAGE"
"""The environment variable that may hold the storage URL, password and all, instead of ``--storage``
(a command line is readable by every user of the machine; an environment only by its owner)."""

HIDDEN = "***"
_QUERY_SECRETS = ("password", "passwd")
_SECRETS: set[str] = set()


def _parts(url: str) -> tuple[str, str | None] | None:
    """(the URL's user-information, its raw password or None); None for a URL without an authority."""
    if "://" not in url:
        return None
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return None
    if "@" not in netloc:
        return None
    userinfo = netloc.rpartition("@")[0]
    user, colon, password = userinfo.partition(":")
    return user, (password if colon else None)


def _replace(url: str, password: str | None) -> str:
    """``url`` with its password (in the authority and in the query) replaced, or removed with None."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    found = _parts(url)
    if found is not None and found[1] is not None:
        host = netloc.rpartition("@")[2]
        netloc = f"{found[0]}:{password}@{host}" if password is not None else f"{found[0]}@{host}"
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _QUERY_SECRETS for k, _ in pairs):
        kept = [(k, password) for k, _ in pairs if k.lower() in _QUERY_SECRETS] if password is not None else []
        query = urlencode([(k, v) for k, v in pairs if k.lower() not in _QUERY_SECRETS] + kept, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def passwords(url: str) -> list[str]:
    """The passwords ``url`` carries (authority and query), as written and percent-decoded."""
    out: list[str] = []
    found = _parts(url)
    if found is not None and found[1]:
        out += [found[1], unquote(found[1])]
    if "://" in url:
        try:
            query = urlsplit(url).query
        except ValueError:
            query = ""
        out += [v for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() in _QUERY_SECRETS]
        out += re.findall(r"(?:^|&)(?:password|passwd)=([^&]*)", query, flags=re.IGNORECASE)  # as written
    return sorted({p for p in out if p}, key=len, reverse=True)


def shown(url: str) -> str:
    """``url`` as a person may read it: any password replaced by ``***``."""
    return _replace(url, HIDDEN) if passwords(url) else url


def without_password(url: str) -> str:
    """``url`` as it may be kept: the password taken out (libpq then reads PGPASSWORD or ~/.pgpass)."""
    return _replace(url, None) if passwords(url) else url


def same_storage(a: str, b: str) -> bool:
    """Whether two URLs name the same storage, passwords aside."""
    return without_password(a) == without_password(b)


def remember(url: str) -> str:
    """Note ``url``'s passwords, so :func:`scrub` hides them wherever they turn up; returns ``url``."""
    _SECRETS.update(passwords(url))
    return url


def scrub(text: str) -> str:
    """``text`` with every remembered password replaced by ``***`` (longest first)."""
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text


def without_storage(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a process paci-tune starts: without :data:`STORAGE_ENV` (no child opens the storage)."""
    return {k: v for k, v in env.items() if k != STORAGE_ENV}
