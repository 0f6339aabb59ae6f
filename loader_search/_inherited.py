"""Lock files a forked process must not keep: the registry `loader_search.team._lockfiles`
fills as it opens them, and `close_inherited_locks`, which a forked trial and its loader
workers call (`loader_search.trial`). Below both layers, so that the trial layer needs nothing
of the team layer above it."""

from __future__ import annotations

import os
import stat

__all__ = ["close_inherited_locks", "remember_lock_file"]

# Every lock file this process (or the one it was forked from) opened, as (device, inode):
# what `close_inherited_locks` closes in a forked trial and its loader workers.
_LOCK_FILES: set[tuple[int, int]] = set()


def remember_lock_file(fd: int) -> int:
    """Note ``fd``'s file as a lock file (see `close_inherited_locks`); returns ``fd``."""
    info = os.fstat(fd)
    _LOCK_FILES.add((info.st_dev, info.st_ino))
    return fd


def close_inherited_locks() -> int:
    """Close this process's descriptors of the lock files `remember_lock_file` noted (the
    team layer's ``open_lock_file`` opens them), here or in the process this one was forked
    from; how many were closed.

    For a process forked while a lock was held (a trial, a loader worker of a trial): a
    ``flock`` belongs to the open file, which a forked child shares, so any copy keeps the
    lock for as long as it lives, whoever took it. A loader worker that hung in the dataset
    kept the host lock of a SIGKILLed run (and so every later trial on the machine) until
    it was killed by hand. The child never takes a lock through these copies; closing them
    leaves the parent's locks alone (a ``flock`` is released when its last copy closes, a
    ``lockf`` only by a close in its own process). Linux only (``/proc``), like forked trials.
    """
    if not _LOCK_FILES:
        return 0
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    closed = 0
    for name in names:
        try:
            info = os.fstat(int(name))
        except OSError:  # the listing's own descriptor, closed since
            continue
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) in _LOCK_FILES:
            os.close(int(name))
            closed += 1
    return closed
