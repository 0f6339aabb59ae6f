"""Where studies live: resolving, masking and opening storage URLs.

Default is a SQLite file in the current directory (zero set-up). ``--storage`` on the command
line wins over ``LOADER_SEARCH_STORAGE``, which wins over the default. Passwords never leave
this module unmasked: every URL shown to a user goes through `mask_url`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import sqlalchemy.exc
from sqlalchemy.engine import make_url

from loader_search.errors import UserError

if TYPE_CHECKING:
    import optuna

DEFAULT_STORAGE = "sqlite:///loader_search.db"
STORAGE_ENV = "LOADER_SEARCH_STORAGE"

_DRIVER_HINTS = {
    "psycopg": "pip install 'psycopg[binary]'",
    "psycopg2": "pip install 'psycopg[binary]' and use postgresql+psycopg://",
    "pymysql": "pip install pymysql",
    "MySQLdb": "pip install pymysql and use mysql+pymysql://",
}


def resolve_storage_url(cli_value: str | None) -> str:
    """The storage URL to use: the CLI's, else the environment's, else the SQLite default."""
    if cli_value:
        return cli_value
    return os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``; unparsable input is hidden whole."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable storage URL>"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage for ``url``, creating the schema if the database is empty.

    Every failure a user can fix (malformed URL, missing driver, unreachable server, an
    unopenable SQLite file) becomes a one-line `UserError` that shows the URL masked.
    """
    import optuna

    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except sqlalchemy.exc.ArgumentError:
        raise UserError(
            f"storage URL {shown} is malformed: use e.g. sqlite:///loader_search.db or"
            " postgresql+psycopg://user@host/db"
        ) from None
    engine_kwargs = {}
    if parsed.get_backend_name() != "sqlite":
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
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        raise UserError(
            f"cannot reach storage {shown}: {_mask_in(reason, url)}; check the host, the"
            " credentials and that the database exists"
        ) from None
    except sqlalchemy.exc.ArgumentError as exc:
        raise UserError(f"storage URL {shown} is malformed: {exc}") from None
    except RuntimeError as exc:  # Optuna's schema version check
        raise UserError(f"storage {shown}: {_mask_in(str(exc), url)}") from None


def _mask_in(text: str, url: str) -> str:
    """Remove the password from a driver's message, should it quote one."""
    try:
        password = make_url(url).password
    except Exception:
        return text
    return text.replace(str(password), "***") if password else text
