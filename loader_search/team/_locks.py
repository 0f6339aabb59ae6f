"""Two locks that keep shared studies honest.

*Host lock* (between processes on one machine): two trials training at once steal CPU and
GPU from each other and make both throughputs wrong. By default a trial holds the whole host
(an exclusive ``flock`` on ``host.lock``). A worker pinned to its own CPUs (and GPU) holds the
host lock *shared* plus an exclusive lock per CPU and GPU it uses: pinned workers with
disjoint sets run side by side, overlapping ones take turns, and an unpinned trial waits for
all of them (and they for it). Waiters take turns: each passes a turnstile (``queue.lock``)
that it holds until it has the host lock, so a process that releases the lock and asks again
queues behind whoever already waits.

The lock folder is shared by every user of the machine, like ``/tmp``: its files are opened
as `loader_search.team._lockfiles` says, never trusting what another user may have planted. A
trial that has to wait is told who holds the lock (`loader_search.team._holders`).

*Study lock* (between workers on any machine): counting a study's budget and taking the next
trial must be one step, or two workers that both see "one trial left" run two. The database
itself provides it: ``pg_advisory_lock`` on PostgreSQL, ``GET_LOCK`` on MySQL/MariaDB. For
SQLite (workers on one machine) it is a record lock on a file in the host lock folder, named
after the database (`sqlite_lock_name`): not beside the database, where it would litter the
user's folder (and their commits). Processes that share a SQLite file must share the lock
folder, as they must for the host lock anyway.

A holder that freezes (SIGSTOP, a machine lost without a word) must not stop the team: its
session would keep the lock until the server notices, hours later. So the lock's session is
told to end itself once idle for ``hold_limit_s`` (``idle_session_timeout`` on PostgreSQL 14
and later, ``wait_timeout`` on MySQL/MariaDB): the server then drops it and its lock, and the
next worker goes on. A live holder's lock session is idle while it works under the lock on its
other connections, so ``hold_limit_s`` must exceed the longest step taken under the lock
(seconds; the worker gives its heartbeat grace). A holder that lost its lock this way says so
when it releases it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Engine

from loader_search import interrupts
from loader_search.errors import StudyAborted, UserError
from loader_search.team._holders import describe_holders, holder_note
from loader_search.team._lockfiles import (
    HOST_LOCK,
    LOCK_DIR_ENV,
    TURNSTILE,
    lock_dir,
    open_folder,
    open_lock_file,
)
from loader_search.team._storage import in_memory

__all__ = [
    "LOCK_DIR_ENV",
    "StudyLockLost",
    "StudyLockTimeout",
    "host_lock",
    "lock_dir",
    "study_lock",
]

_LOCK_POLL_S = 0.1  # how often a waiting trial tries the host lock again
_WAIT_REPORT_S = 30.0  # while a wait lasts, name the holder again this often (for logs)
# A turnstile held this long while the host lock is free: its holder is stuck (see _take_turn).
_STUCK_TURNSTILE_S = 5.0


class _Waiting:
    """Tells ``on_wait`` who holds a busy lock, when the wait for it starts and then every
    `_WAIT_REPORT_S` while it lasts (a log that is not a terminal shows the wait go on)."""

    def __init__(self, on_wait: Callable[[str], None] | None, folder_fd: int) -> None:
        self.on_wait = on_wait
        self.folder_fd = folder_fd
        self.lock_fd: int | None = None
        self.next_report = 0.0

    def busy(self, lock_fd: int) -> None:
        if self.on_wait is None:
            return
        now = time.monotonic()
        if lock_fd != self.lock_fd or now >= self.next_report:
            self.lock_fd, self.next_report = lock_fd, now + _WAIT_REPORT_S
            self.on_wait(describe_holders(lock_fd, self.folder_fd))


def _flock(lock_fd: int, mode: int, waiting: _Waiting) -> None:
    """Take ``mode`` on ``lock_fd``; while it is busy, say who holds it and wait (polling, so
    that a Ctrl-C is acted on: see `loader_search.interrupts`)."""
    while not _try(lock_fd, mode):
        waiting.busy(lock_fd)
        interrupts.sleep(_LOCK_POLL_S)


def _try(lock_fd: int, mode: int) -> bool:
    try:
        fcntl.flock(lock_fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _take_turn(turnstile: int, host: int, waiting: _Waiting) -> None:
    """Queue at the turnstile, telling who holds the host lock meanwhile. A waiter that
    stopped in the turnstile (Ctrl-Z) must not stall the machine: once the host lock has
    been free for `_STUCK_TURNSTILE_S` while the turnstile stayed taken, go on without it
    (and until then, name the turnstile's holder)."""
    free_since: float | None = None
    while not _try(turnstile, fcntl.LOCK_EX):
        if _try(host, fcntl.LOCK_EX):  # free: nobody trains; let it go at once
            fcntl.flock(host, fcntl.LOCK_UN)
            free_since = free_since if free_since is not None else time.monotonic()
            if time.monotonic() - free_since >= _STUCK_TURNSTILE_S:
                return
            waiting.busy(turnstile)
        else:
            free_since = None
            waiting.busy(host)
        interrupts.sleep(_LOCK_POLL_S)


@contextlib.contextmanager
def host_lock(
    cpus: Sequence[int] | None = None,
    gpu: int | None = None,
    *,
    on_wait: Callable[[str], None] | None = None,
    directory: Path | None = None,
    study: str | None = None,
) -> Iterator[None]:
    """Hold this machine for one trial (see the module docstring).

    While a lock is busy, ``on_wait`` gets a one-line description of its holder, such as
    ``pid 4242 (user ann, study quickstart, since 00:31:02, 5 min ago)`` or ``an unknown
    process``: when the wait starts and every 30 s while it lasts. ``study`` is what this
    process's note tells its own waiters. Raises `UserError` for a lock folder or lock file
    that another user could have planted or could swap.
    """
    folder = directory or lock_dir()
    names = []
    if cpus:
        names += [f"cpu-{cpu}.lock" for cpu in sorted(set(cpus))]
    if gpu is not None:
        names.append(f"gpu-{gpu}.lock")
    pinned = bool(names)
    with contextlib.ExitStack() as stack:  # unwinds in reverse: closing releases each flock
        folder_fd = open_folder(folder)
        stack.callback(os.close, folder_fd)
        waiting = _Waiting(on_wait, folder_fd)
        host = open_lock_file(folder_fd, HOST_LOCK, folder / HOST_LOCK, os.O_RDONLY, share=True)
        stack.callback(os.close, host)
        # Turns: waiters pass a turnstile one at a time, and the one in it holds it until it
        # has the host lock. A process that runs trials back to back queues there too, behind
        # whoever already waits, instead of winning every race to the lock. (Among several
        # waiters at the turnstile, the order is not strictly their arrival.)
        turnstile = open_lock_file(
            folder_fd, TURNSTILE, folder / TURNSTILE, os.O_RDONLY, share=True
        )
        try:
            _take_turn(turnstile, host, waiting)
            _flock(host, fcntl.LOCK_SH if pinned else fcntl.LOCK_EX, waiting)
        finally:
            os.close(turnstile)  # releases it
        stack.enter_context(holder_note(folder_fd, study))
        for name in names:  # always in the same order: no deadlock between pinned workers
            handle = open_lock_file(folder_fd, name, folder / name, os.O_RDONLY, share=True)
            stack.callback(os.close, handle)
            _flock(handle, fcntl.LOCK_EX, waiting)
        yield


class StudyLockTimeout(StudyAborted):
    """The study lock stayed taken too long (a worker stuck while holding it)."""


def _lock_key(study_id: int) -> int:
    """A signed 64-bit key for ``pg_advisory_lock``, private to loader-search studies."""
    digest = hashlib.sha256(f"loader-search-study-{study_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


_MEMORY_LOCKS: dict[str, threading.Lock] = {}


class StudyLockLost(StudyAborted):
    """This worker held the study lock past ``hold_limit_s`` without a word (frozen), and the
    server gave it to the next worker."""


@contextlib.contextmanager
def study_lock(
    engine: Engine,
    study_id: int,
    *,
    timeout_s: float = 600.0,
    hold_limit_s: float = 120.0,
    on_lost: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Serialise "count the budget, take the next trial" between every worker of a study.

    A holder silent for ``hold_limit_s`` loses the lock (see the module docstring); it learns
    so on release: ``on_lost`` is told why, or without it `StudyLockLost` is raised."""
    # The threads of one process (the worker, its sweeper) take turns before they ask the
    # database: a thread waiting there would hold one of the worker's two pooled connections
    # while the holder needs the other (see `loader_search.team._storage.open_storage`).
    with _turns(engine, study_id), _study_lock(engine, study_id, timeout_s, hold_limit_s, on_lost):
        yield


@contextlib.contextmanager
def _study_lock(
    engine: Engine,
    study_id: int,
    timeout_s: float,
    hold_limit_s: float,
    on_lost: Callable[[str], None] | None,
) -> Iterator[None]:
    backend = engine.url.get_backend_name()
    waited = (
        f"waited {timeout_s:.0f} s for study #{study_id}'s lock, which another worker holds;"
        " if no worker is stuck, try again"
    )
    lost = (
        f"this worker no longer held study #{study_id}'s lock when it let it go: silent for"
        f" more than {hold_limit_s:.0f} s while holding it (stopped or frozen?), or its"
        " connection broke; the database gave the lock to the next worker, so this worker's"
        " last step may have run beside another's"
    )
    limit_s = max(1, round(hold_limit_s))
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
            # For the session: it ends itself, with its lock, once idle (PostgreSQL 14+).
            limited = (connection.dialect.server_version_info or (0,)) >= (14,)
            try:
                if limited:
                    connection.execute(
                        sqlalchemy.text("SELECT set_config('idle_session_timeout', :ms, false)"),
                        {"ms": f"{limit_s * 1000}ms"},
                    )
                connection.commit()
                yield
            finally:
                released = _release(
                    connection,
                    "SELECT pg_advisory_unlock(:key)",
                    {"key": key},
                    restore="RESET idle_session_timeout" if limited else None,
                )
            if not released:
                _lost(lost, on_lost)
    elif backend in ("mysql", "mariadb"):
        with engine.connect() as connection:
            name = f"loader_search_study_{study_id}"
            if not _get_lock(connection, name, timeout_s):
                raise StudyLockTimeout(waited)
            try:
                # For the session: the server closes it, and drops its lock, once idle so long.
                connection.execute(sqlalchemy.text(f"SET SESSION wait_timeout = {limit_s}"))
                yield
            finally:
                released = _release(
                    connection,
                    "SELECT RELEASE_LOCK(:name)",
                    {"name": name},
                    restore="SET SESSION wait_timeout = @@GLOBAL.wait_timeout",
                )
            if not released:
                _lost(lost, on_lost)
    else:
        database = engine.url.database
        if not database or in_memory(engine.url):
            with _MEMORY_LOCKS.setdefault(str(engine.url), threading.Lock()):
                yield
            return
        # A POSIX record lock (lockf), not flock: a trial forked while this thread holds it
        # must not inherit it (flock locks belong to the open file, which the child shares).
        # Record locks do not exclude threads of one process: the thread lock does that.
        name = sqlite_lock_name(database)
        with _MEMORY_LOCKS.setdefault(name, threading.Lock()):
            fd = _open_sqlite_lock(name)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the record lock


# One GET_LOCK's wait, in seconds: well inside the connection's statement (read) timeout,
# `loader_search.team._storage.STATEMENT_TIMEOUT_S`, which would otherwise cut a long wait.
_GET_LOCK_SLICE_S = 5


def _get_lock(connection: sqlalchemy.Connection, name: str, timeout_s: float) -> bool:
    """MySQL/MariaDB's named lock ``name``, waited for up to ``timeout_s`` in short slices;
    whether it was got (GET_LOCK says 0 for a wait that ran out, NULL for an error)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wait = max(0, min(_GET_LOCK_SLICE_S, math.ceil(deadline - time.monotonic())))
        got = connection.execute(
            sqlalchemy.text("SELECT GET_LOCK(:name, :timeout)"), {"name": name, "timeout": wait}
        ).scalar()
        if got == 1:
            return True
        if got is None or time.monotonic() >= deadline:
            return False


def sqlite_lock_name(database: str) -> str:
    """The name, in the host lock folder, of the study lock of the SQLite file ``database``.

    Every spelling of one file gives the same name: relative or absolute, through symlinks,
    and through another mount of its folder (a container's): the key is the database's name
    in its real folder, that folder taken by device and inode. The stem keeps it readable."""
    real = os.path.realpath(database)
    folder, base = os.path.split(real)
    try:
        info = os.stat(folder)
        where = f"{info.st_dev}:{info.st_ino}"
    except OSError:  # no such folder (yet): SQLite cannot open the file either
        where = folder
    digest = hashlib.sha256(f"{where}/{base}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:40]
    return f"study-{stem}-{digest}.lock"


def _open_sqlite_lock(name: str) -> int:
    """The study lock file ``name`` in the host lock folder, opened for ``lockf`` (which needs
    it writable) with the folder's care; made writable by every user, like the database a
    team of users may share."""
    folder = lock_dir()
    folder_fd = open_folder(folder)
    try:
        return open_lock_file(folder_fd, name, folder / name, os.O_RDWR, share=True)
    except PermissionError:
        raise UserError(
            f"the study lock file {folder / name} is not writable by you (another user made"
            f" it); remove it, or set {LOCK_DIR_ENV} to a folder you own"
        ) from None
    finally:
        os.close(folder_fd)


_TURNS: weakref.WeakKeyDictionary[Engine, dict[int, threading.Lock]] = weakref.WeakKeyDictionary()
_TURNS_GUARD = threading.Lock()


def _turns(engine: Engine, study_id: int) -> threading.Lock:
    """The lock that the threads of this process take turns at, per engine (its pool) and
    study, before they ask the database for ``study_id``'s lock."""
    with _TURNS_GUARD:
        return _TURNS.setdefault(engine, {}).setdefault(study_id, threading.Lock())


def _lost(message: str, on_lost: Callable[[str], None] | None) -> None:
    if on_lost is None:
        raise StudyLockLost(message)
    on_lost(message)


def _release(
    connection: sqlalchemy.Connection,
    statement: str,
    params: dict[str, object],
    restore: str | None = None,
) -> bool:
    """Unlock; whether the lock was still this session's. A connection that cannot say so is
    thrown away (the server drops its locks with the session), so a lock never outlives a
    broken connection in the pool; nor does one whose settings ``restore`` cannot put back."""
    try:
        held = connection.execute(sqlalchemy.text(statement), params).scalar()
        connection.commit()
    except Exception:
        connection.invalidate()
        return False
    if restore is not None:
        try:
            connection.execute(sqlalchemy.text(restore))
            connection.commit()
        except Exception:
            connection.invalidate()
    return bool(held)
