"""What a database error means: a server busy for now, a read-only database, a timeout, a
passing outage (retried: `retrying`), and the driver's own message under its wrappers, in one
line and with the password masked."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy
import sqlalchemy.exc

from loader_search import interrupts
from loader_search.errors import UserError
from loader_search.team._masking import mask_in

# What the drivers say when a timeout ran out: pymysql ("... (timed out)"), psycopg
# ("connection timeout expired"), the socket module ("timed out").
_TIMED_OUT_WORDS = ("timed out", "timeout expired")


def timed_out(exc: BaseException) -> bool:
    """Whether the database driver gave up waiting for the server (a timeout ran out)."""
    text = str(_driver_error(exc)).lower()
    return any(words in text for words in _TIMED_OUT_WORDS)


T = TypeVar("T")

_LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout

# Errors that mean "the database is unreachable for now", not "the request is wrong".
_TRANSIENT = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.DisconnectionError,
    # No pooled connection came free in time: another thread of this worker kept both while
    # the server did not answer.
    sqlalchemy.exc.TimeoutError,
)


# A server that refuses new connections for now: too many of them, or still starting up.
_BUSY_SQLSTATES = frozenset({"53300", "57P03"})  # too_many_connections, cannot_connect_now
_BUSY_MYSQL_ERRORS = frozenset({1040, 1203, 1226})  # too many connections, per-user limits


# What PostgreSQL says then, for errors at connect time, which psycopg raises without a
# SQLSTATE.
_BUSY_WORDS = (
    "too many connections",
    "too many clients",
    "the database system is starting up",
    "the database system is not yet accepting connections",
)


def is_busy(exc: BaseException) -> bool:
    """Whether the server refused for now: too many connections, or it is starting up."""
    cause = _driver_error(exc)
    if getattr(cause, "sqlstate", None) in _BUSY_SQLSTATES:
        return True
    if isinstance(exc, sqlalchemy.exc.OperationalError) or isinstance(
        exc.__cause__, sqlalchemy.exc.OperationalError
    ):
        text = str(cause).lower()
        if any(words in text for words in _BUSY_WORDS):
            return True
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] in _BUSY_MYSQL_ERRORS


def outage(exc: BaseException, url: str) -> str:
    """What the database at ``url`` said, in one line and with its password masked: the
    driver's error, not a wrapper's (Optuna reports any error at commit as "invalid data in
    the commit, e.g. exceeding max length")."""
    return mask_in(describe_driver_error(exc), url)


def describe_driver_error(exc: BaseException) -> str:
    """`outage` where the URL is unknown (mask URLs in it with `scrub_urls`)."""
    cause = _driver_error(exc)
    return f"{type(cause).__name__}: {first_line(cause)}"


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's own exception under Optuna's and SQLAlchemy's wrappers."""
    from optuna.exceptions import StorageInternalError

    if isinstance(exc, StorageInternalError) and exc.__cause__ is not None:
        exc = exc.__cause__
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


# A database that refuses writes: SQLite's read-only file (or folder), PostgreSQL's read-only
# transaction (a standby, default_transaction_read_only), MySQL/MariaDB's --read-only.
_READ_ONLY_WORDS = ("readonly database", "read-only transaction", "--read-only option")
_READ_ONLY_SQLSTATES = frozenset({"25006"})  # read_only_sql_transaction
_READ_ONLY_MYSQL_ERRORS = frozenset({1290, 1836})


def is_read_only(exc: BaseException) -> bool:
    """Whether the database refused a write because it is read-only (for us): no outage,
    nothing that waiting mends."""
    cause = _driver_error(exc)
    if getattr(cause, "sqlstate", None) in _READ_ONLY_SQLSTATES:
        return True
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if args and args[0] in _READ_ONLY_MYSQL_ERRORS:
        return True
    text = str(cause).lower()
    return any(words in text for words in _READ_ONLY_WORDS)


def read_only_error(exc: BaseException) -> UserError:
    """The one-line message for a write the database refused (`is_read_only`)."""
    return UserError(
        f"the database refuses writes ({describe_driver_error(exc)}): the file or its folder is"
        " not writable by you, or the server is read-only; give --storage a database you can"
        " write (reading commands, `studies`, `best`, `report`, work as they are)"
    )


def is_transient(exc: BaseException) -> bool:
    """A dropped connection or a restarting server; Optuna wraps those raised at commit in
    StorageInternalError. A read-only database is not one (`is_read_only`)."""
    from optuna.exceptions import StorageInternalError

    if isinstance(exc, StorageInternalError):
        exc = exc.__cause__  # type: ignore[assignment]
    if not isinstance(exc, _TRANSIENT) or is_read_only(exc):
        return False
    # A lock wait that timed out (PostgreSQL's lock_timeout) is no outage: retrying would
    # only wait again.
    return getattr(getattr(exc, "orig", None), "sqlstate", None) != _LOCK_NOT_AVAILABLE


def retrying(
    action: Callable[[], T],
    *,
    deadline_s: float = 300.0,
    on_retry: Callable[[BaseException, float], None] | None = None,
    max_pause_s: float = 10.0,
) -> T:
    """Run ``action``, retrying while the database is unreachable (up to ``deadline_s``).

    A trial that finished while the database restarted must keep its result: its writes are
    retried with backoff (0.5 s doubling to ``max_pause_s``) instead of being lost.
    ``on_retry`` receives the error and the seconds until the next try.
    """
    start = time.monotonic()
    pause = min(0.5, max_pause_s)
    while True:
        try:
            return action()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() - start + pause > deadline_s:
                raise
            if on_retry is not None:
                on_retry(exc, pause)
            interrupts.sleep(pause)  # Ctrl-C ends the wait
            pause = min(pause * 2, max_pause_s)


def first_line(exc: BaseException) -> str:
    origin = getattr(exc, "orig", None) or exc
    lines = str(origin).strip().splitlines()
    return lines[0] if lines else type(origin).__name__
