"""A command's output, read by a thread of the trial (`loader_search.trial._command`): its
last lines, each cut at `LINE_BYTES`, and the validation losses a ``val_loss_pattern`` (without
one, the default rule: `loader_search.trial._command_val_loss`) finds in them, each line's
match under a time limit (`MATCH_LIMIT_S`)."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
from dataclasses import dataclass, field

import regex

from loader_search.trial._command_val_loss import VAL_LOSS_RULE
from loader_search.trial._processes import POLL_S

OUTPUT_LINES = 40  # the command's last lines kept with a failure
# What is kept of one line of output: a line that never ends (500 MB without a newline) must
# not fill the worker's memory. A validation loss is printed far within it.
LINE_BYTES = 8192
# A val_loss_pattern's time on one line; `regex` releases the GIL while it matches
# (``concurrent``), so even a pattern that backtracks for ever holds up neither the worker's
# signal handling nor its heartbeats, and stops at this limit.
MATCH_LIMIT_S = 0.1
SLOW_MATCHES = 3  # lines on which the pattern ran out of time before it is no longer tried


@dataclass
class Output:
    """The command's output, read by a thread: its last lines (each cut at `LINE_BYTES`),
    and the validation losses ``pattern`` (or, without one, `VAL_LOSS_RULE`) found in it with
    when they were printed (``time.time()``)."""

    pattern: regex.Pattern[str] | None  # the user's val_loss_pattern; None: `VAL_LOSS_RULE`
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES)
    )
    losses: list[tuple[float, float]] = field(default_factory=list)
    slow_matches: int = 0  # lines on which the pattern ran out of time

    def read(self, fd: int, done: threading.Event) -> None:
        """Read ``fd`` to its end, or until ``done`` is set and nothing arrived for a poll: a
        process that escaped the trial and still holds the pipe never holds this thread."""
        line, cut = bytearray(), False
        while True:
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if not ready:
                if done.is_set():
                    break
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            pieces = chunk.split(b"\n")
            for number, piece in enumerate(pieces):
                room = LINE_BYTES - len(line)
                cut = cut or len(piece) > room
                line += piece[: max(room, 0)]
                if number < len(pieces) - 1:  # a newline ended it
                    self._line(bytes(line), cut)
                    line, cut = bytearray(), False
        if line:
            self._line(bytes(line), cut)

    def _line(self, raw: bytes, cut: bool) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        self.tail.append(f"{line} [... cut at {LINE_BYTES:,} bytes]" if cut else line)
        if self.slow_matches >= SLOW_MATCHES:
            return
        if self.pattern is not None:
            patterns, own = (self.pattern,), True
        else:  # what a terminal shows: a progress bar's last update, not a stale first one
            patterns, own = VAL_LOSS_RULE, False
            line = line.rsplit("\r", 1)[-1]
        deadline = time.monotonic() + MATCH_LIMIT_S  # for the line, whatever the patterns
        for pattern in patterns:
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                found = pattern.search(line, timeout=left, concurrent=True)
            except TimeoutError:
                # The rule's patterns end in one pass over any line: out of time there is a
                # busy machine, not a pattern to give up on (nor one to name in a failure).
                if own:
                    self.slow_matches += 1
                return
            if found:
                with contextlib.suppress(ValueError, IndexError, TypeError):  # group 1 unset
                    self.losses.append((time.time(), float(found.group(1))))
                    return

    def text(self) -> str:
        return "\n".join(self.tail)
