"""Where studies live: resolving and opening storage URLs.

Default is a SQLite file in the current directory (zero set-up). ``--storage`` on the command
line wins over ``LOADER_SEARCH_STORAGE``, which wins over the default; a server URL without a
password takes it from the file ``LOADER_SEARCH_STORAGE_PASSWORD_FILE`` names. Passwords never
leave unmasked: every URL shown to a user goes through `mask_url`
(`loader_search.team._masking`). What a database error means, and retrying through an outage,
is `loader_search.team._db_errors`.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import URL, make_url

from loader_search import interrupts
from loader_search.errors import UserError
from loader_search.params import WorkersSettings
from loader_search.team._db_errors import first_line, is_busy, is_transient, outage, timed_out
from loader_search.team._masking import authority_is_ambiguous, mask_in, mask_url

if TYPE_CHECKING:
    import optuna

DEFAULT_STORAGE = "sqlite:///loader_search.db"
STORAGE_ENV = "LOADER_SEARCH_STORAGE"
PASSWORD_FILE_ENV = "LOADER_SEARCH_STORAGE_PASSWORD_FILE"
_MAX_PASSWORD_BYTES = 4096

# How long a database server may take to answer a new connection: the TCP connect, the
# greeting and the login. A server or proxy that accepts the connection and then says nothing
# (a MySQL URL at PostgreSQL's port) would otherwise hold every command for ever.
DB_TIMEOUT_ENV = "LOADER_SEARCH_DB_TIMEOUT"
DEFAULT_DB_TIMEOUT_S = 10.0
_DB_TIMEOUT_RANGE = (1.0, 3600.0)
# Once connected, how long one statement's answer may take on MySQL/MariaDB (pymysql's read
# and write timeouts): longer than any statement of this project's, whose one long wait, the
# study lock, waits in slices well below it (`loader_search.team._locks`). PostgreSQL's
# statements are bounded by the server (lock_timeout, idle_session_timeout) and a dead peer
# by TCP keepalives (`_KEEPALIVES`).
STATEMENT_TIMEOUT_S = 300.0
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}

_DRIVER_HINTS = {
    "psycopg": "pip install 'loader-search[postgres]'",
    "psycopg2": "pip install 'loader-search[postgres]' and use postgresql+psycopg://",
    "pymysql": "pip install 'loader-search[mysql]'",
    "MySQLdb": "pip install 'loader-search[mysql]' and use mysql+pymysql://",
}

# Each server backend's extra, and the URL scheme of the driver it installs.
_EXTRAS = {"postgresql": ("postgres", "postgresql+psycopg"), "mysql": ("mysql", "mysql+pymysql")}


def resolve_storage_url(cli_value: str | None) -> str:
    """The storage URL to use: the CLI's, else the environment's, else the SQLite default;
    a server URL without a password takes the one in ``$LOADER_SEARCH_STORAGE_PASSWORD_FILE``
    (see `with_password_file`)."""
    if cli_value is not None:
        if not cli_value.strip():
            raise UserError("--storage is empty: give a database URL, or leave it out")
        return with_password_file(cli_value)
    return with_password_file(os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE)


def with_password_file(url: str) -> str:
    """``url`` with the password read from the file ``$LOADER_SEARCH_STORAGE_PASSWORD_FILE``
    names, when it is set and ``url`` is a server's URL without a password of its own.

    For containers: a password in an environment variable shows in ``docker inspect``; one in
    a file (a Docker secret, mounted at ``/run/secrets/...``) does not. The file holds the
    password alone; a trailing newline is dropped."""
    path = os.environ.get(PASSWORD_FILE_ENV, "")
    if not path:
        return url
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url  # not a URL: opening it says so
    if parsed.password is not None or parsed.get_backend_name() == "sqlite":
        return url
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_PASSWORD_BYTES + 1)
        password = data.decode("utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise UserError(
            f"{PASSWORD_FILE_ENV}={path}: cannot read the database password ({reason}); fix the"
            " file's path or permissions, or unset the variable"
        ) from None
    if not password or len(data) > _MAX_PASSWORD_BYTES or "\n" in password:
        raise UserError(
            f"{PASSWORD_FILE_ENV}={path}: the file must hold the password alone, on one line"
            f" (at most {_MAX_PASSWORD_BYTES} bytes)"
        )
    return parsed.set(password=password).render_as_string(hide_password=False)


def db_timeout_s() -> float:
    """Seconds a database server may take to answer a new connection:
    ``$LOADER_SEARCH_DB_TIMEOUT``, else 10."""
    text = os.environ.get(DB_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_DB_TIMEOUT_S
    low, high = _DB_TIMEOUT_RANGE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise UserError(
            f"{DB_TIMEOUT_ENV}={text[:40]!r}: give the seconds to wait for a database server"
            f" to answer, from {low:g} to {high:g} (default {DEFAULT_DB_TIMEOUT_S:g})"
        )
    return value


def engine_options(url: URL) -> dict[str, Any]:
    """`sqlalchemy.create_engine` keyword arguments that bound every wait on ``url``'s
    server: the connect timeout (`db_timeout_s`) and, on MySQL/MariaDB, the statement
    timeout; SQLite's busy timeout. Timeouts that the URL sets itself are left as given."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        # Several local workers write to one file: wait for its lock instead of failing.
        return {"connect_args": {"timeout": 60}}
    timeout = db_timeout_s()
    given = set(url.query)
    if backend == "postgresql":
        # libpq's connect_timeout covers the whole start-up, login included (2 s at least).
        args: dict[str, Any] = {"connect_timeout": max(2, math.ceil(timeout)), **_KEEPALIVES}
        return {"connect_args": {key: value for key, value in args.items() if key not in given}}
    if backend in ("mysql", "mariadb") and url.get_driver_name() == "pymysql":
        return {"creator": _pymysql_creator(url, timeout)}
    if backend in ("mysql", "mariadb") and "connect_timeout" not in given:
        return {"connect_args": {"connect_timeout": max(1, math.ceil(timeout))}}
    return {}


def _pymysql_creator(url: URL, timeout_s: float) -> Callable[[], Any]:
    """A connection factory for pymysql whose handshake waits at most ``timeout_s``.

    pymysql reads the server's greeting and the login's answer under its *read* timeout, not
    its connect timeout: without one, a port that accepts and stays silent holds the
    connection for ever. Once connected, statements get `STATEMENT_TIMEOUT_S` instead (or the
    URL's own read_timeout / write_timeout)."""
    cargs, cparams = url.get_dialect()().create_connect_args(url)
    handshake = {
        "connect_timeout": timeout_s,
        "read_timeout": timeout_s,
        "write_timeout": timeout_s,
    }

    def connect() -> Any:
        import pymysql

        connection = pymysql.connect(*cargs, **{**handshake, **cparams})
        # pymysql applies these to its socket before each read and write, and has no public
        # setter for them (tests/test_storage.py checks that this still takes effect).
        connection._read_timeout = cparams.get("read_timeout", STATEMENT_TIMEOUT_S)
        connection._write_timeout = cparams.get("write_timeout", STATEMENT_TIMEOUT_S)
        return connection

    return connect


def create_engine(url: str, **kwargs: Any) -> sqlalchemy.Engine:
    """`sqlalchemy.create_engine` with `engine_options`' timeouts (for this project's own
    engines beside Optuna's: schema checks, admin connections in tests and benchmarks)."""
    return sqlalchemy.create_engine(url, **{**engine_options(make_url(url)), **kwargs})


def in_memory(url: URL) -> bool:
    """Whether ``url`` is an in-memory SQLite database (gone when its process ends):
    ``sqlite://``, ``sqlite:///:memory:``, or a URI filename (``?uri=true``) that asks for
    ``mode=memory`` or names ``file::memory:``."""
    if url.get_backend_name() != "sqlite":
        return False
    database = url.database or ""
    if database in ("", ":memory:"):
        return True
    uri = str(url.query.get("uri", "")).lower() in ("true", "1")
    return uri and (database.startswith("file::memory:") or url.query.get("mode") == "memory")


def check_shared(url: str, command: str) -> None:
    """Refuse an in-memory SQLite URL for ``command`` (``run``, ``init``, ``worker``), whose
    study must outlive the process: it would vanish when the command ends. (Each connection
    to one sees a database of its own, too: the heartbeat thread would find no tables.)"""
    try:
        parsed = make_url(url)
    except Exception:
        return  # open_storage says what is wrong with it
    if in_memory(parsed):
        raise UserError(
            f"{command} --storage {mask_url(url)} is an in-memory database: the study would"
            " vanish when the command ends; give a file (sqlite:///loader_search.db) or a server"
        )


def open_storage(
    url: str,
    *,
    must_exist: bool = False,
    workers: WorkersSettings | None = None,
    on_stale: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
    on_busy: Callable[[str], None] | None = None,
) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage for ``url``, creating the schema if the database is empty.

    With ``must_exist`` the database must already hold the schema (for commands that only
    read, and for workers joining a study): nothing is created. ``workers`` turns on
    Optuna's heartbeats with those settings; ``on_stale`` is called with each trial failed as
    stale (default: Optuna's retry, ``workers.max_retry`` times). Every failure a user can fix
    (malformed URL, missing driver, unreachable server, wrong credentials, a file that is
    not a database, a schema of another Optuna version) becomes a one-line `UserError` that
    shows the URL masked. A server that refuses for now (too many connections, starting up:
    `is_busy`) is tried again with back-off for up to `BUSY_WAIT_S`, each wait told to
    ``on_busy``.
    """
    import optuna

    shown = mask_url(url)
    if authority_is_ambiguous(url):
        raise UserError(
            f"storage URL {shown} has more than one '@' before the host, or one after a '/':"
            " percent-encode '@' as %40 and '/' as %2F in the user name or password"
        )
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise UserError(
            f"storage URL {shown} is malformed: use e.g. sqlite:///loader_search.db or"
            " postgresql+psycopg://user@host/db"
        ) from None
    backend = parsed.get_backend_name()
    if workers is not None and in_memory(parsed):
        # Trials need the study after this process too, and their heartbeats (written from
        # a thread of their own, on a connection of their own) need to see it at all.
        raise UserError(
            f"storage {shown} is an in-memory database: trials cannot run in it (the study"
            " would vanish when the process ends); give a file (sqlite:///loader_search.db)"
            " or a server"
        )
    if must_exist and backend == "sqlite" and parsed.database and not in_memory(parsed):
        _check_study_file(Path(parsed.database), shown)
    engine_kwargs = engine_options(parsed)
    if backend != "sqlite":
        # A worker holds its connections for hours while trials train, and the server may
        # restart meanwhile: test each connection before use, and recycle old ones. Two
        # connections at most, so that a server's 100 serve a team of 50: one holds the study
        # lock while the other works under it; the heartbeat and the sweeper threads borrow
        # one between the main thread's statements.
        engine_kwargs.update(
            pool_pre_ping=True, pool_recycle=1800, pool_size=2, max_overflow=0, pool_timeout=60
        )
    heartbeat_kwargs: dict[str, Any] = {}
    if workers is not None:
        heartbeat_kwargs = {
            "heartbeat_interval": workers.heartbeat_interval_s,
            "grace_period": workers.grace_period_s,
            "heartbeat_stale_trial_callback": on_stale
            or optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=workers.max_retry),
        }
    give_up = time.monotonic() + BUSY_WAIT_S
    pause = 0.5
    while True:
        try:
            return _open(url, shown, parsed, must_exist, engine_kwargs, heartbeat_kwargs)
        except UserError:
            raise
        except Exception as exc:
            if not is_busy(exc) or time.monotonic() + pause > give_up:
                raise _open_error(exc, url, shown) from None
            if on_busy is not None:
                said = outage(exc, url)
                on_busy(f"storage {shown} is busy ({said}); trying again in {pause:.1f} s")
            interrupts.sleep(pause)
            pause = min(pause * 2, 5.0)


def _open(
    url: str,
    shown: str,
    parsed: URL,
    must_exist: bool,
    engine_kwargs: dict[str, Any],
    heartbeat_kwargs: dict[str, Any],
) -> optuna.storages.RDBStorage:
    """`open_storage` once: its errors as a user can fix them, but a busy server's as they
    are (the caller tries again)."""
    import optuna

    try:
        if must_exist and parsed.get_backend_name() != "sqlite":
            # Before Optuna opens it: on a database without its tables, RDBStorage fails
            # with a misleading "invalid data in the commit".
            _check_schema(url, shown)
        for attempt in range(_SCHEMA_RACE_TRIES):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return optuna.storages.RDBStorage(
                        url,
                        engine_kwargs=engine_kwargs,
                        skip_table_creation=must_exist,
                        **heartbeat_kwargs,
                    )
            except Exception as exc:
                # Two processes creating the schema of an empty database at once: one of
                # them loses the race (a duplicate table, index or version row). The
                # schema is there now; opening it again succeeds.
                if must_exist or not _lost_schema_race(exc) or attempt == _SCHEMA_RACE_TRIES - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")
    except sqlalchemy.exc.NoSuchModuleError:
        raise UserError(
            f"storage URL {shown}: unknown database dialect {parsed.drivername!r}; use"
            " sqlite, postgresql+psycopg or mysql+pymysql"
        ) from None
    except ImportError as exc:
        # Optuna wraps SQLAlchemy's ModuleNotFoundError in its own ImportError ("Failed to
        # import DB access module"): the missing module is the cause's.
        raise _driver_error_message(exc, parsed, shown) from None
    except UserError:
        raise
    except Exception as exc:
        if is_busy(exc):
            raise
        raise _open_error(exc, url, shown) from None


def _driver_error_message(exc: ImportError, parsed: URL, shown: str) -> UserError:
    """The one-line message for a database driver that cannot be imported: which extra
    installs it."""
    extra, scheme = _EXTRAS.get(parsed.get_backend_name(), (None, None))
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        name = cause.name.split(".")[0]
        hint = _DRIVER_HINTS.get(name) or (
            f"install it, or pip install 'loader-search[{extra}]' and use {scheme}://"
            if extra
            else "install it"
        )
        return UserError(f"storage URL {shown}: driver {name!r} is missing: {hint}")
    # Installed but broken (psycopg without its libpq wrapper, say).
    origin = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
    fix = f"pip install 'loader-search[{extra}]'" if extra else "reinstall the database driver"
    return UserError(
        f"storage URL {shown}: the database driver cannot be loaded"
        f" ({type(origin).__name__}: {first_line(origin)}); {fix}"
    )


def _open_error(exc: Exception, url: str, shown: str) -> UserError:
    """The one-line message for a storage that cannot be opened."""
    if is_busy(exc):
        return UserError(
            f"storage {shown} refused the connection for {BUSY_WAIT_S:.0f} s: {outage(exc, url)};"
            " raise the server's connection limit (PostgreSQL max_connections, MySQL"
            " max_connections) or run fewer workers, or wait for it to finish starting"
        )
    if is_transient(exc):
        if timed_out(exc):
            return UserError(
                f"storage {shown}: {_address(url)} did not answer within {db_timeout_s():g} s"
                " (another kind of server on that port, or a firewall that drops the"
                f" connection?); check the URL's host and port, or set {DB_TIMEOUT_ENV} to"
                " wait longer"
            )
        # Optuna wraps errors raised at commit: the driver's own message is the cause's.
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        return UserError(
            f"cannot reach storage {shown}: {mask_in(first_line(cause), url)}; check the"
            " host, the credentials and that the database exists"
        )
    if isinstance(exc, RuntimeError) and "no longer compatible" in str(exc):
        return UserError(
            f"storage {shown} holds an Optuna schema this version cannot use; upgrade it with"
            " `optuna storage upgrade --storage URL` (back the database up first)"
        )
    # A bad URL option, a file that is not a database...
    return UserError(
        f"cannot open storage {shown}: {type(exc).__name__}: {mask_in(first_line(exc), url)}"
    )


_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def _address(url: str) -> str:
    """``host:port`` of a server URL, with the backend's default port when it gives none."""
    try:
        parsed = make_url(url)
    except Exception:
        return "the server"
    port = parsed.port or _DEFAULT_PORTS.get(parsed.get_backend_name())
    return f"{parsed.host or 'localhost'}:{port}" if port else (parsed.host or "localhost")


def _check_schema(url: str, shown: str) -> None:
    """A server database must already hold Optuna's tables for a read or a join."""
    engine = create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if not {"studies", "trials", "version_info"} <= tables:
        raise UserError(
            f"storage {shown} has no loader-search (Optuna) tables, so no studies: this"
            " database is empty; create a study there with `loader-search init CONFIG"
            " --storage URL` (or `run`) first"
        )


# A server that refuses new connections for now (`is_busy`): how long `open_storage` keeps
# trying it.
BUSY_WAIT_S = 60.0

_SCHEMA_RACE_TRIES = 5


def _lost_schema_race(exc: BaseException) -> bool:
    """Whether opening failed because another process created the same schema meanwhile."""
    from optuna.exceptions import StorageInternalError

    cause: BaseException | None = exc
    if isinstance(cause, StorageInternalError):
        cause = cause.__cause__
    if isinstance(cause, sqlalchemy.exc.IntegrityError):
        return True
    text = str(cause).lower()
    return isinstance(cause, sqlalchemy.exc.DBAPIError) and (
        "already exists" in text or "duplicate" in text
    )


def _check_study_file(path: Path, shown: str) -> None:
    """For commands that only read: the SQLite file must exist and hold Optuna's tables, so
    a mistyped path neither creates a file nor adds tables to someone else's database."""
    if not path.is_file():
        raise UserError(
            f"no database file {str(path)!r} (storage {shown}); run `loader-search run`"
            " first, or point --storage at an existing database"
        )
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
            names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise UserError(f"cannot open storage {shown}: {exc}") from None
    if not {"studies", "trials", "version_info"} <= names:
        raise UserError(f"{str(path)!r} is not a loader-search (Optuna) database: check --storage")
