"""A command's process group, seen from the trial that started it: stopped whole (SIGTERM,
then SIGKILL after a grace period), with every process that left the group and outlived its
parent still found (each one seen while it ran is remembered by pid and start time)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil

STOP_GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL


def remember(pid: int, known: dict[int, float]) -> None:
    """Add ``pid``'s descendants to ``known`` (pid: start time)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                known.setdefault(child.pid, child.create_time())


def stop_known(known: dict[int, float]) -> None:
    """SIGKILL every process in ``known`` still alive (the same process: its start time)."""
    left = []
    for pid, created in known.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.kill()
                left.append(proc)
    psutil.wait_procs(left, timeout=STOP_GRACE_S)


def wait(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether ``process`` ended within ``timeout_s`` (it is reaped then)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop the command's whole group and every descendant that left it: SIGTERM, then
    SIGKILL after ``grace_s``; reap the command."""
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    pgid = process.pid  # its own group: started with start_new_session
    if grace_s > 0:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGTERM)
        wait(process, grace_s)
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    psutil.wait_procs(descendants, timeout=STOP_GRACE_S)
