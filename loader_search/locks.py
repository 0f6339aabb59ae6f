"""Two locks that keep shared studies honest.

*Host lock* (between processes on one machine): two trials training at once steal CPU and
GPU from each other and make both throughputs wrong. By default a trial holds the whole host
(an exclusive ``flock`` on ``host.lock``). A worker pinned to its own CPUs (and GPU) holds the
host lock *shared* plus an exclusive lock per CPU and GPU it uses: pinned workers with
disjoint sets run side by side, overlapping ones take turns, and an unpinned trial waits for
all of them (and they for it).

*Study lock* (between workers on any machine): counting a study's budget and taking the next
trial must be one step, or two workers that both see "one trial left" run two. The database
itself provides it: ``pg_advisory_lock`` on PostgreSQL, ``GET_LOCK`` on MySQL/MariaDB, and a
``flock`` beside the file for SQLite (workers on one machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Engine

from loader_search import interrupts
from loader_search.errors import StudyAborted

LOCK_DIR_ENV = "LOADER_SEARCH_LOCK_DIR"
_LOCK_POLL_S = 0.1  # how often a waiting trial tries the host lock again


def lock_dir() -> Path:
    """Where host locks live: ``$LOADER_SEARCH_LOCK_DIR``, else ``/tmp/loader-search-locks``,
    shared by every user of the machine. Not ``$TMPDIR``: schedulers such as Slurm give each
    job its own, which would hide the jobs' trials from each other. Containers on one host
    must mount the same folder there to see each other's trials."""
    configured = os.environ.get(LOCK_DIR_ENV)
    shared = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    path = Path(configured) if configured else shared / "loader-search-locks"
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another user's folder: leave its mode alone
            path.chmod(0o1777)  # sticky and world-writable, like /tmp
    return path


def _open_lock_file(path: Path) -> IO[bytes]:
    """Read-only (``flock`` needs no more), and readable by every user: another user's
    worker on this machine must be able to open the same lock."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # only the owner may; the umask may have narrowed it
        os.fchmod(fd, 0o666)
    return os.fdopen(fd, "rb")


def _flock(
    handle: IO[bytes], mode: int, on_wait: Callable[[], None] | None, waited: list[bool]
) -> None:
    """Take ``mode`` on ``handle``; if it is busy, say so once and wait (polling, so that a
    Ctrl-C is acted on: see `loader_search.interrupts`)."""
    while True:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if on_wait is not None and not waited:
                on_wait()
            waited.append(True)
            interrupts.sleep(_LOCK_POLL_S)


@contextlib.contextmanager
def host_lock(
    cpus: Sequence[int] | None = None,
    gpu: int | None = None,
    *,
    on_wait: Callable[[], None] | None = None,
    directory: Path | None = None,
) -> Iterator[None]:
    """Hold this machine for one trial (see the module docstring). ``on_wait`` is called
    once if the lock is busy, before blocking."""
    folder = directory or lock_dir()
    names = []
    if cpus:
        names += [f"cpu-{cpu}.lock" for cpu in sorted(set(cpus))]
    if gpu is not None:
        names.append(f"gpu-{gpu}.lock")
    pinned = bool(names)
    handles: list[IO[bytes]] = []
    waited: list[bool] = []
    try:
        host = _open_lock_file(folder / "host.lock")
        handles.append(host)
        _flock(host, fcntl.LOCK_SH if pinned else fcntl.LOCK_EX, on_wait, waited)
        for name in names:  # always in the same order: no deadlock between pinned workers
            handle = _open_lock_file(folder / name)
            handles.append(handle)
            _flock(handle, fcntl.LOCK_EX, on_wait, waited)
        yield
    finally:
        for handle in reversed(handles):
            handle.close()  # closing releases the flock


class StudyLockTimeout(StudyAborted):
    """The study lock stayed taken too long (a worker stuck while holding it)."""


def _lock_key(study_id: int) -> int:
    """A signed 64-bit key for ``pg_advisory_lock``, private to loader-search studies."""
    digest = hashlib.sha256(f"loader-search-study-{study_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


_MEMORY_LOCKS: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def study_lock(engine: Engine, study_id: int, *, timeout_s: float = 600.0) -> Iterator[None]:
    """Serialise "count the budget, take the next trial" between every worker of a study."""
    backend = engine.url.get_backend_name()
    waited = (
        f"waited {timeout_s:.0f} s for study #{study_id}'s lock, which another worker holds;"
        " if no worker is stuck, try again"
    )
    if backend == "postgresql":
        with engine.connect() as connection:
            key = _lock_key(study_id)
            connection.execute(  # for this transaction only; SET takes no parameters
                sqlalchemy.text("SELECT set_config('lock_timeout', :ms, true)"),
                {"ms": f"{int(timeout_s * 1000)}ms"},
            )
            try:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            except sqlalchemy.exc.OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_timeout
                    raise StudyLockTimeout(waited) from None
                raise
            connection.commit()
            try:
                yield
            finally:
                _release(connection, "SELECT pg_advisory_unlock(:key)", {"key": key})
    elif backend in ("mysql", "mariadb"):
        with engine.connect() as connection:
            name = f"loader_search_study_{study_id}"
            got = connection.execute(
                sqlalchemy.text("SELECT GET_LOCK(:name, :timeout)"),
                {"name": name, "timeout": int(timeout_s)},
            ).scalar()
            if got != 1:
                raise StudyLockTimeout(waited)
            try:
                yield
            finally:
                _release(connection, "SELECT RELEASE_LOCK(:name)", {"name": name})
    else:
        database = engine.url.database
        if not database or database == ":memory:":
            with _MEMORY_LOCKS.setdefault(str(engine.url), threading.Lock()):
                yield
            return
        # A POSIX record lock (lockf), not flock: a trial forked while this thread holds it
        # must not inherit it (flock locks belong to the open file, which the child shares).
        # Record locks do not exclude threads of one process: the thread lock does that.
        path = f"{database}.loader-search.lock"
        with _MEMORY_LOCKS.setdefault(path, threading.Lock()):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the record lock


def _release(connection: sqlalchemy.Connection, statement: str, params: dict[str, object]) -> None:
    """Unlock; a connection that cannot say so is thrown away, and the server drops its locks
    with the session, so a lock never outlives a broken connection in the pool."""
    try:
        connection.execute(sqlalchemy.text(statement), params)
        connection.commit()
    except Exception:
        connection.invalidate()
