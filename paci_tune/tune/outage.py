"""Riding out a short storage outage: a database server restarted, or its connection cut, under a search.

A restart (maintenance, a failover, ``pg_ctl restart``) cuts every session and refuses connections for a
few seconds. The connection pool checks a pooled connection before use (``pool_pre_ping``,
:func:`.study.open_storage`), so after the restart queries reconnect; during it a query fails. The search
retries its storage reads and writes that such a failure can hit (:func:`retrying`: its loop's look at the
studies, a trial's report and tell), for up to :data:`OUTAGE_S`, then fails with the storage's own error
as before. Only a lost or refused connection is retried (:func:`transient`): a wrong password or a missing
database fails at once. The trial's heartbeat retries on its own (:mod:`.liveness`). May import: the
standard library.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

OUTAGE_S = 30.0  # a storage operation is retried this long at most: a restart, not a server gone for good
BACKOFF_S = 0.5  # the first retry comes this soon, doubling up to MAX_WAIT_S
MAX_WAIT_S = 5.0

_log = logging.getLogger(__name__)

_CONNECTION_ERRORS = ("OperationalError", "InterfaceError", "StorageInternalError")
"""The classes (SQLAlchemy's, a driver's DB-API ones, Optuna's wrapper) a lost connection arrives as."""

_DISCONNECTS = ("DisconnectionError", "InvalidatePoolError")

_TRANSIENT_STATES = ("08", "57P01", "57P02", "57P03")
"""SQLSTATEs of a lost connection: class 08 (connection exception), admin or crash shutdown, cannot connect now."""

_TRANSIENT_TEXT = (
    "connection refused",
    "terminating connection",
    "server closed the connection",
    "connection is closed",
    "connection already closed",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "connection reset",
    "broken pipe",
    "consuming input failed",
    "ssl syscall error",
    "no connection to the server",
    "lost connection",  # MySQL 2013
    "server has gone away",  # MySQL 2006
    "can't connect to mysql server",  # MySQL 2003
)


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    nxt: BaseException | None = e
    while nxt is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        out.append(nxt)
        orig = getattr(nxt, "orig", None)  # SQLAlchemy's DBAPIError: the driver's own error
        nxt = orig if isinstance(orig, BaseException) and id(orig) not in seen else nxt.__cause__ or nxt.__context__
    return out


def transient(e: BaseException) -> bool:
    """A lost or refused connection to the database server (it restarts, or the network dropped it), which
    a retry a few seconds later can get past; not a wrong password, a missing database or bad data."""
    chain = _chain(e)
    if not any(type(x).__name__ in _CONNECTION_ERRORS for x in chain):
        return False
    for x in chain:
        # SQLAlchemy: the driver's error was a disconnect, or its pre-ping found the connection cut
        if getattr(x, "connection_invalidated", False) or type(x).__name__ in _DISCONNECTS:
            return True
        state = getattr(x, "sqlstate", None) or getattr(x, "pgcode", None)  # psycopg 3, psycopg2
        if isinstance(state, str) and state:
            return state.startswith(_TRANSIENT_STATES)
    text = " ".join(str(x).lower() for x in chain)
    return any(marker in text for marker in _TRANSIENT_TEXT)


def retrying(fn: Callable[[], T], what: str, limit_s: float = OUTAGE_S) -> T:
    """``fn()``, again after a transient storage error (:func:`transient`), backing off, for up to
    ``limit_s``; then, or on any other error, the error is raised. ``fn`` must be safe to repeat (a read,
    or writes that set what they set again)."""
    deadline, wait = time.monotonic() + limit_s, BACKOFF_S
    while True:
        try:
            return fn()
        except Exception as e:
            if not transient(e) or time.monotonic() + wait > deadline:
                raise
            _log.info("the study's storage failed during %s (%s); retrying", what, type(e).__name__)
            time.sleep(wait)
            wait = min(MAX_WAIT_S, 2 * wait)
