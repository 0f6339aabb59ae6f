"""Who holds a busy host lock: the holder's pid (from ``/proc/locks``), its user (from the
kernel), and its study and start (from the note ``holder-<pid>.json`` that the holder leaves in
the lock folder), so that a waiter can name it and an operator act on a lock held forever. A
note is trusted only when the holder's own user wrote it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator

import psutil

from loader_search.team._lockfiles import user_name

_NOTE_MAX_BYTES = 4096
_SHOWN_HOLDERS = 3  # of the processes sharing a busy lock, name this many


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


def describe_holders(lock_fd: int, folder_fd: int) -> str:
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
    parts = [f"user {user_name(uid)}"]
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
def holder_note(folder_fd: int, study: str | None) -> Iterator[None]:
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
    note = {"pid": pid, "user": user_name(os.geteuid()), "study": study, "since": time.time()}
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
