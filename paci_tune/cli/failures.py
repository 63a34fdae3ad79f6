"""The one place where a command's failure becomes its last line and its exit code.

Every command runs under :func:`guarded`, so a user never sees a traceback unless they ask for it
with ``paci-tune --debug`` (or ``PACI_TUNE_DEBUG=1``):

- bad input (:class:`~paci_tune.errors.ConfigError`): ``error: KEY: got VALUE; allowed: ...``, exit 2;
- Ctrl-C: ``interrupted``, exit 130 (what is in a storage stays: a search resumes);
- everything else -- the file system (unwritable, full, permissions), the study's storage
  (unreachable, locked, another schema version), running out of memory, and bugs: one line naming
  what failed, exit 1.

Why one handler: each command catching its own errors is how some paths ended in tracebacks. The
line and the traceback are scrubbed of every password a storage was opened with
(:func:`paci_tune.base.credentials.scrub`): a database driver's message may quote its URL. May
import: :mod:`paci_tune.errors`, :mod:`paci_tune.base`, click, and the standard library (the storage's error
types are recognised by their module, so nothing here loads optuna or SQLAlchemy).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from ..base.credentials import scrub
from ..errors import ConfigError, Failure

DEBUG_ENV = "PACI_TUNE_DEBUG"
INTERRUPTED = "interrupted (a search keeps its finished trials in its storage: the same command resumes it)"
_STORAGE_MODULES = ("sqlalchemy", "optuna.storages", "optuna.exceptions", "sqlite3", "psycopg", "pymysql")


def debug_requested(flag: bool) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _first_line(text: object, limit: int = 300) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_os_error(e: OSError) -> str:
    """``what: why`` of a file-system error, naming the file when the error carries it."""
    why = e.strerror or _first_line(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        why = "no space left on the device (the disk is full)"
    elif e.errno in (errno.EACCES, errno.EPERM):
        why = f"{why} (check the folder's permissions)"
    elif e.errno == errno.EROFS:
        why = "the file system is read-only"
    name = e.filename if e.filename is not None else None
    if name is not None and getattr(e, "filename2", None):
        return f"{name} -> {e.filename2}: {why}"
    return f"{name}: {why}" if name is not None else f"file system: {why}"


def _is_storage_error(e: BaseException) -> bool:
    return any(x.__module__.startswith(_STORAGE_MODULES) for x in type(e).__mro__ if x is not Exception)


def _root_storage_error(e: BaseException) -> BaseException:
    """The deepest storage error in ``e``'s chain: Optuna's ``StorageInternalError`` wraps the
    database driver's (connection refused, server closed the connection), which says what happened."""
    deepest, seen = e, {id(e)}
    nxt = e.__cause__ or e.__context__
    while nxt is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        if _is_storage_error(nxt):
            deepest = nxt
        nxt = nxt.__cause__ or nxt.__context__
    return deepest


def describe(e: BaseException) -> str:
    """The one line (after ``error: ``) for an exception that is not bad input."""
    if isinstance(e, Failure):
        return str(e)
    if isinstance(e, OSError):
        return describe_os_error(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's (a RuntimeError) too
        return "out of memory (a smaller model, micro-batch or evaluation chunk needs less)"
    if _is_storage_error(e):
        root = _root_storage_error(e)
        return f"the study's storage failed: {type(root).__name__}: {_first_line(root)}"
    if isinstance(e, RuntimeError) and "table schema" in str(e):  # Optuna's schema-version refusal
        return f"the study's storage has another schema version: {_first_line(e)}"
    return f"internal error: {type(e).__name__}: {_first_line(e)} (paci-tune --debug ... shows the traceback)"


def exit_code_of(e: BaseException) -> int:
    if isinstance(e, ConfigError):
        return 2
    if isinstance(e, KeyboardInterrupt):
        return 130
    return 1


def guarded(invoke: Callable[[], Any], *, debug: bool) -> Any:
    """Run ``invoke``; turn any failure into one ``error:`` line on stderr and its exit code."""
    try:
        return invoke()
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
        raise  # click's own: usage errors (exit 2), --help, --version
    except SystemExit:
        raise
    except KeyboardInterrupt as e:
        _fail(INTERRUPTED, e, debug)
    except ConfigError as e:
        _fail(str(e), e, debug)
    except Exception as e:
        _fail(describe(e), e, debug)


def _fail(line: str, e: BaseException, debug: bool) -> NoReturn:
    if debug:
        import traceback

        sys.stderr.write(scrub("".join(traceback.format_exception(type(e), e, e.__traceback__))))
    click.echo(f"error: {scrub(line)}", err=True)
    sys.exit(exit_code_of(e))
