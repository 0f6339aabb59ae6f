"""The keeper of one run of the user's command: it starts the command, and nothing the command
starts outlives the run, whichever way it ends.

The trial (`loader_search.trial._command`) does not start the command itself: it starts this
file as a script (``python -I -S _keeper.py SETTINGS``, stdlib only, about 20 ms), which

- asks Linux to signal it (SIGTERM) when the worker that started it dies, even by SIGKILL
  (``PR_SET_PDEATHSIG``), and to become the parent of every orphan below it
  (``PR_SET_CHILD_SUBREAPER``): a script that forks, calls ``setsid`` and forks again (a
  daemon) leaves its process here, not with init, where no process-group or descendant scan
  would find it;
- starts the command in a session of its own, asking Linux to SIGKILL it should the keeper
  die (the command's loader workers notice their parent's death themselves);
- waits for the command; asked to stop (the trial has what it needs, or the worker died:
  `STOP`, `STOP_NOW`, SIGTERM) sends SIGTERM to every process below it, and SIGKILL after a
  grace period (at once for `STOP_NOW`);
- once the command ended, SIGKILLs every process still below it and reaps them all, then ends
  as the command ended (its exit code, or the signal that killed it).

A worker killed outright also leaves the trial's private folder: the keeper removes it once
its processes are gone (`remove_stale` does it on the next start where the keeper died too).

Every process a trial starts inherits its marker, ``LOADER_SEARCH_TRIAL_DIR=<its folder>``;
`marked` finds them in ``/proc`` whoever their parent is, so the trial's last step (and the
tests) can check that none is left.

This module imports nothing of loader_search and nothing beyond the standard library: it runs
with ``-I -S`` (no site-packages, no ``PYTHON*`` variables of the user's), and the trial
imports its helpers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

MARKER_ENV = "LOADER_SEARCH_TRIAL_DIR"
OWNER_FILE = "keeper.json"  # in the trial folder: who keeps it, and how the start went
FOLDER_PREFIX = "loader-search-command-"
START_FAILED = 127  # the keeper's exit code when the command could not start (as a shell's)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# The worker asks for a stop with a grace period (SIGUSR2) or at once (SIGUSR1). SIGTERM is
# the parent-death signal (or someone else's stop): a stop with the grace period, after which
# the folder is removed if the worker is gone.
STOP = signal.SIGUSR2
STOP_NOW = signal.SIGUSR1
_OUTSIDE = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_WATCHED = {signal.SIGCHLD, STOP, STOP_NOW, *_OUTSIDE}
_PARENT_EXIT_S = 2.0  # how long a dying worker's other threads may take to end
_REAP_LIMIT_S = 10.0  # a process in uninterruptible sleep may take this long to die


def main(argv: list[str]) -> int:
    settings = json.loads(argv[1])
    folder = Path(settings["folder"])
    parent, grace = int(settings["parent"]), float(settings["grace_s"])
    # Signals come as values from sigtimedwait below, never as handlers that interrupt work.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:  # the worker died before we asked: start nothing
        shutil.rmtree(folder, ignore_errors=True)
        return 1
    if settings.get("affinity"):
        with contextlib.suppress(OSError):  # before the command starts any thread
            os.sched_setaffinity(0, settings["affinity"])
    keeper = os.getpid()

    def as_our_child() -> None:  # runs in the command's process, before its program
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != keeper:
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())

    try:
        command = subprocess.Popen(
            settings["argv"], start_new_session=True, preexec_fn=as_our_child
        )
    except (OSError, ValueError) as exc:
        _write_owner(folder, {"start_error": _start_error(settings["argv"][0], exc)})
        return START_FAILED
    owner = {"pid": keeper, "started": _start_time(keeper), "command": command.pid}
    _write_owner(folder, {**owner, "worker": parent, "worker_started": _start_time(parent)})
    status, from_outside = _watch(command.pid, grace)
    end_below(keeper)
    if from_outside and _gone(parent):  # nobody else will: the folder's worker is gone
        shutil.rmtree(folder, ignore_errors=True)
    return _end_as(status)


def _watch(command: int, grace_s: float) -> tuple[int | None, bool]:
    """Wait for the command to end, stopping it when asked (SIGTERM to all below, SIGKILL
    after ``grace_s``; at once on `STOP_NOW`); its wait status (None if it never ended), and
    whether the stop came from outside (the worker's death, above all)."""
    status: int | None = None
    deadline: float | None = None
    from_outside = False
    while status is None:
        left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        got = signal.sigtimedwait(_WATCHED, left)
        status = _reap(command)
        if got is not None and got.si_signo == STOP_NOW:
            break
        if got is not None and got.si_signo in {STOP, *_OUTSIDE} and deadline is None:
            from_outside = got.si_signo != STOP
            deadline = time.monotonic() + grace_s
            _signal_below(os.getpid(), signal.SIGTERM)
        if deadline is not None and time.monotonic() >= deadline:
            break
    return status, from_outside


def _gone(parent: int) -> bool:
    """Whether the worker ``parent`` has died. The parent-death signal comes when the thread
    that started the keeper ends: with a killed worker's other threads still ending, the
    keeper is not yet re-parented, so this waits a little for that."""
    give_up = time.monotonic() + _PARENT_EXIT_S
    while time.monotonic() < give_up:
        state = _state(parent)
        if os.getppid() != parent or state is None or state in "ZX":
            return True
        time.sleep(0.02)
    return False


def _reap(command: int) -> int | None:
    """Reap every ended child (the command and adopted orphans); the command's wait status
    if it was among them."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == command:
            found = status


def end_below(root: int) -> None:
    """SIGKILL every process below ``root`` (this process: its children, orphans included,
    are reaped here) until none is left, or `_REAP_LIMIT_S` passed."""
    give_up = time.monotonic() + _REAP_LIMIT_S
    while time.monotonic() < give_up:
        if not _signal_below(root, signal.SIGKILL):
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            return
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        time.sleep(0.01)


def _signal_below(root: int, number: int) -> list[int]:
    """Send ``number`` to every process below ``root``; those it was sent to."""
    sent = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            os.kill(pid, number)
            sent.append(pid)
    return sent


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from ``/proc``; zombies left out)."""
    children: dict[int, list[int]] = {}
    for pid, ppid, state in _processes():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, Z, ...), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :][:1] or None


def _processes() -> Iterator[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process in ``/proc``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as file:
                text = file.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        with contextlib.suppress(IndexError, ValueError):
            yield int(entry.name), int(fields[1]), fields[0]


def marked(folder: str | os.PathLike[str]) -> list[int]:
    """The live processes that carry the trial marker of ``folder`` in their environment
    (those of other users this process may not read are not seen)."""
    needle = f"\0{MARKER_ENV}={os.fspath(folder)}\0".encode()
    found = []
    for pid, _, state in _processes():
        if state == "Z" or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                environ = b"\0" + file.read() + b"\0"  # every entry between two NULs
        except OSError:
            continue
        if needle in environ:
            found.append(pid)
    return found


def end_marked(folder: str | os.PathLike[str], limit_s: float = _REAP_LIMIT_S) -> list[int]:
    """SIGKILL every process that carries ``folder``'s marker until none is left (or
    ``limit_s`` passed); the pids killed."""
    killed: list[int] = []
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        found = marked(folder)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.01)
    return sorted(set(killed))


def remove_stale(parent: Path) -> list[Path]:
    """Remove the trial folders in ``parent`` (the temporary folder) whose keeper and worker
    are both gone: their marked processes are killed first. Only this user's own folders
    (never followed through a symlink); the folders removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(FOLDER_PREFIX):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
                owner = json.loads(Path(entry.path, OWNER_FILE).read_text())
            except (OSError, ValueError):
                continue
            if info.st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                continue
            # The worker cleans its own folder once its keeper has ended: only a folder whose
            # keeper and worker are both gone is stale.
            if not isinstance(owner, dict) or any(
                _alive(owner.get(pid), owner.get(started))
                for pid, started in (("pid", "started"), ("worker", "worker_started"))
            ):
                continue
            end_marked(entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def _alive(pid: object, started: object) -> bool:
    """Whether the process ``pid`` that started at ``started`` (clock ticks) still runs."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    return _start_time(pid) == started


def _start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode("ascii", "replace")
        return int(text[text.rfind(")") + 2 :].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _write_owner(folder: Path, data: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        temporary = folder / f".{OWNER_FILE}.tmp"
        temporary.write_text(json.dumps(data))
        temporary.replace(folder / OWNER_FILE)


def _start_error(program: str, exc: BaseException) -> str:
    """Why the command's program could not start, with the fix, in one line."""
    where = os.getcwd()
    if isinstance(exc, FileNotFoundError):
        if os.sep in program:
            return f"the command's program {program!r} does not exist (in {where!r})"
        return (
            f"the command's program {program!r} was not found on PATH; give its path, or"
            " activate the environment that has it before starting loader-search"
        )
    if isinstance(exc, PermissionError):
        if os.path.isdir(os.path.join(where, program)):
            return f"the command's program {program!r} is a folder, not a program"
        return (
            f"the command's program {program!r} is not executable: run it through its"
            f" interpreter (python {program}) or chmod +x it"
        )
    return f"the command's program {program!r} could not start: {exc}"


def _end_as(status: int | None) -> int:
    """End this process as the command ended (wait ``status``): its exit code, or killed by
    the same signal (SIGKILL when it never ended: it was killed here)."""
    if status is not None and os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    number = os.WTERMSIG(status) if status is not None else signal.SIGKILL
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {number})
    with contextlib.suppress(ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the keeper's own
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    return 128 + number


if __name__ == "__main__":
    sys.exit(main(sys.argv))
