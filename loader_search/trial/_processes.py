"""The process tree of a trial, seen from the process that started it: a child asking to die
with its parent, OpenMP's threads released before a fork, a fresh (not forked) trial process
seen as a forked one is, the tree killed and reaped, its memory (PSS) read, a loader
worker's death found among its zombies, and the kernel's count of out-of-memory kills."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from multiprocessing.connection import wait
from typing import Protocol

import psutil

from loader_search.trial._failures import TrialFailure, classify_exception

# Read by torch.cuda.is_available() at call time: ask NVML, leave the CUDA driver untouched (a
# process that forks trials must never initialise CUDA; see loader_search.trial._supervisor).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

POLL_S = 0.1  # a watching process's wake-up interval while nothing arrives


class ChildProcess(Protocol):
    """What the supervisor uses of a trial's process: a `multiprocessing` one (forked) or a
    `FreshProcess`."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


class FreshProcess:
    """A trial process started by `subprocess.Popen`, with the parts of a `multiprocessing`
    process the supervisor uses: ``sentinel`` (readable once it ended), ``exitcode`` (minus
    the signal that killed it) and ``join``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid: int | None = popen.pid
        self._keep: int | None = None
        try:
            self.sentinel = os.pidfd_open(popen.pid)  # Linux 5.3+
        except (AttributeError, OSError):
            # An older kernel: a pipe that never becomes readable; the supervisor's polls
            # (`exited`) see the end instead, within their interval.
            self.sentinel, self._keep = os.pipe()

    @property
    def exitcode(self) -> int | None:
        # Once joined; never polled, which would reap it before `kill_tree` kills its group.
        return self.popen.returncode

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def close(self) -> None:
        """Release the sentinel (once the process is reaped)."""
        for fd in (self.sentinel, self._keep):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.sentinel, self._keep = -1, None


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that forked it dies (PR_SET_PDEATHSIG):
    a parent killed outright must not leave a trial training. Loader workers ask the same of
    the trial (`loader_search.trial._loader.WorkerStart`): torch's own check, between
    batches, misses a worker blocked in the dataset."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def release_openmp_threads() -> None:
    """Free the forking thread's OpenMP worker threads before a fork.

    GNU libgomp keeps a pool of threads per thread that ran a parallel region; a forked child
    inherits the pool's bookkeeping but not its threads, and its first parallel op waits for
    them forever. ``omp_pause_resource_all(omp_pause_hard)`` (OpenMP 5.0) joins them; the
    parent's next parallel op simply starts new ones. A no-op where libgomp is not loaded
    (Intel's and LLVM's OpenMP handle fork themselves).
    """
    try:
        libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # type: ignore[attr-defined]
        pause = libgomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return
    pause.argtypes = [ctypes.c_int]
    pause(2)  # omp_pause_hard


def kill_tree(process: ChildProcess) -> None:
    """SIGKILL the child's process group and every descendant of the child, then reap all.

    Descendants are listed first, while the child still holds them: once it dies they are
    re-parented and can no longer be found. The group catches workers forked meanwhile; the
    group id cannot be reused while the child is an unreaped zombie, so it is killed before
    the child is joined. A child in the parent's own group (it never ran) is killed alone.
    """
    pid = process.pid
    if pid is None:
        return
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:  # already reaped: nothing of the group is left to find by its id
        pass
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    process.join()
    psutil.wait_procs(descendants, timeout=5)


def exited(process: ChildProcess) -> bool:
    """Whether the child has ended, asked without reaping it (see `kill_tree`).

    Its sentinel and its end of the pipe do not say so by themselves: the loader workers it
    forked inherited both, and a worker blocked in the dataset kept them open, so that a crash
    of the training process was seen only at the trial timeout (or after 5 s, when an idle
    worker noticed its parent was gone)."""
    pid: int = process.pid  # type: ignore[assignment]
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return True
    return found is not None


def wait_for_exit(process: ChildProcess, timeout_s: float, poll_s: float) -> None:
    """Wait up to ``timeout_s`` for the child to end by itself, without reaping it."""
    deadline = time.perf_counter() + timeout_s
    while not exited(process):
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        wait([process.sentinel], timeout=min(poll_s, left))


def dead_worker_failure(pid: int) -> TrialFailure | None:
    """The failure of a loader worker under the trial process ``pid`` that has died and is not
    yet reaped (a zombie): killed by a signal other than SIGTERM (which torch sends to the
    workers it shuts down), or ended with an error code. None if there is none.

    Torch reports a worker's death in the training process by raising from its SIGCHLD
    handler, wherever the main thread happens to be; library code that swallows exceptions
    there (torch's own profiler import does) loses it, and the training then waits 5 s for
    torch's next check. A shorter trial timeout used to record such a trial as a ``timeout``
    (2 of 8 runs with 4 workers and a 1 s timeout). The failure is worded as torch words it,
    so it is classified as if torch had raised it (SIGKILL is then ``host_oom``, SIGBUS a
    full /dev/shm).
    """
    try:
        # Recursive: a fresh process's trial is its child, and the workers are that one's.
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        status = _zombie_status(child.pid)
        if status is None or status == 0:
            continue
        number = status & 0x7F
        if number == signal.SIGTERM:
            continue
        if number:
            text = f"is killed by signal: {_strsignal(number)}."
        else:
            text = f"exited unexpectedly with exit code {status >> 8}."
        return classify_exception(RuntimeError(f"DataLoader worker (pid {child.pid}) {text}"))
    return None


def _zombie_status(pid: int) -> int | None:
    """The wait status of ``pid`` if it is a zombie (``exit_code``, field 52 of
    ``/proc/PID/stat``), else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # from field 3, the state
    if len(fields) < 50 or fields[0] != "Z":
        return None
    try:
        return int(fields[49])
    except ValueError:
        return None


def _strsignal(number: int) -> str:
    try:
        return signal.strsignal(number) or f"signal {number}"
    except ValueError:
        return f"signal {number}"


def tree_pss(pid: int, include_root: bool = True) -> int:
    """Proportional set size of ``pid`` (unless not ``include_root``) and its descendants:
    pages shared between them (the parent's, inherited on fork; shared-memory batches) count
    once, split between mappers."""
    total = 0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)][0 if include_root else 1 :]
    except psutil.Error:
        return 0
    for proc in processes:
        try:
            info = proc.memory_full_info()
            total += getattr(info, "pss", info.rss)
        except psutil.Error:  # exited between listing and reading
            continue
    return total


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this process's
    memory cgroup (``oom_kill`` in cgroup v2's ``memory.events``, v1's
    ``memory.oom_control``), else on the whole machine (``/proc/vmstat``); None where no
    count can be read. A count that rose during a trial is the evidence that a SIGKILL in it
    was that killer's: a SIGKILL alone says nothing of who sent it."""
    v1: list[str] = []
    v2: list[str] = []
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as file:
            for line in file:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
                elif "memory" in controllers.split(","):
                    v1.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    except (OSError, ValueError):
        pass
    # The cgroup's own folder, else the mount's root: a container sees its cgroup there.
    v2.append("/sys/fs/cgroup/memory.events")
    v1.append("/sys/fs/cgroup/memory/memory.oom_control")
    for place in [*v2, *v1, "/proc/vmstat"]:
        count = _oom_kill_line(place)
        if count is not None:
            return count
    return None


def _oom_kill_line(path: str) -> int | None:
    """The number on the ``oom_kill`` line of ``path``, or None."""
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            for line in file:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
