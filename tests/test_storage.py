from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from sqlalchemy.engine import make_url

from loader_search.errors import UserError
from loader_search.team import (
    DEFAULT_STORAGE,
    STORAGE_ENV,
    has_password,
    is_busy,
    mask_url,
    open_storage,
    outage,
    resolve_storage_url,
)
from loader_search.team import _storage as storage_module
from tests.conftest import (
    MARIADB_URL,
    POSTGRES_URL,
    ROOT,
    invoke,
    require_database,
    run_cli,
    scratch_database,
)


def test_url_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    assert resolve_storage_url(None) == DEFAULT_STORAGE
    monkeypatch.setenv(STORAGE_ENV, "sqlite:///env.db")
    assert resolve_storage_url(None) == "sqlite:///env.db"
    assert resolve_storage_url("sqlite:///cli.db") == "sqlite:///cli.db"


def test_passwords_are_masked() -> None:
    masked = mask_url("postgresql+psycopg://alice:s3cret@db.example:5432/studies")
    assert masked == "postgresql+psycopg://alice:***@db.example:5432/studies"
    in_query = mask_url("postgresql+psycopg://alice@db/studies?password=s3cret&sslmode=require")
    assert in_query == "postgresql+psycopg://alice@db/studies?password=***&sslmode=require"
    assert "s3cret" not in mask_url("mysql+pymysql://bob@db/x?passwd=s3cret")
    assert "s3cret" not in mask_url("postgresql+psycopg://u@h/db?sslpassword=s3cret")
    assert mask_url("postgresql+psycopg://u:p@ss@h/db") == "<storage URL with an unencoded @>"
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"
    assert mask_url("postgresql://u:s3cret@h:notaport/db") == "<unparsable storage URL>"


def test_a_url_without_a_password_is_shown_as_written(tmp_path: Path) -> None:
    # SQLAlchemy's rendering percent-encodes the database part: `%3Amemory%3A`.
    for url in (
        "sqlite:///:memory:",
        "sqlite://",
        "sqlite:////tmp/my studies/été.db",
        "sqlite:///file:x.db?mode=ro&uri=true",
        "postgresql+psycopg://alice@db:5432/my:db?sslmode=require",
    ):
        assert mask_url(url) == url
    both = mask_url("postgresql+psycopg://alice:s3cret@db/my:db?sslpassword=s3cret")
    assert both == "postgresql+psycopg://alice:***@db/my:db?sslpassword=***"
    odd = mask_url("postgresql://u:s3cret@h/a%3Fb%25c?password=s3cret")  # `?`, `%` stay encoded
    assert odd == "postgresql://u:***@h/a%3Fb%25c?password=***"
    assert make_url(odd).database == "a?b%c"
    quickstart = str(ROOT / "studies/quickstart.toml")
    refused = invoke("init", quickstart, "--storage", "sqlite:///:memory:", cwd=tmp_path)
    assert refused.returncode == 2
    assert "init --storage sqlite:///:memory: is an in-memory database" in refused.stderr


def test_a_password_in_storage_is_a_warning_that_never_shows_it(tmp_path: Path) -> None:
    secret = "s3cret-in-argv"
    assert has_password(f"postgresql://u:{secret}@h/db")
    assert has_password(f"postgresql://u@h/db?password={secret}")
    assert has_password(f"postgresql://u:{secret}@h:notaport/db")  # unparsable, still a password
    assert not has_password("postgresql://u@h/db") and not has_password("sqlite:///:memory:")
    with scratch_database(POSTGRES_URL) as url:
        optuna.create_study(study_name="listed", storage=url)
        parsed = make_url(url)  # the server trusts this machine: any password is accepted
        with_password = parsed.set(password=secret).render_as_string(hide_password=False)
        in_query = parsed.update_query_dict({"password": secret}).render_as_string(False)
        for given in (with_password, in_query):
            result = invoke("studies", "--storage", given, cwd=tmp_path)
            assert result.returncode == 0, result.stderr  # a warning: the command goes on
            assert "listed" in result.stdout
            warned = [line for line in result.stderr.splitlines() if "warning:" in line]
            assert len(warned) == 1, result.stderr
            assert "process list" in warned[0] and f"${STORAGE_ENV}" in warned[0]
            assert secret not in result.stdout + result.stderr
        plain = invoke("studies", "--storage", url, cwd=tmp_path)
        assert plain.returncode == 0 and "listed" in plain.stdout, plain.stderr
        assert "warning" not in plain.stderr
        from_env = invoke("studies", cwd=tmp_path, env={STORAGE_ENV: with_password})
        assert from_env.returncode == 0 and "warning" not in from_env.stderr, from_env.stderr


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just text that is long enough to have a header\n" * 20)
    with pytest.raises(UserError, match=r"cannot open storage .*file is not a database"):
        open_storage(f"sqlite:///{path}")


def test_reading_commands_do_not_create_files_or_tables(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no database file"):
        open_storage(f"sqlite:///{tmp_path / 'missing.db'}", must_exist=True)
    assert not (tmp_path / "missing.db").exists()
    other = tmp_path / "app.db"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(UserError, match="is not a loader-search"):
        open_storage(f"sqlite:///{other}", must_exist=True)
    with sqlite3.connect(other) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master")]
    assert tables == ["users"]


def test_sqlite_file_is_created(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 'a.db'}")
    assert optuna.study.get_all_study_names(storage) == []
    assert (tmp_path / "a.db").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "is malformed"),
        ("nosuchdb://host/db", "unknown database dialect 'nosuchdb'"),
        ("sqlite:////nonexistent-dir/x/studies.db", "cannot reach storage"),
        ("postgresql+psycopg://bob:hunter2@127.0.0.1:1/test", "cannot reach storage"),
        ("postgresql+psycopg://bob@127.0.0.1:1/test?password=hunter2", "cannot reach storage"),
        ("mysql+pymysql://bob:hunter2@127.0.0.1:1/test", "cannot reach storage"),
        ("postgresql+psycopg://bob:hunter2@127.0.0.1:notaport/test", "is malformed"),
        ("postgresql+psycopg://bob:hun@ter2@127.0.0.1:1/test", "percent-encode '@'"),
        ("postgresql+psycopg://bob@127.0.0.1:1/test?password=a", "details hidden"),
        ("postgresql+psycopg://bob@127.0.0.1:1/test?sslpassword=hunter2", "cannot reach"),
    ],
)
def test_bad_storage_is_one_masked_line(url: str, message: str) -> None:
    with pytest.raises(UserError) as info:
        open_storage(url)
    text = str(info.value)
    assert message in text
    assert "hunter2" not in text
    assert "\n" not in text


@pytest.mark.parametrize("url", [POSTGRES_URL, MARIADB_URL])
def test_real_postgres_and_mariadb_are_usable(url: str) -> None:
    require_database(url)
    storage = open_storage(url)
    assert isinstance(optuna.study.get_all_study_names(storage), list)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.slow
def test_runs_creating_one_new_study_at_once_all_continue_it(backend: str, tmp_path: Path) -> None:
    """Two or more processes that create the same study in an empty database at once (and so
    its schema): none fails, and there is one study. Real processes, several rounds."""
    import subprocess
    import sys
    from contextlib import ExitStack

    from tests.conftest import ROOT, TINY_CONFIG, scratch_database

    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    for round_ in range(3):
        with ExitStack() as stack:
            if backend == "sqlite":
                url = f"sqlite:///{tmp_path / f'race{round_}.db'}"
            else:
                url = stack.enter_context(scratch_database(POSTGRES_URL))
            processes = [
                subprocess.Popen(
                    [sys.executable, "-m", "loader_search", "init", str(config), "--storage", url],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(3)
            ]
            for process in processes:
                _, stderr = process.communicate(timeout=120)
                assert process.returncode == 0, stderr
            assert optuna.study.get_all_study_names(url) == ["tiny"]


@pytest.fixture
def crowded_postgres() -> Iterator[tuple[str, list[sqlalchemy.Connection]]]:
    """A database whose role may hold 2 connections, both taken: the server refuses a third
    ("too many connections for role"), as PostgreSQL refuses everyone past max_connections."""
    require_database(POSTGRES_URL)
    role = f"ls_busy_{os.getpid()}"
    with scratch_database(POSTGRES_URL) as url:
        admin = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        database = make_url(url).database
        with admin.connect() as connection:
            connection.execute(sqlalchemy.text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 2"))
            connection.execute(sqlalchemy.text(f"ALTER DATABASE {database} OWNER TO {role}"))
        limited = make_url(url).set(username=role).render_as_string(hide_password=False)
        engine = sqlalchemy.create_engine(limited, poolclass=sqlalchemy.pool.NullPool)
        held = [engine.connect(), engine.connect()]
        try:
            yield limited, held
        finally:
            for connection in held:
                connection.close()
            engine.dispose()
            with admin.connect() as connection:
                connection.execute(sqlalchemy.text(f"ALTER DATABASE {database} OWNER TO postgres"))
            with admin.connect() as connection:
                connection.execute(sqlalchemy.text(f"DROP OWNED BY {role}"))
                connection.execute(sqlalchemy.text(f"DROP ROLE {role}"))
            admin.dispose()


def test_a_server_with_too_many_connections_is_tried_again_until_it_has_room(
    crowded_postgres: tuple[str, list[sqlalchemy.Connection]],
) -> None:
    url, held = crowded_postgres
    told: list[str] = []
    threading.Timer(2.0, lambda: [c.close() for c in held]).start()
    storage = open_storage(url, on_busy=told.append)  # a worker starting beside 100 others
    assert isinstance(storage, optuna.storages.RDBStorage)
    assert told, "it waited for room and said so"
    assert "is busy (OperationalError: " in told[0] and "too many connections" in told[0]
    assert "trying again in 0.5 s" in told[0]


def test_a_server_that_stays_full_is_one_line_naming_the_limit(
    crowded_postgres: tuple[str, list[sqlalchemy.Connection]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = crowded_postgres
    monkeypatch.setattr(storage_module, "BUSY_WAIT_S", 1.0)
    with pytest.raises(UserError) as refused:
        open_storage(url)
    message = str(refused.value)
    assert "\n" not in message
    assert "refused the connection for 1 s" in message and "too many connections" in message
    assert "max_connections" in message


def test_busy_and_outage_read_the_drivers_error_under_the_wrappers() -> None:
    import pymysql

    full = sqlalchemy.exc.OperationalError(
        "SELECT 1", {}, pymysql.err.OperationalError(1040, "Too many connections")
    )
    wrapped = optuna.exceptions.StorageInternalError("invalid data in the commit")
    wrapped.__cause__ = full
    assert is_busy(full) and is_busy(wrapped)
    assert outage(wrapped, "mysql+pymysql://u:s3cret-pass@h/db") == (
        "OperationalError: (1040, 'Too many connections')"
    )
    refused = sqlalchemy.exc.OperationalError(
        "SELECT 1", {}, pymysql.err.OperationalError(1045, "Access denied")
    )
    assert not is_busy(refused)


# -- servers that do not answer ---------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on this machine that accepts connections and never says a word: a proxy in
    front of a dead server, or another protocol's server (PostgreSQL waits for its client
    to speak first, so a MySQL client at its port waits for a greeting)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for connection in accepted:
        connection.close()
    listener.close()


@pytest.mark.parametrize("scheme", ["mysql+pymysql", "postgresql+psycopg"])
def test_a_server_that_never_answers_is_one_line_within_the_timeout(
    silent_port: int, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(storage_module.DB_TIMEOUT_ENV, "2")
    url = f"{scheme}://someone:s3cretpw@127.0.0.1:{silent_port}/test"
    started = time.monotonic()
    for must_exist in (True, False):
        with pytest.raises(UserError) as caught:
            open_storage(url, must_exist=must_exist)
        message = str(caught.value)
        assert f"127.0.0.1:{silent_port} did not answer within 2 s" in message, message
        assert storage_module.DB_TIMEOUT_ENV in message and "s3cretpw" not in message
        assert "\n" not in message
    assert time.monotonic() - started < 2 * 8  # two tries, each a 2 s wait (libpq's least)


def test_the_cli_names_a_silent_server_and_exits_2(silent_port: int, tmp_path: Path) -> None:
    url = f"mysql+pymysql://root:s3cretpw@127.0.0.1:{silent_port}/test"
    started = time.monotonic()
    result = run_cli(
        "studies", "--storage", url, cwd=tmp_path, env={storage_module.DB_TIMEOUT_ENV: "1"}
    )
    assert result.returncode == 2, result.stderr
    warning, error = result.stderr.strip().splitlines()  # the password's warning first
    assert warning.startswith("warning: --storage holds a password")
    assert f"127.0.0.1:{silent_port} did not answer" in error, error
    assert "s3cretpw" not in result.stderr + result.stdout
    assert time.monotonic() - started < 30  # 1 s of waiting, the rest is importing


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "ten", "1e9"])
def test_a_bad_db_timeout_is_one_line(
    value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(storage_module.DB_TIMEOUT_ENV, value)
    with pytest.raises(UserError, match=rf"{storage_module.DB_TIMEOUT_ENV}=.*from 1 to 3600"):
        open_storage(POSTGRES_URL)
    # A SQLite file has no server to wait for: the setting is not read.
    open_storage(f"sqlite:///{tmp_path / 'ok.db'}").engine.dispose()


def test_statements_outlast_the_connect_timeout_on_mariadb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handshake is bounded by the short connect timeout; a statement, once connected,
    by the longer statement timeout (pymysql reads both under its read timeout)."""
    require_database(MARIADB_URL)
    monkeypatch.setenv(storage_module.DB_TIMEOUT_ENV, "1")
    storage = open_storage(MARIADB_URL)
    try:
        with storage.engine.connect() as connection:
            slept = connection.execute(sqlalchemy.text("SELECT SLEEP(2.5)")).scalar()
        assert slept == 0  # SLEEP says 0 when it slept the whole time
    finally:
        storage.engine.dispose()


def test_engine_options_keep_a_timeout_the_url_sets() -> None:
    postgres = make_url(POSTGRES_URL)
    assert storage_module.engine_options(postgres)["connect_args"]["connect_timeout"] == 10
    own = storage_module.engine_options(postgres.update_query_dict({"connect_timeout": "7"}))
    assert "connect_timeout" not in own["connect_args"]  # the URL's 7 reaches libpq as given
    require_database(MARIADB_URL)
    mariadb = make_url(MARIADB_URL)
    for parsed, expected in (
        (mariadb, 10),
        (mariadb.update_query_dict({"connect_timeout": "7"}), 7),
    ):
        connection = storage_module.engine_options(parsed)["creator"]()
        try:
            assert connection.connect_timeout == expected
        finally:
            connection.close()


def test_a_password_file_completes_a_server_url_and_never_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$LOADER_SEARCH_STORAGE_PASSWORD_FILE`` (a Docker secret): a real MariaDB user with a
    password, reached by a URL without it. (PostgreSQL here trusts every local login, so
    only MariaDB checks the password.)"""
    require_database(MARIADB_URL)
    user, secret = f"ls_pw_{os.getpid()}", "s3cret-from-a-file"
    admin = sqlalchemy.create_engine(MARIADB_URL)
    with scratch_database(MARIADB_URL) as url:
        database = make_url(url).database
        with admin.begin() as connection:
            # (pymysql formats statements with %: the host wildcard is written %%.)
            connection.exec_driver_sql(f"CREATE USER '{user}'@'%%' IDENTIFIED BY '{secret}'")
            connection.exec_driver_sql(f"GRANT ALL ON `{database}`.* TO '{user}'@'%%'")
        try:
            bare = make_url(url).set(username=user, password=None).render_as_string(False)
            password_file = tmp_path / "password"
            password_file.write_text(secret + "\n")
            monkeypatch.setenv(storage_module.PASSWORD_FILE_ENV, str(password_file))
            monkeypatch.setenv(STORAGE_ENV, bare)
            resolved = resolve_storage_url(None)
            assert make_url(resolved).password == secret
            open_storage(resolved).get_all_studies()  # the server took the password
            assert resolve_storage_url(bare) == resolved  # --storage alike
            assert secret not in mask_url(resolved)
            # A URL with a password of its own, and SQLite, are left as they are.
            own = make_url(url).set(username=user, password="other").render_as_string(False)
            assert resolve_storage_url(own) == own
            assert resolve_storage_url("sqlite:///x.db") == "sqlite:///x.db"
            # A wrong password fails in one line without it; a missing or empty file too.
            password_file.write_text("wrong-password")
            with pytest.raises(UserError) as wrong:
                open_storage(resolve_storage_url(None))
            assert "wrong-password" not in str(wrong.value)
            for content in (None, "", "two\nlines"):
                password_file.unlink(missing_ok=True)
                if content is not None:
                    password_file.write_text(content)
                with pytest.raises(UserError, match="LOADER_SEARCH_STORAGE_PASSWORD_FILE"):
                    resolve_storage_url(None)
        finally:
            with admin.begin() as connection:
                connection.exec_driver_sql(f"DROP USER IF EXISTS '{user}'@'%%'")
            admin.dispose()
