"""A fresh Python interpreter kept across trials (``TrialJob.fresh``), each of which it forks.

The trial then runs in a new Python interpreter (`subprocess`, not a fork of the worker) that
imports torch and builds its own workload from the job's recipe, as a user's training script
does. It shares no memory with the worker: none of its copy-on-write pages, its allocator's
state or its heap, which after a study is the worker's. A `FreshHost` keeps that interpreter,
which trains nothing itself: for each trial it forks a child that trains exactly as a child
forked from the worker would (`loader_search.trial._child`), so its imports and build
(seconds, before `Ready`) are paid once, and every trial starts from the same state, a fresh
process's at its first batch, never what an earlier trial left behind. `FreshHost.prepare`
starts it ahead of its first trial, to build while the worker does other work. A study runs
its confirmation trials this way (``study.confirm_process = "fresh"``, the default;
`loader_search.study.work._worker`). The parent's watch, limits, pinning, process group and kill
(`loader_search.trial._supervisor`) apply as to a forked child; the job travels through the
pipe (`Start`), the workload does not, and CUDA may be initialised in the worker.

This module imports neither Optuna nor (at import time) torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, NoReturn

import psutil

from loader_search import interrupts
from loader_search.trial._child import pin_trial, train_and_report, warm_up
from loader_search.trial._job import TrialJob
from loader_search.trial._messages import Build, Built, Start, report_failure
from loader_search.trial._processes import (
    POLL_S,
    ChildProcess,
    FreshProcess,
    die_with_parent,
    exited,
    kill_tree,
    release_openmp_threads,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from loader_search.trial._job import WorkloadRecipe
    from loader_search.workloads import Workload

_START_WAIT_S = 60.0  # an idle fresh process checks this often that its parent lives
# A `FreshHost.prepare`d process has this long to import torch and build its workload.
BUILD_TIMEOUT_S = 300.0
# A fresh child's first command: this process's import path, then the trial's entry point.
_FRESH_BOOT = (
    "import sys; sys.path[:] = sys.argv[3:];"
    " from loader_search.trial._fresh import fresh_main;"
    " fresh_main(int(sys.argv[1]), int(sys.argv[2]))"
)


class FreshHost:
    """A fresh Python process kept across trials, each of which it forks (see the module's
    docstring).

    Started, a new Python interpreter that builds the workload from the job's recipe, for the
    first fresh trial `run_isolated` runs with this host; the next ones are forked from it
    while their recipe, CPUs and GPU are the same and every trial before ended well, leaving
    no process of its own behind. Anything else (a failure, a timeout, a kill, Ctrl-C, a
    multi-rank trial) ends it, and the next trial starts a new one. `prepare` starts it
    before any trial, building the workload meanwhile (`settle` waits for that). Between
    trials it idles; `close` it (or use it as a context manager) when done: it also dies
    with this process.

    Every trial starts from the same state, that of a user's training script at its first
    batch: the imports and the build done, the allocator and the heap as they left them, and
    no trial before it. (A process that trained one trial after another settled in a state
    of its own: its `num_workers=0` baseline took 2-8 page faults a batch where a user's
    loop takes a thousand, and its claims erred more; benchmarks/RESULTS.md.)
    """

    def __init__(self) -> None:
        self.process: FreshProcess | None = None
        self.conn: Connection | None = None
        self.key: tuple[object, ...] | None = None
        self.started = 0  # the processes started so far
        self.building = False  # `prepare`d: its `Built` not read yet

    def __enter__(self) -> FreshHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(
        self,
        recipe: WorkloadRecipe,
        device: str,
        cpus: Sequence[int] | None = None,
        gpu: int | None = None,
    ) -> None:
        """Start the process now, and have it build the workload of ``recipe`` for trials on
        ``device`` pinned to ``cpus`` and ``gpu``, while this process does other work: its
        imports and its build then cost no trial anything. `settle` waits for the build,
        and so does the first trial that takes the process; until then nothing is measured
        beside it (the build takes the CPUs a trial would)."""
        self.close()
        self.process, self.conn = start_fresh()
        self.key = _host_key(recipe, cpus, gpu)
        self.started += 1
        self.building = True
        with contextlib.suppress(OSError):  # it died: `settle` says so
            self.conn.send(Build(recipe, device, cpus, gpu))

    def settle(self, timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
        """Wait, at most ``timeout_s``, until a `prepare`d process has built its workload;
        None once it has (or when nothing was building), else why not (it failed, died or
        took longer than that): it is then ended, and the next fresh trial starts a process
        of its own, whose failure, if it fails again, is that trial's. Ctrl-C ends it too."""
        if not self.building:
            return None
        self.building = False
        process, conn = self.process, self.conn
        assert process is not None and conn is not None
        why = f"it did not build the workload within {timeout_s:g} s"
        deadline = time.perf_counter() + timeout_s
        try:
            while time.perf_counter() < deadline:
                interrupts.check()
                ready = wait([conn, process.sentinel], timeout=POLL_S)
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        why = "it ended before it had built the workload"
                        break
                    if isinstance(message, Built):
                        return None
                    why = f"building the workload failed: {getattr(message, 'failure', message)}"
                    break
                if process.sentinel in ready:
                    why = "it ended before it had built the workload"
                    break
        except BaseException:
            self.close()
            raise
        self.close()
        return why

    def take(self, job: TrialJob) -> tuple[FreshProcess, Connection]:
        """The process for ``job`` and its pipe: the kept (or `prepare`d) one if it suits,
        else a new one."""
        assert job.fresh is not None
        self.settle()
        key = _host_key(job.fresh, job.cpus, job.gpu)
        if self.process is not None and (key != self.key or exited(self.process)):
            self.close()
        if self.process is None or self.conn is None:
            self.process, self.conn = start_fresh()
            self.key = key
            self.started += 1
        return self.process, self.conn

    def close(self) -> None:
        """End the kept process, if any (its tree killed and reaped)."""
        process, conn = self.process, self.conn
        self.process = self.conn = self.key = None
        self.building = False
        if process is not None:
            if process.exitcode is None:  # not reaped yet: its pid is still its own
                kill_tree(process)
            process.close()
        if conn is not None:
            conn.close()


def _host_key(
    recipe: WorkloadRecipe, cpus: Sequence[int] | None, gpu: int | None
) -> tuple[object, ...]:
    """What a kept fresh process is for: one recipe, pinned to these CPUs and GPU."""
    return (recipe.spec, sorted(recipe.options.items()), cpus, gpu)


def start_fresh() -> tuple[FreshProcess, Connection]:
    """Start a fresh Python process that runs `fresh_main` on one end of a pipe; the other."""
    ours, theirs = multiprocessing.Pipe(duplex=True)
    try:
        boot = [sys.executable, "-c", _FRESH_BOOT, str(theirs.fileno()), str(os.getpid())]
        popen = subprocess.Popen(
            [*boot, *sys.path],  # this process's import path, for the workload's modules
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # its own group: terminal Ctrl-C reaches us only
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return FreshProcess(popen), ours


def fresh_main(fd: int, parent_pid: int) -> None:
    """A fresh process (`_FRESH_BOOT`, kept by a `FreshHost`): for each `Start` on the pipe
    ``fd``, pin, build the workload (for the first trial only, unless a `Build` asked for it
    before: then answered `Built`), and fork a child that trains (`_fresh_trial`) and talks
    to the parent through the same pipe; wait for it.

    The process ends as its trial's child did when that child failed (its exit code) or was
    killed (by the same signal, so that the parent classifies the end as it would a forked
    child's); otherwise after a `Start` marked ``last``, when the pipe closes, or when its
    parent is gone."""
    die_with_parent(parent_pid)  # its group is its own already (a new session)
    conn = Connection(fd)
    workload: Workload | None = None  # built for the first trial (one recipe per process)
    host_pid = os.getpid()  # its trials' parent
    status = 0
    while status == 0:
        try:
            while not conn.poll(_START_WAIT_S):  # idle between trials
                if os.getppid() != parent_pid:
                    os._exit(1)
            start: Start | Build = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe, or is gone
            break
        try:
            device = pin_trial(start.cpus, start.gpu, start.device)  # before torch starts threads
            if workload is None:  # a `FreshHost` gives a process one recipe only
                from loader_search.workloads import load_workload

                workload = load_workload(start.recipe.spec, start.recipe.options)
                warm_up(workload)
            if isinstance(start, Build):  # built ahead of the first trial: idle until it
                conn.send(Built())
                continue
            release_openmp_threads()  # see the module's docstring: forking after torch ran
            pid = os.fork()
        except BaseException as exc:  # its build or its fork failed: it ends, exit code 1
            report_failure(conn, exc)
        if pid == 0:
            _fresh_trial(conn, host_pid, start, workload, device)  # never returns
        _, status = os.waitpid(pid, 0)
        if start.last:
            break
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    _end_as(status)


def _fresh_trial(
    conn: Connection, host_pid: int, start: Start, workload: Workload, device: str
) -> NoReturn:
    """A trial's child of a fresh process: announce, train, send the result or the classified
    failure, and exit: 0 after a result, 1 after a failure (the fresh process then ends)."""
    die_with_parent(host_pid)
    try:
        job = dataclasses.replace(start.job, workload=workload, device=device)
        message = train_and_report(conn, job, device)
        gc.collect()  # a loader held by a reference cycle lets its workers go now
    except BaseException as exc:  # everything is reported; the process ends right after
        report_failure(conn, exc)
    conn.send(message)
    sys.stdout.flush()
    sys.stderr.flush()
    # As a forked child ends: no finaliser runs (loader workers are shut down already).
    os._exit(0)


def _end_as(status: int) -> NoReturn:
    """End this process as the wait ``status`` says its child ended: killed by the same
    signal (no core dump), or with the same exit code."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL cannot be handled
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal whose default is not to end the process
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def children_gone(process: ChildProcess, timeout_s: float) -> bool:
    """Whether ``process`` lives with no child left within ``timeout_s``: a kept fresh
    process reaps its trial's child once that sent its result and ended (the child's loader
    workers die with it: `loader_search.trial._loader.WorkerStart`)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            if not psutil.Process(process.pid).children():
                return not exited(process)
        except psutil.Error:
            return False
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.005)
