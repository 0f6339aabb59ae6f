"""Two locks that keep shared studies honest.

*Host lock* (between processes on one machine): two trials training at once steal CPU and
GPU from each other and make both throughputs wrong. By default a trial holds the whole host
(an exclusive ``flock`` on ``host.lock``). A worker pinned to its own CPUs (and GPU) holds the
host lock *shared* plus an exclusive lock per CPU and GPU it uses: pinned workers with
disjoint sets run side by side, overlapping ones take turns, and an unpinned trial waits for
all of them (and they for it).

The lock folder is shared by every user of the machine, like ``/tmp``, so nothing in it is
trusted: the folder must be one that no other user can swap files in (ours or root's, and
sticky if others may write it), every lock file is opened relative to the folder's descriptor
and never through a symlink, never as anything but a regular file with a single link, and only
a file this process just created is ever chmod-ed. A user who plants ``host.lock ->
/etc/shadow`` gets refused with a `UserError`, instead of a world-writable ``/etc/shadow``.

A trial that has to wait is told who holds the lock: the holder's pid (from ``/proc/locks``),
its user (from the kernel) and its study and start (from the note ``holder-<pid>.json`` the
holder leaves in the folder), so that an operator can act on a lock held forever.

*Study lock* (between workers on any machine): counting a study's budget and taking the next
trial must be one step, or two workers that both see "one trial left" run two. The database
itself provides it: ``pg_advisory_lock`` on PostgreSQL, ``GET_LOCK`` on MySQL/MariaDB, and a
``flock`` beside the file for SQLite (workers on one machine).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil
import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Engine

from loader_search import interrupts
from loader_search.errors import StudyAborted, UserError

LOCK_DIR_ENV = "LOADER_SEARCH_LOCK_DIR"
_LOCK_POLL_S = 0.1  # how often a waiting trial tries the host lock again
_WAIT_REPORT_S = 30.0  # while a wait lasts, name the holder again this often (for logs)
_OPEN_TRIES = 10  # a lock file removed and re-created under us this often in a row: give up
_NOTE_MAX_BYTES = 4096
_SHOWN_HOLDERS = 3  # of the processes sharing a busy lock, name this many
_FIX_FOLDER = f"remove it, or set {LOCK_DIR_ENV} to a folder you own"


def lock_dir() -> Path:
    """Where host locks live: ``$LOADER_SEARCH_LOCK_DIR``, else ``/tmp/loader-search-locks``,
    shared by every user of the machine. Not ``$TMPDIR``: schedulers such as Slurm give each
    job its own, which would hide the jobs' trials from each other. Containers on one host
    must mount the same folder there to see each other's trials."""
    configured = os.environ.get(LOCK_DIR_ENV)
    shared = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    return Path(configured) if configured else shared / "loader-search-locks"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _open_folder(path: Path) -> int:
    """A descriptor of the lock folder ``path``, which is created (sticky and world-writable,
    like /tmp) if missing. Refuses a folder in which another user could swap lock files for
    links to ours (see `_check_folder`); lock files are then opened relative to the descriptor,
    so the folder itself cannot be swapped between this check and their use."""
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)  # widened below, once we know the folder opened is this one
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserError(
            f"cannot create the lock folder {path} ({exc.strerror}); set {LOCK_DIR_ENV} to a"
            " folder you own"
        ) from None
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise UserError(f"the lock folder {path} is a symlink; {_FIX_FOLDER}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except NotADirectoryError:  # a file, or a symlink swapped in since the lstat
        raise UserError(f"the lock folder {path} is not a folder; {_FIX_FOLDER}") from None
    try:
        info = os.fstat(fd)
        # Only a folder we made: if another user swapped theirs in, its owner tells (and an
        # existing folder's mode is its owner's business).
        if created and info.st_uid == os.geteuid():
            os.fchmod(fd, 0o1777)
            info = os.fstat(fd)
        _check_folder(path, info)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_folder(path: Path, info: os.stat_result) -> None:
    """Refuse a folder whose entries a user other than us (and root) can rename or remove:
    one owned by another user, or writable by others without the sticky bit."""
    if info.st_uid not in (os.geteuid(), 0):
        raise UserError(
            f"the lock folder {path} is owned by uid {info.st_uid} ({_user_name(info.st_uid)}),"
            f" who could swap its lock files for links to your files; {_FIX_FOLDER}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise UserError(
            f"the lock folder {path} is writable by {who} without the sticky bit (mode"
            f" {stat.S_IMODE(info.st_mode):o}), so they could swap its lock files for links to"
            f" your files; {_FIX_FOLDER}"
        )


def _open_lock_file(folder_fd: int, name: str, shown: Path, flags: int, *, share: bool) -> int:
    """Open the lock file ``name`` in the folder ``folder_fd`` with ``flags`` (``O_RDONLY`` is
    enough for ``flock``), creating it if missing; ``shown`` is its path for messages.

    Never follows a symlink, never opens anything but a regular file with a single link, and
    chmods only a file it has just created: with ``share``, to 0o666, so that other users'
    workers can open it too. ``O_NONBLOCK`` so that a FIFO planted there cannot hang the open
    (it is refused once open); on a regular file it changes nothing."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(_OPEN_TRIES):
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=folder_fd)
        except FileExistsError:
            pass  # a file, or a symlink (O_EXCL never follows one): open what is there
        else:
            if share:  # our own new file; the umask may have narrowed it
                os.fchmod(fd, 0o666)
            return fd
        try:
            fd = os.open(name, flags, dir_fd=folder_fd)
        except FileNotFoundError:
            continue  # removed since our O_EXCL found it: create it again
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symlink
                raise UserError(
                    f"the lock file {shown} is a symlink, which loader-search never follows (it"
                    " could point at any file); remove it"
                ) from None
            if exc.errno == errno.EISDIR:
                raise UserError(f"the lock file {shown} is a folder; remove it") from None
            raise
        try:
            _check_lock_file(shown, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise UserError(
        f"cannot open the lock file {shown}: it was removed {_OPEN_TRIES} times in a row as it"
        " was opened; find what keeps removing it"
    )


def _check_lock_file(shown: Path, info: os.stat_result) -> None:
    """An existing lock file may belong to another user (the host lock is shared on purpose)
    but must be a plain file. A second name of some other file (a hard link) is harmless: it
    is opened read-only and its mode is never changed; refusing it would let anyone who can
    link the world-readable lock file elsewhere stop every worker."""
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a socket"
            if stat.S_ISSOCK(info.st_mode)
            else "a device"
            if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
            else "a folder"
            if stat.S_ISDIR(info.st_mode)
            else "not a file"
        )
        raise UserError(f"the lock file {shown} is {kind}, not a regular file; remove it")


def _printable(text: str, limit: int = 80) -> str:
    """``text`` fit for one line of a terminal: someone else wrote it (a note, a command),
    and escape sequences or newlines in it must not reach the operator's screen or log."""
    return "".join(c for c in text if c.isprintable())[:limit]


def _when(started: float) -> str:
    """``00:31:02, 5 min ago``; with the date for what started a day or more ago."""
    age = max(0.0, time.time() - started)
    if age < 60:
        ago = f"{age:.0f} s ago"
    elif age < 3600:
        ago = f"{age // 60:.0f} min ago"
    elif age < 86400:
        ago = f"{age // 3600:.0f} h {age % 3600 // 60:.0f} min ago"
    else:
        days = int(age // 86400)
        ago = f"{days} day{'s' if days > 1 else ''} ago"
    clock = time.strftime("%H:%M:%S" if age < 86400 else "%Y-%m-%d %H:%M", time.localtime(started))
    return f"{clock}, {ago}"


def _holder_pids(lock_fd: int) -> list[int]:
    """The pids holding a ``flock`` on ``lock_fd``'s file, from ``/proc/locks`` (Linux; empty
    elsewhere). Its lines read ``1: FLOCK  ADVISORY  WRITE 4242 fe:01:1466425 0 EOF``: pid,
    then the device's major and minor (hex) and the inode; a waiter's line has ``->`` after
    the number, so it is skipped."""
    info = os.fstat(lock_fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:
        return []
    device = (os.major(info.st_dev), os.minor(info.st_dev))
    exact: list[int] = []
    same_inode: list[int] = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            same_device = (int(major, 16), int(minor, 16)) == device
            if int(inode) != info.st_ino or pid <= 0:
                continue
        except ValueError:
            continue
        (exact if same_device else same_inode).append(pid)
    # On btrfs subvolumes stat()'s device is not the one /proc/locks shows: then the inode
    # alone has to do.
    return sorted(set(exact or same_inode))


def _describe_holders(lock_fd: int, folder_fd: int) -> str:
    """Who holds ``lock_fd``'s lock, in one line (see `_describe`)."""
    pids = _holder_pids(lock_fd)
    if not pids:
        return "an unknown process"
    shown = [_describe(pid, folder_fd) for pid in pids[:_SHOWN_HOLDERS]]
    more = len(pids) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


def _describe(pid: int, folder_fd: int) -> str:
    """``pid 4242 (user ann, study quickstart, since 00:31:02, 5 min ago)`` from the holder's
    note, or without a trustworthy note ``pid 4242 (user ann, python, started 00:30:58, ...)``.
    Only the basename of the command: its arguments may hold a database password."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            uid = int(process.uids().effective)
            started = float(process.create_time())
            try:
                argv = [str(arg) for arg in process.cmdline()]
            except psutil.Error:
                argv = []
            command = os.path.basename(argv[0]) if argv else str(process.name())
    except psutil.NoSuchProcess:
        return (
            f"pid {pid} (not running here: in another container, or exited leaving a child"
            " that still holds the lock)"
        )
    except psutil.Error:
        return f"pid {pid}"
    parts = [f"user {_user_name(uid)}"]
    note = _read_note(folder_fd, pid, uid, started)
    if note is None:
        parts += [_printable(command, 40), f"started {_when(started)}"]
    else:
        study, since = note
        parts += ([f"study {study}"] if study else []) + [f"since {_when(since)}"]
    return f"pid {pid} ({', '.join(parts)})"


def _note_name(pid: int) -> str:
    return f"holder-{pid}.json"


def _read_note(folder_fd: int, pid: int, uid: int, started: float) -> tuple[str, float] | None:
    """The study and start from ``pid``'s note, if it can be trusted: a regular file with one
    link owned by the holder's own user (so that no one can speak for another user's
    process), naming ``pid``, and written after that process started (not left behind by an
    earlier process with the same pid)."""
    try:
        fd = os.open(
            _note_name(pid),
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            dir_fd=folder_fd,
        )
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != uid:
            return None
        note = json.loads(os.read(fd, _NOTE_MAX_BYTES))
    except (OSError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        return None
    finally:
        os.close(fd)
    if not isinstance(note, dict) or note.get("pid") != pid:
        return None
    study, since = note.get("study"), note.get("since")
    if not isinstance(since, (int, float)) or not started - 5 <= since <= time.time() + 60:
        return None
    return (_printable(study) if isinstance(study, str) else ""), float(since)


# Notes this process has written: (folder device, folder inode, pid) -> (holders, note inode).
# Threads of one process that hold locks at once (pinned tests) share the first one's note.
_NOTES: dict[tuple[int, int, int], tuple[int, int | None]] = {}
_NOTES_LOCK = threading.Lock()


@contextlib.contextmanager
def _holder_note(folder_fd: int, study: str | None) -> Iterator[None]:
    """While this process holds a lock in the folder, leave a note there saying which study
    and since when, for whoever waits (see `_describe`)."""
    folder = os.fstat(folder_fd)
    key = (folder.st_dev, folder.st_ino, os.getpid())
    with _NOTES_LOCK:
        holders, inode = _NOTES.get(key, (0, None))
        if holders == 0:
            inode = _write_note(folder_fd, study)
        _NOTES[key] = (holders + 1, inode)
    try:
        yield
    finally:
        if os.getpid() == key[2]:  # not in a child forked while the lock was held
            with _NOTES_LOCK:
                holders, inode = _NOTES.pop(key)
                if holders > 1:
                    _NOTES[key] = (holders - 1, inode)
                elif inode is not None:
                    _remove_note(folder_fd, inode)


def _write_note(folder_fd: int, study: str | None) -> int | None:
    """Write this process's note; its inode, or None if it cannot (the lock works without)."""
    pid = os.getpid()
    name = _note_name(pid)
    note = {"pid": pid, "user": _user_name(os.geteuid()), "study": study, "since": time.time()}
    try:
        with contextlib.suppress(FileNotFoundError):
            old = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            # Ours: left by an earlier process with our pid. Another user's stays (and fails
            # our O_EXCL below): waiters do not trust it, as it is not owned by our user.
            if old.st_uid == os.geteuid():
                os.unlink(name, dir_fd=folder_fd)
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=folder_fd,
        )
        try:
            os.fchmod(fd, 0o644)  # our new file; readable by waiters of every user
            os.write(fd, json.dumps(note).encode())
            return os.fstat(fd).st_ino
        finally:
            os.close(fd)
    except OSError:
        return None


def _remove_note(folder_fd: int, inode: int) -> None:
    name = _note_name(os.getpid())
    with contextlib.suppress(OSError):
        if os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_ino == inode:
            os.unlink(name, dir_fd=folder_fd)


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
            self.on_wait(_describe_holders(lock_fd, self.folder_fd))


def _flock(lock_fd: int, mode: int, waiting: _Waiting) -> None:
    """Take ``mode`` on ``lock_fd``; while it is busy, say who holds it and wait (polling, so
    that a Ctrl-C is acted on: see `loader_search.interrupts`)."""
    while True:
        try:
            fcntl.flock(lock_fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waiting.busy(lock_fd)
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
        folder_fd = _open_folder(folder)
        stack.callback(os.close, folder_fd)
        waiting = _Waiting(on_wait, folder_fd)
        host = _open_lock_file(
            folder_fd, "host.lock", folder / "host.lock", os.O_RDONLY, share=True
        )
        stack.callback(os.close, host)
        _flock(host, fcntl.LOCK_SH if pinned else fcntl.LOCK_EX, waiting)
        stack.enter_context(_holder_note(folder_fd, study))
        for name in names:  # always in the same order: no deadlock between pinned workers
            handle = _open_lock_file(folder_fd, name, folder / name, os.O_RDONLY, share=True)
            stack.callback(os.close, handle)
            _flock(handle, fcntl.LOCK_EX, waiting)
        yield


def _open_beside(path: str) -> int:
    """The SQLite study lock file ``path`` (beside the database, where the user chose),
    opened read-write for ``lockf`` with the same care as the host lock files, and created
    with the umask's mode: it is shared like the database file itself."""
    folder, name = os.path.split(path)
    folder_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_lock_file(folder_fd, name, Path(path), os.O_RDWR, share=False)
    finally:
        os.close(folder_fd)


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
            fd = _open_beside(path)
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
