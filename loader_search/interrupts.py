"""Ctrl-C and SIGTERM while trials run: stop at a safe point, never lose the request.

A KeyboardInterrupt raised straight from a signal handler lands wherever the main thread
happens to be, including inside a finalizer or a weakref callback (SQLAlchemy's class
registry runs them while talking to the database), where Python prints "Exception ignored"
and drops it: the worker would go on training. So while the trial loop runs (`deferred`),
the handler only records the request (`request_stop`), and the loop raises KeyboardInterrupt
at its safe points (`check`): every poll of the trial supervisor (0.1 s), every wait for a
lock or a retry, and between the steps of a trial. Outside the loop (building the workload,
opening the storage) the handler raises at once, as Python's default does, except inside an
import: a KeyboardInterrupt raised there can surface as another error (seen: a `TypeError`
from the import of `_ssl`) or, inside torch's native start-up, abort the process
(SIGABRT). There the request waits for the import to end, looked at again every 50 ms
(`SIGALRM`).

The command line installs `on_signal` for both signals as its very first step, before its
heavy imports: from then on Ctrl-C exits 130 and SIGTERM 143 (`exit_code`), with one line.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOP_REQUESTED = threading.Event()
_deferred = False  # the main thread is in the trial loop


_received: list[int] = []  # the signals that asked to stop, not yet told in an exit code
_interrupted: list[int] = []  # the trials a stop ended, recorded as interrupted, not yet told


_RECHECK_S = 0.05  # how often a stop request that came inside an import looks again


def on_signal(signum: int, frame: FrameType | None) -> None:
    """The SIGINT and SIGTERM handler: remembers which signal came, for `exit_code`, then
    `request_stop`; inside an import, once the import is over (see the module docstring)."""
    _received.append(signum)
    if not _deferred and _importing(frame) and hasattr(signal, "setitimer"):  # POSIX
        STOP_REQUESTED.set()
        _look_again()
        return
    request_stop()


def _look_again() -> None:
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, _RECHECK_S)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    """A stop request that came inside an import, looked at again: acted on now, unless the
    import still runs or the request was told already (`exit_code`)."""
    if not STOP_REQUESTED.is_set() or not _received:
        return
    if _importing(frame):
        _look_again()
        return
    request_stop()


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread, stopped at ``frame``, is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def exit_code() -> int:
    """The exit code of a command a stop request ended: 128 + the signal's number (130 for
    Ctrl-C, 143 for SIGTERM), as a shell reports a process that signal killed; 130 when no
    signal came (a KeyboardInterrupt of another origin). Forgets the signal: a process that
    runs several commands (tests, notebooks) starts the next one afresh."""
    number = _received[0] if _received else signal.SIGINT
    _received.clear()
    return 128 + number


def trial_interrupted(number: int) -> None:
    """Remember that trial ``number``, running when the stop came, is recorded as
    interrupted: the command's last line names it (`interrupted_trials`)."""
    _interrupted.append(number)


def interrupted_trials() -> list[int]:
    """The trials a stop ended and recorded as interrupted (`trial_interrupted`); forgotten
    once told, as the signal is by `exit_code`."""
    told = list(_interrupted)
    _interrupted.clear()
    return told


def pending_signal() -> str | None:
    """The name of the signal that asked to stop and no exit code has told yet (SIGTERM)."""
    return signal.Signals(_received[0]).name if _received else None


def request_stop() -> None:
    """For a SIGINT/SIGTERM handler (see the module docstring)."""
    STOP_REQUESTED.set()
    if not _deferred:
        raise KeyboardInterrupt


def check() -> None:
    """A safe point: raise KeyboardInterrupt if a stop was requested."""
    if STOP_REQUESTED.is_set():
        raise KeyboardInterrupt


def sleep(seconds: float) -> None:
    """``time.sleep`` that ends early, with KeyboardInterrupt, when a stop is requested."""
    if STOP_REQUESTED.wait(seconds):
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within, a stop request is acted on at the safe points only."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous
