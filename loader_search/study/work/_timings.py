"""Where a worker's time goes per trial, outside the training itself.

With ``$LOADER_SEARCH_TIMINGS`` naming a file, every worker appends one JSON line per trial:
the milliseconds spent looking ahead, waiting for and holding the study lock, taking the
trial, recording it and reporting it, beside the trial job's own time. `benchmarks/scale.py`
reads them; a team that suspects its database can read them too. Unset, nothing is timed
to a file (the clock still runs: a few ``perf_counter`` calls per trial).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

from loader_search.errors import UserError

TIMINGS_ENV = "LOADER_SEARCH_TIMINGS"


class Clock:
    """One trial's coordination times, in milliseconds by part."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.parts: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds * 1000.0

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    @contextlib.contextmanager
    def lock(self, held: AbstractContextManager[object], name: str = "lock") -> Iterator[None]:
        """Enter ``held`` (a lock), timing the wait for it as ``{name}_wait`` and the time it
        is held, its release included, as ``{name}_hold``."""
        start = time.perf_counter()
        taken: float | None = None
        try:
            with held:
                taken = time.perf_counter()
                self.add(f"{name}_wait", taken - start)
                yield
        finally:
            if taken is not None:
                self.add(f"{name}_hold", time.perf_counter() - taken)

    def write(self, **fields: object) -> None:
        """Append this trial's line to ``$LOADER_SEARCH_TIMINGS``, if set: ``total`` is the
        time since the clock started, and ``coordination`` that less the training (``job``)
        and the wait for this machine's other trials (``host_wait``)."""
        path = os.environ.get(TIMINGS_ENV)
        if not path:
            return
        total = (time.perf_counter() - self.started) * 1000.0
        outside = self.parts.get("job", 0.0) + self.parts.get("host_wait", 0.0)
        line = {
            **fields,
            "pid": os.getpid(),
            "total_ms": round(total, 3),
            "coordination_ms": round(total - outside, 3),
            **{f"{name}_ms": round(ms, 3) for name, ms in self.parts.items()},
        }
        data = (json.dumps(line) + "\n").encode()
        try:
            fd = _open_timings(path)
        except (OSError, UserError):
            return  # planted since `check_timings_file` looked: the trial's result matters more
        try:
            os.write(fd, data)  # one write to an O_APPEND file: lines never interleave
        finally:
            os.close(fd)


def _open_timings(path: str) -> int:
    """``path`` opened to append, never through a symlink (root would append to whatever file
    a planted link names) and only as a regular file (a FIFO would hang the worker)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(
                f"${TIMINGS_ENV} {path} is a symlink, which loader-search never follows (it"
                " could point at any file); name a file of your own"
            ) from None
        raise UserError(
            f"${TIMINGS_ENV} {path}: cannot open it ({exc.strerror}); name a file you can write"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"${TIMINGS_ENV} {path} is not a regular file; name a file of your own")
    return fd


def check_timings_file() -> None:
    """Refuse, before a worker starts, a ``$LOADER_SEARCH_TIMINGS`` file it could not append
    to safely (see `_open_timings`)."""
    path = os.environ.get(TIMINGS_ENV)
    if path:
        os.close(_open_timings(path))
