"""Where a worker's time goes per trial, outside the training itself.

With ``$LOADER_SEARCH_TIMINGS`` naming a file, every worker appends one JSON line per trial:
the milliseconds spent looking ahead, waiting for and holding the study lock, taking the
trial, recording it and reporting it, beside the trial job's own time. `benchmarks/scale.py`
reads them; a team that suspects its database can read them too. Unset, nothing is timed
to a file (the clock still runs: a few ``perf_counter`` calls per trial).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

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
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)  # one write to an O_APPEND file: lines never interleave
        finally:
            os.close(fd)
