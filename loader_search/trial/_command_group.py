"""A run of the user's command, seen from the trial that started it: started under its keeper
(`loader_search.trial._keeper`), stopped whole (SIGTERM, then SIGKILL after a grace period),
and checked afterwards: no process that carries the trial's marker is left, whoever its
parent became."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from loader_search.trial._keeper import OWNER_FILE, STOP, STOP_NOW, end_marked

KEEPER = Path(__file__).with_name("_keeper.py")
STOP_GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL
_KEEPER_GRACE_S = 5.0  # a keeper told to stop ends within its grace plus this


def start_kept(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    folder: Path,
    stdout: int,
    cpus: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` under a keeper (its handle is the keeper's process): in a session of its
    own, never through a shell, in ``cwd``, with ``env``, its output and errors into
    ``stdout``, pinned to ``cpus``. ``OSError`` when ``cwd`` is no folder."""
    settings = {
        "argv": list(argv),
        "folder": str(folder),
        "parent": os.getpid(),
        "grace_s": STOP_GRACE_S,
        "affinity": sorted(cpus) if cpus else None,
    }
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(KEEPER), json.dumps(settings)],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a session of its own: a Ctrl-C at the terminal is ours only
    )


def start_error(folder: Path) -> str | None:
    """Why the command could not start, as the keeper wrote it (None if it started)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    error = owner.get("start_error") if isinstance(owner, dict) else None
    return str(error) if error else None


def wait(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether ``process`` ended within ``timeout_s`` (it is reaped then)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop_kept(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop the command and everything it started: SIGTERM, then SIGKILL after ``grace_s``
    (the keeper's own grace, `STOP_GRACE_S`, where ``grace_s`` > 0); reap the keeper. A keeper
    that does not end in time is killed: the command dies with it (its parent-death signal),
    and `finish` finds the rest by their marker."""
    with contextlib.suppress(OSError):
        process.send_signal(STOP if grace_s > 0 else STOP_NOW)
    if not wait(process, (STOP_GRACE_S if grace_s > 0 else 0.0) + _KEEPER_GRACE_S):
        with contextlib.suppress(OSError):
            process.kill()
        wait(process, _KEEPER_GRACE_S)


def finish(process: subprocess.Popen[bytes], folder: Path) -> list[int]:
    """The run's last step: its keeper stopped and reaped, and every process that still
    carries the trial's marker killed; those pids (none, unless the keeper was killed)."""
    if process.returncode is None:
        stop_kept(process, 0.0)
    return end_marked(folder)
