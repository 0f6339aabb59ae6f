"""Opening lock files in a folder that every user of the machine shares, safely.

The lock folder is shared like ``/tmp``, so nothing in it is trusted: the folder must be one
that no other user can swap files in (ours or root's, and sticky if others may write it), every
lock file is opened relative to the folder's descriptor, never through a symlink and never as
anything but a regular file, and only a file this process just created is ever chmod-ed. A user
who plants ``host.lock -> /etc/shadow`` gets refused with a `UserError`, instead of a
world-writable ``/etc/shadow``. (A hard link is harmless: the file is opened read-only and its
mode left alone.)
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from pathlib import Path

from loader_search._inherited import remember_lock_file
from loader_search.errors import UserError

LOCK_DIR_ENV = "LOADER_SEARCH_LOCK_DIR"
_OPEN_TRIES = 10  # a lock file removed and re-created under us this often in a row: give up
_FIX_FOLDER = f"remove it, or set {LOCK_DIR_ENV} to a folder you own"
_FIX_UNUSABLE = f"set {LOCK_DIR_ENV} to a folder you can write, e.g. one of your own under /tmp"


def lock_dir() -> Path:
    """Where host locks live: ``$LOADER_SEARCH_LOCK_DIR``, else ``/tmp/loader-search-locks``,
    shared by every user of the machine. Not ``$TMPDIR``: schedulers such as Slurm give each
    job its own, which would hide the jobs' trials from each other. Containers on one host
    must mount the same folder there to see each other's trials."""
    configured = os.environ.get(LOCK_DIR_ENV)
    shared = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    return Path(configured) if configured else shared / "loader-search-locks"


HOST_LOCK = "host.lock"  # held by every trial (see `loader_search.team._locks`)
TURNSTILE = "queue.lock"  # where waiters for it take turns


def check_lock_folder() -> None:
    """Refuse, before a study is touched, a lock folder or a host lock file that the first
    trial would refuse when it takes the host lock (a planted symlink, another user's
    unreadable file)."""
    folder = lock_dir()
    folder_fd = open_folder(folder)
    try:
        for name in (HOST_LOCK, TURNSTILE):
            os.close(open_lock_file(folder_fd, name, folder / name, os.O_RDONLY, share=True))
    finally:
        os.close(folder_fd)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def open_folder(path: Path) -> int:
    """A descriptor of the lock folder ``path``, which is created (sticky and world-writable,
    like /tmp) if missing. Refuses a folder in which another user could swap lock files for
    links to ours (see `_check_folder`); lock files are then opened relative to the descriptor,
    so the folder itself cannot be swapped between this check and their use."""
    created = False
    _make_parents(path)
    try:
        os.mkdir(path, 0o700)  # widened below, once we know the folder opened is this one
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserError(
            f"cannot create the lock folder {path} ({exc.strerror}); set {LOCK_DIR_ENV} to a"
            " folder you own"
        ) from None
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise UserError(f"the lock folder {path} is a symlink; {_FIX_FOLDER}")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except NotADirectoryError:  # a file, or a symlink swapped in since the lstat
        raise UserError(f"the lock folder {path} is not a folder; {_FIX_FOLDER}") from None
    except OSError as exc:  # not ours to read (EACCES), gone since the mkdir, ...
        raise UserError(
            f"cannot open the lock folder {path} ({exc.strerror}); {_FIX_UNUSABLE}"
        ) from None
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


_MAX_SYMLINKS = 40  # as the kernel's own limit on links followed in one path


def _make_parents(path: Path) -> None:
    """Create the missing folders above the lock folder ``path``, one at a time, following
    only symlinks that root or we own. ``mkdir(parents=True)`` follows any: a link planted
    by another user in a shared folder (``<shared>/sym -> /etc``) would have root make the
    world-writable lock folder under /etc."""
    parts = list((Path.cwd() / path).parts[1:-1])  # not normalised: ".." is walked below
    current = Path("/")
    links = 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent  # ``current`` never holds a symlink: this is its parent
            continue
        candidate = current / name
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            try:
                os.mkdir(candidate, 0o755)
            except FileExistsError:
                parts.insert(0, name)  # made meanwhile (by whom?): look at it again
                continue
            except OSError as exc:
                raise UserError(
                    f"cannot create the lock folder {path}: {candidate} ({exc.strerror});"
                    f" set {LOCK_DIR_ENV} to a folder you own"
                ) from None
            current = candidate
            continue
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (0, os.geteuid()):
                raise UserError(
                    f"the lock folder {path} lies under {candidate}, a symlink owned by uid"
                    f" {info.st_uid} ({user_name(info.st_uid)}), who could point it at any"
                    f" folder; {_FIX_FOLDER}"
                )
            links += 1
            if links > _MAX_SYMLINKS:
                raise UserError(f"the lock folder {path}: too many symlinks; {_FIX_FOLDER}")
            target = Path(os.readlink(candidate))
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            current = Path("/") if target.is_absolute() else current
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise UserError(f"the lock folder {path}: {candidate} is not a folder; {_FIX_FOLDER}")
        current = candidate


def _check_folder(path: Path, info: os.stat_result) -> None:
    """Refuse a folder whose entries a user other than us (and root) can rename or remove:
    one owned by another user, or writable by others without the sticky bit."""
    if info.st_uid not in (os.geteuid(), 0):
        raise UserError(
            f"the lock folder {path} is owned by uid {info.st_uid} ({user_name(info.st_uid)}),"
            f" who could swap its lock files for links to your files; {_FIX_FOLDER}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise UserError(
            f"the lock folder {path} is writable by {who} without the sticky bit (mode"
            f" {stat.S_IMODE(info.st_mode):o}), so they could swap its lock files for links to"
            f" your files; {_FIX_FOLDER}"
        )


def open_lock_file(folder_fd: int, name: str, shown: Path, flags: int, *, share: bool) -> int:
    """Open the lock file ``name`` in the folder ``folder_fd`` with ``flags`` (``O_RDONLY`` is
    enough for ``flock``), creating it if missing; ``shown`` is its path for messages.

    Never follows a symlink, never opens anything but a regular file (a hard link is let
    be: see `_check_lock_file`), and chmods only a file it has just created: with ``share``,
    to 0o666, so that other users' workers can open it too. ``O_NONBLOCK`` so that a FIFO
    planted there cannot hang the open (it is refused once open); on a regular file it
    changes nothing."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(_OPEN_TRIES):
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=folder_fd)
        except FileExistsError:
            pass  # a file, or a symlink (O_EXCL never follows one): open what is there
        except OSError as exc:
            # The folder takes no new file: a read-only file system (EROFS), a folder not
            # writable by us (EACCES), one of /proc's (ENOENT), a full disk, ...
            raise UserError(
                f"cannot create the lock file {shown} ({exc.strerror}): the lock folder"
                f" {shown.parent} must take new files; {_FIX_UNUSABLE}"
            ) from None
        else:
            if share:  # our own new file; the umask may have narrowed it
                os.fchmod(fd, 0o666)
            return remember_lock_file(fd)
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
            if exc.errno == errno.EACCES and flags & os.O_ACCMODE == os.O_RDONLY:
                raise _unreadable(folder_fd, name, shown) from None
            if exc.errno == errno.EACCES:
                raise  # a writer's caller says why (another user's file)
            raise UserError(  # EROFS for a writer on a read-only file system, ...
                f"cannot open the lock file {shown} ({exc.strerror}); {_FIX_UNUSABLE}"
            ) from None
        try:
            _check_lock_file(shown, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return remember_lock_file(fd)
    raise UserError(
        f"cannot open the lock file {shown}: it was removed {_OPEN_TRIES} times in a row as it"
        " was opened; find what keeps removing it"
    )


def _unreadable(folder_fd: int, name: str, shown: Path) -> UserError:
    """The error for a lock file another user made that we may not open: they can hold every
    other user's trials off the machine (on purpose or by a narrow umask)."""
    try:
        info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return UserError(f"the lock file {shown} cannot be opened (permission denied); remove it")
    return UserError(
        f"the lock file {shown} belongs to uid {info.st_uid} ({user_name(info.st_uid)}) and"
        f" is not open to you (mode {stat.S_IMODE(info.st_mode):o}): ask them or root to"
        f" remove it (lock files must be readable by every user), or set {LOCK_DIR_ENV} to a"
        " folder of your own"
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
