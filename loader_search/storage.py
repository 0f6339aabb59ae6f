"""Where studies live: resolving, masking and opening storage URLs.

Default is a SQLite file in the current directory (zero set-up). ``--storage`` on the command
line wins over ``LOADER_SEARCH_STORAGE``, which wins over the default. Passwords never leave
this module unmasked: every URL shown to a user goes through `mask_url`.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy.exc
from sqlalchemy.engine import URL, make_url

from loader_search.errors import UserError

if TYPE_CHECKING:
    import optuna

DEFAULT_STORAGE = "sqlite:///loader_search.db"
STORAGE_ENV = "LOADER_SEARCH_STORAGE"

# Query parameters that may carry secrets: password, passwd, pwd, sslpassword, api_token...
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)
# Shorter secrets would be replaced inside ordinary words, which reveals them: such messages
# are dropped instead of masked.
_MIN_MASKABLE = 4

_DRIVER_HINTS = {
    "psycopg": "pip install 'loader-search[postgres]'",
    "psycopg2": "pip install 'loader-search[postgres]' and use postgresql+psycopg://",
    "pymysql": "pip install 'loader-search[mysql]'",
    "MySQLdb": "pip install 'loader-search[mysql]' and use mysql+pymysql://",
}


def resolve_storage_url(cli_value: str | None) -> str:
    """The storage URL to use: the CLI's, else the environment's, else the SQLite default."""
    if cli_value is not None:
        if not cli_value.strip():
            raise UserError("--storage is empty: give a database URL, or leave it out")
        return cli_value
    return os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def _authority_is_ambiguous(url: str) -> bool:
    """``user:p@ss@host``: an unencoded ``@`` in the password, which parsers split wrongly."""
    _, sep, rest = url.partition("://")
    return bool(sep) and rest.split("/", 1)[0].count("@") > 1


def _secrets(url: URL) -> list[str]:
    values = [url.password] if url.password else []
    for key, value in url.query.items():
        if _SECRET_KEY.search(key):
            values.extend([value] if isinstance(value, str) else list(value))
    return [str(v) for v in values if v]


def mask_url(url: str) -> str:
    """The URL with any password (``user:pw@``, ``?password=``, ``?sslpassword=``...)
    replaced by ``***``; unparsable or ambiguous input is hidden whole."""
    if _authority_is_ambiguous(url):
        return "<storage URL with an unencoded @>"
    try:
        parsed = make_url(url)
        hidden = {k: "***" for k in parsed.query if _SECRET_KEY.search(k)}
        shown = parsed.update_query_dict(hidden).render_as_string(hide_password=True)
        return shown.replace("%2A%2A%2A", "***")
    except Exception:
        return "<unparsable storage URL>"


def _mask_in(text: str, url: str) -> str:
    """Remove any password from a driver's message, should it quote one."""
    try:
        secrets = _secrets(make_url(url))
    except Exception:
        return "(details hidden: they may contain the password)"
    for secret in secrets:
        if len(secret) < _MIN_MASKABLE:
            return "(details hidden: they may contain the password)"
        text = text.replace(secret, "***")
    return text


def open_storage(url: str, *, must_exist: bool = False) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage for ``url``, creating the schema if the database is empty.

    With ``must_exist`` a SQLite file that does not exist is an error instead of being
    created (for commands that only read). Every failure a user can fix (malformed URL,
    missing driver, unreachable server, a file that is not a database) becomes a one-line
    `UserError` that shows the URL masked.
    """
    import optuna

    shown = mask_url(url)
    if _authority_is_ambiguous(url):
        raise UserError(
            f"storage URL {shown} has more than one '@' before the host: percent-encode '@' in"
            " the user name or password as %40"
        )
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise UserError(
            f"storage URL {shown} is malformed: use e.g. sqlite:///loader_search.db or"
            " postgresql+psycopg://user@host/db"
        ) from None
    backend = parsed.get_backend_name()
    if must_exist and backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
        _check_study_file(Path(parsed.database), shown)
    engine_kwargs = {}
    if backend != "sqlite":
        # Long-lived workers hold connections for hours; test them before use.
        engine_kwargs["pool_pre_ping"] = True
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except sqlalchemy.exc.NoSuchModuleError:
        raise UserError(
            f"storage URL {shown}: unknown database dialect {parsed.drivername!r}; use"
            " sqlite, postgresql+psycopg or mysql+pymysql"
        ) from None
    except ModuleNotFoundError as exc:
        hint = _DRIVER_HINTS.get(exc.name or "", "install the database driver")
        raise UserError(f"storage URL {shown}: driver {exc.name!r} is missing: {hint}") from None
    except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError) as exc:
        raise UserError(
            f"cannot reach storage {shown}: {_mask_in(_first_line(exc), url)}; check the host,"
            " the credentials and that the database exists"
        ) from None
    except Exception as exc:  # a bad URL option, a file that is not a database, a schema...
        raise UserError(
            f"cannot open storage {shown}: {type(exc).__name__}: {_mask_in(_first_line(exc), url)}"
        ) from None


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


def _first_line(exc: BaseException) -> str:
    origin = getattr(exc, "orig", None) or exc
    lines = str(origin).strip().splitlines()
    return lines[0] if lines else type(origin).__name__
