"""Trial isolation: every trial trains in a fresh child process; the parent only records.

Why a child per trial: GPU memory is truly released when the process ends (the CUDA caching
allocator never hands it back otherwise), peak memory is measured from a clean slate, a loader
worker that leaks or hangs dies with its trial, and a crash, an out-of-memory kill or a hang
costs one trial instead of the study. Every way a trial can end is classified as a
`TrialFailure` (see `loader_search.trial._failures`) and the study goes on.

How: the child is *forked*, so the workload the parent already built (datasets, model factory)
is inherited at no cost and torch is not imported again. Forking a process that runs PyTorch
has three traps, each handled here:

- CUDA cannot be used in a child forked from a process that initialised it. The parent must
  never touch CUDA; importing this module sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set)
  so that ``torch.cuda.is_available()`` in the parent asks NVML instead of initialising the
  driver. ``torch.cuda.get_device_name`` and the like still initialise it: the parent must not
  call them (`run_isolated` refuses to fork once torch reports CUDA initialised).
- GNU OpenMP (the libgomp torch's Linux wheels use) is not fork-safe: a child forked after the
  parent ran a multi-threaded torch op hangs in its first parallel op (measured: every time,
  with 2 threads). `run_isolated` releases the forking thread's OpenMP threads just before the
  fork (``omp_pause_resource_all``), so the child starts a fresh team.
- The child inherits the parent's open database connections. It ends with ``os._exit`` (as a
  multiprocessing fork child does), so no finaliser ever closes or talks on them.

The child runs in a process group of its own: Ctrl-C in a terminal reaches only the parent,
which then kills the whole group (the child and its loader workers) and re-raises. The child
also asks the kernel to kill it should the parent die (``PR_SET_PDEATHSIG``), and its loader
workers ask the same of the child (`loader_search.trial._loader.WorkerStart`). The child closes
its copies of the parent's host lock (`close_inherited_locks`) before it forks any worker: a
worker that outlived a killed run kept the lock, and the machine, for good.

**A fresh process instead** (``TrialJob.fresh``): the trial then runs in a new Python
interpreter (`subprocess`, not a fork of this process) that imports torch and builds its own
workload from the job's recipe, as a user's training script does. It shares no memory with
this process: none of its copy-on-write pages, its allocator's state or its heap, which after
a study is the worker's. A `FreshHost` keeps that interpreter, which trains nothing itself:
for each trial it forks a child that trains exactly as a child forked from here would, so its
imports and build (seconds, before `Ready`) are paid once, and every trial starts from the
same state, a fresh process's at its first batch, never what an earlier trial left behind.
`FreshHost.prepare` starts it ahead of its first trial, to build while this process does
other work. A study runs its confirmation trials this way (``study.confirm_process =
"fresh"``, the default; `loader_search.study._worker`). The same watch, limits, pinning,
process group and kill apply; the job travels through the pipe (`Start`), the workload does
not, and CUDA may be initialised here.

Where fork is not available (not Linux) trials run in-process, classified the same way, but
without the timeout, the memory limit, CPU pinning or GPU pinning.

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
import warnings
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, NoReturn

import psutil

from loader_search import interrupts
from loader_search._inherited import close_inherited_locks
from loader_search.params import TrialLimits
from loader_search.trial._failures import (
    HOST_OOM,
    TIMEOUT,
    TrialFailure,
    TrialOutcome,
    classify_exception,
    classify_exit,
    failure_for,
)
from loader_search.trial._job import TrialJob, WorkloadRecipe
from loader_search.trial._messages import (
    Build,
    Built,
    Ended,
    Failed,
    Progress,
    Ready,
    Start,
    Trained,
)
from loader_search.trial._processes import (
    ChildProcess,
    FreshProcess,
    dead_worker_failure,
    die_with_parent,
    exited,
    gib,
    kill_tree,
    release_openmp_threads,
    tree_pss,
    wait_for_exit,
)

NO_LIMITS = TrialLimits()  # the defaults: a 600 s progress timeout, no memory limit

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.context import ForkProcess

    from loader_search.workloads import Workload

# Read by torch.cuda.is_available() at call time: ask NVML, leave the CUDA driver untouched.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

PROGRESS_INTERVAL_S = 0.5  # the child reports progress at most this often
MEMORY_POLL_S = 0.5  # reading PSS costs ~4 ms per process: not more often than this
_POLL_S = 0.1  # the parent's wake-up interval while nothing arrives
_EXIT_GRACE_S = 10.0  # a child that sent its result gets this long to exit by itself
_START_WAIT_S = 60.0  # an idle fresh process checks this often that its parent lives
# A `FreshHost.prepare`d process has this long to import torch and build its workload.
BUILD_TIMEOUT_S = 300.0
# A fresh child's first command: this process's import path, then the trial's entry point.
_FRESH_BOOT = (
    "import sys; sys.path[:] = sys.argv[3:];"
    " from loader_search.trial._supervisor import fresh_main;"
    " fresh_main(int(sys.argv[1]), int(sys.argv[2]))"
)


def can_isolate() -> bool:
    """Whether trials run in child processes here (Linux, where fork is available and safe
    enough; macOS has fork, but system libraries there are not fork-safe)."""
    return sys.platform.startswith("linux") and ("fork" in multiprocessing.get_all_start_methods())


def run_isolated(
    job: TrialJob, *, limits: TrialLimits = NO_LIMITS, host: FreshHost | None = None
) -> TrialOutcome:
    """Run `loader_search.trial._run.run_trial` for ``job`` (with its ``plan``) in a forked
    child process and classify its end.

    ``job.cpus`` pins the child (and so its loader workers) to those CPUs; ``job.gpu`` makes
    only that GPU visible to the child (``CUDA_VISIBLE_DEVICES``), which then trains on
    ``cuda:0``; ``gpu`` needs a CUDA ``device``. Both are set in the child before any CUDA use,
    and checked here before anything is forked (``ValueError``).

    Returns a `TrialOutcome` for every way the trial can end, including a crash, a kill by the
    out-of-memory killer, ``limits.trial_timeout_s`` without progress and
    ``limits.memory_limit_bytes`` exceeded. The parent is unaffected and can run the next
    trial at once.

    Ctrl-C: a ``KeyboardInterrupt`` in the parent while it waits kills the child's whole
    process tree, reaps it, and is re-raised: nothing of the trial is left running, and the
    caller records the trial as ``interrupted``. (A child that alone gets SIGINT ends with a
    failure of reason ``interrupted`` instead; nothing is raised.)

    With ``job.fresh`` the child is a fresh Python process that builds its own workload from
    that recipe (see the module's docstring); ``job.workload`` is then not used there. With a
    ``host``, that process is kept for the next fresh trials run with the same ``host``
    (`FreshHost`); without one, it ends with the trial.

    Where fork is unavailable (`can_isolate` is False), the trial runs in this process with the
    same classification but without limits or pinning (``isolated=False`` in the outcome).
    """
    job = _checked(job)
    if not can_isolate():
        if job.gpu is not None:
            job = dataclasses.replace(job, device=f"cuda:{job.gpu}")
        return _run_in_process(job)
    if job.fresh is not None:
        if host is not None:
            return _Supervisor(limits).run_fresh(job, host, keep=True)
        with FreshHost() as once:
            return _Supervisor(limits).run_fresh(job, once, keep=False)
    _refuse_if_cuda_initialised()
    _warm_up(job.workload)
    return _Supervisor(limits).run(job)


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
        self.process, self.conn = _start_fresh()
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
                ready = wait([conn, process.sentinel], timeout=_POLL_S)
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
            self.process, self.conn = _start_fresh()
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


def _checked(job: TrialJob) -> TrialJob:
    """``job`` with its device as text and its CPUs sorted, once its pinning is possible."""
    device = str(job.device)
    if job.gpu is not None and not device.startswith("cuda"):
        raise ValueError(f"gpu={job.gpu} needs a CUDA device, got {device!r}")
    cpus = job.cpus
    if cpus is not None:
        cpus = sorted(set(cpus))
        allowed = _allowed_cpus()
        if not cpus or not set(cpus) <= allowed:
            raise ValueError(
                f"cpus {cpus}: must be a non-empty subset of the CPUs this process may use,"
                f" {sorted(allowed)}"
            )
    return dataclasses.replace(job, device=device, cpus=cpus)


_WARM: dict[int, Workload] = {}  # holds each workload, so that its id() is never reused


def _warm_up(workload: Workload) -> None:
    """Build the workload's optimizer once in this (parent) process, on a dummy parameter.

    Whatever a trial imports lazily is then inherited by every forked child instead of being
    imported again in each: torch's first optimizer imports ``torch._dynamo``, about 1 s on a
    2-core CPU, which every trial of a study paid before this (a quarter of a quickstart
    trial). The model is not built here: user code that touched CUDA in the parent would
    break every forked trial. A failure is left to the trial, which classifies it.
    """
    if id(workload) in _WARM:
        return
    _WARM[id(workload)] = workload
    import torch

    with contextlib.suppress(Exception):
        workload.make_optimizer([torch.nn.Parameter(torch.zeros(1))], 0.01)


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: only checked for range
        return set(range(os.cpu_count() or 1))


def _run_in_process(job: TrialJob) -> TrialOutcome:
    from loader_search.trial._run import run_trial

    started = time.perf_counter()
    try:
        result = run_trial(job.workload, job.params, job.settings, job.device, plan=job.plan)
    except Exception as exc:  # KeyboardInterrupt propagates, as with isolation
        return TrialOutcome(
            None, classify_exception(exc), time.perf_counter() - started, 0.0, isolated=False
        )
    return TrialOutcome(result, None, time.perf_counter() - started, 0.0, isolated=False)


def _refuse_if_cuda_initialised() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is initialised in this process, so a forked trial cannot use it: the"
            " parent must not call CUDA (e.g. torch.cuda.get_device_name); query the GPU in"
            " the child or through nvidia-smi"
        )


def _start_fresh() -> tuple[FreshProcess, Connection]:
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


class _Supervisor:
    """The parent's side of one isolated trial: start, watch, kill, classify."""

    def __init__(self, limits: TrialLimits) -> None:
        self.limits = limits
        self.killed: TrialFailure | None = None  # why the parent killed the trial
        self.reaped = False

    def run(self, job: TrialJob) -> TrialOutcome:
        """Fork a child for ``job``, watch it, and reap it."""
        started = time.perf_counter()
        process, reader = self._fork(job)
        try:
            return self._watch(process, reader, started)
        except BaseException:  # KeyboardInterrupt above all: nothing may be left running
            self._reap(process)
            raise
        finally:
            reader.close()

    def run_fresh(self, job: TrialJob, host: FreshHost, *, keep: bool) -> TrialOutcome:
        """Run ``job`` in ``host``'s fresh process and watch it; with ``keep``, the process
        is kept if the trial ended well and left nothing running, else it ends."""
        started = time.perf_counter()
        # A multi-rank trial's process group (its sibling ranks, torch.distributed) is not
        # reused: it trains in the kept process's place and ends with it.
        keep = keep and job.settings.ranks == 1
        process, conn = host.take(job)
        kept = False
        try:
            with contextlib.suppress(OSError):  # it died: the watch sees how
                conn.send(
                    Start(
                        job.fresh,  # type: ignore[arg-type]
                        job.params,
                        job.settings,
                        str(job.device),
                        job.plan,
                        job.cpus,
                        job.gpu,
                        last=not keep,
                    )
                )
            outcome = self._watch(process, conn, started, keep=keep)
            kept = outcome.exitcode is None
            return outcome
        except BaseException:
            self._reap(process)
            raise
        finally:
            if not kept:
                host.close()

    def _fork(self, job: TrialJob) -> tuple[ForkProcess, Connection]:
        # Imported here, once: every child inherits the module instead of importing it.
        import loader_search.trial._run  # noqa: F401

        context = multiprocessing.get_context("fork")
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_child_main,
            args=(writer, os.getpid(), job),
            name="loader-search-trial",
        )
        release_openmp_threads()
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns about fork in a multi-threaded process. The child only
                # trains: it never touches the database (whose pool locks the study layer's
                # database heartbeat and sweeper threads take), CPython re-creates its import
                # and logging locks in the child, and OpenMP's threads were released above. A
                # lock held by a parent thread that the training still needs (a print racing
                # the reporter's, say) would end in the trial's timeout, not a hang.
                warnings.filterwarnings("ignore", ".*fork.*", DeprecationWarning)
                process.start()
            # Also set from here: the group must exist before any kill, whoever runs first.
            with contextlib.suppress(OSError):
                os.setpgid(process.pid, process.pid)  # type: ignore[arg-type]
        except BaseException:
            self._reap(process)
            reader.close()
            raise
        finally:
            writer.close()
        return process, reader

    def _watch(
        self, process: ChildProcess, reader: Connection, started: float, keep: bool = False
    ) -> TrialOutcome:
        """Watch the trial until it ends; with ``keep``, a process that sent `Trained` and
        has no child left is left running for the next trial (``exitcode`` None)."""
        limits = self.limits
        startup_s = 0.0
        last_progress = started
        next_memory_check = started
        sent_at: float | None = None
        received_at = 0.0
        message: Ended | None = None
        while message is None:
            interrupts.check()  # Ctrl-C, at a safe point (see loader_search.interrupts)
            ready = wait([reader, process.sentinel], timeout=_POLL_S)
            now = time.perf_counter()
            if reader in ready:
                try:
                    received = reader.recv()
                except EOFError:  # the child closed the pipe: it is exiting or dead
                    received = None
                if received is None:
                    break
                if isinstance(received, Ready):
                    startup_s = now - started
                elif isinstance(received, (Trained, Failed)):
                    message, sent_at, received_at = received, received.sent_at, now
                    break
                last_progress = now
                continue
            if process.sentinel in ready or exited(process):
                break
            if now - last_progress > limits.trial_timeout_s:
                self._kill_silent(process, limits.trial_timeout_s)
                break
            if limits.memory_limit_bytes is not None and now >= next_memory_check:
                next_memory_check = now + MEMORY_POLL_S
                used = tree_pss(process.pid)  # type: ignore[arg-type]
                if used > limits.memory_limit_bytes:
                    self._kill(
                        process,
                        failure_for(
                            HOST_OOM,
                            f"the trial used {gib(used)} of host memory (PSS of the training"
                            f" process and its loader workers), above the limit of"
                            f" {gib(limits.memory_limit_bytes)}; the trial was killed",
                        ),
                    )
                    break
        if message is None and self.killed is None:
            # The child has ended. What it sent before is still in the pipe, but its loader
            # workers may hold the pipe open: they die first, so that a message cut short by
            # the child's death reads as the end of the pipe instead of blocking.
            self._reap(process)
        while message is None and self.killed is None and reader.poll():
            # What the child sent before it exited (the exit and the pipe race).
            try:
                received = reader.recv()
            except EOFError:
                break
            if isinstance(received, (Trained, Failed)):
                message, sent_at, received_at = received, received.sent_at, time.perf_counter()
        kept = keep and isinstance(message, Trained) and _children_gone(process, _EXIT_GRACE_S)
        if not kept:
            if message is not None:
                wait_for_exit(process, _EXIT_GRACE_S, _POLL_S)
            if received_at == 0.0:
                received_at = time.perf_counter()
            # Leftovers (a worker the child did not shut down) die with the trial.
            self._reap(process)
        ended = time.perf_counter()
        outcome_failure: TrialFailure | None
        result = None
        if isinstance(message, Trained):
            result, outcome_failure = message.result, None
        elif message is not None:
            outcome_failure = message.failure
        elif self.killed is not None:
            outcome_failure = self.killed
        else:
            outcome_failure = classify_exit(process.exitcode)
        return TrialOutcome(
            result=result,
            failure=outcome_failure,
            wall_s=ended - started,
            startup_s=startup_s,
            transfer_s=max(0.0, received_at - sent_at) if sent_at is not None else 0.0,
            teardown_s=ended - received_at,
            exitcode=None if kept else process.exitcode,
        )

    def _kill_silent(self, process: ChildProcess, timeout_s: float) -> None:
        """Kill a trial that made no progress for ``timeout_s``: a timeout, unless a loader
        worker of it has died, which is then what stopped the training (see
        `loader_search.trial._processes.dead_worker_failure`)."""
        dead = dead_worker_failure(process.pid)  # type: ignore[arg-type]
        self._kill(
            process,
            dead
            or failure_for(
                TIMEOUT, f"no training progress for {timeout_s:g} s; the trial was killed"
            ),
        )

    def _kill(self, process: ChildProcess, failure: TrialFailure) -> None:
        self.killed = failure
        self._reap(process)

    def _reap(self, process: ChildProcess) -> None:
        """Kill what is left of the trial and reap it, once: after the child is reaped its pid
        (and process group id) may belong to someone else."""
        if not self.reaped and process.pid is not None:
            self.reaped = True
            kill_tree(process)


def _child_main(conn: Connection, parent_pid: int, job: TrialJob) -> None:
    """The forked child: its own group, pin, announce, train, send the result or the
    classified failure."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group of its own: terminal Ctrl-C reaches the parent only
    die_with_parent(parent_pid)
    close_inherited_locks()  # the parent's host lock, which no loader worker may keep
    message: Ended
    try:
        device = _pin(job.cpus, job.gpu, str(job.device))
        message = _train(conn, job, device)
    except BaseException as exc:  # everything is reported; the process ends right after
        message = Failed(classify_exception(exc), time.perf_counter())
    conn.send(message)
    conn.close()


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
            device = _pin(start.cpus, start.gpu, start.device)  # before torch starts threads
            if workload is None:  # a `FreshHost` gives a process one recipe only
                from loader_search.workloads import load_workload

                workload = load_workload(start.recipe.spec, start.recipe.options)
                _warm_up(workload)
            if isinstance(start, Build):  # built ahead of the first trial: idle until it
                conn.send(Built())
                continue
            release_openmp_threads()  # see the module's docstring: forking after torch ran
            pid = os.fork()
        except BaseException as exc:
            conn.send(Failed(classify_exception(exc), time.perf_counter()))
            status = 1 << 8  # exit code 1
            break
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
    message: Ended
    try:
        job = TrialJob(
            workload, start.params, start.settings, device, start.plan, start.cpus, start.gpu
        )
        message = _train(conn, job, device)
        gc.collect()  # a loader held by a reference cycle lets its workers go now
    except BaseException as exc:  # everything is reported; the process ends right after
        message = Failed(classify_exception(exc), time.perf_counter())
    conn.send(message)
    sys.stdout.flush()
    sys.stderr.flush()
    # As a forked child ends: no finaliser runs (loader workers are shut down already).
    os._exit(1 if isinstance(message, Failed) else 0)


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


def _children_gone(process: ChildProcess, timeout_s: float) -> bool:
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


def _pin(cpus: Sequence[int] | None, gpu: int | None, device: str) -> str:
    """Pin this process to ``cpus`` and make only ``gpu`` visible; the device to train on."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before torch starts threads: they inherit it
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # read when CUDA initialises
        return "cuda:0"
    return device


def _train(conn: Connection, job: TrialJob, device: str) -> Ended:
    """Announce the trial (`Ready`: its start-up ends here), train it, and say how it went."""
    from loader_search.trial._run import run_trial

    conn.send(Ready())
    result = run_trial(
        job.workload,
        job.params,
        job.settings,
        device,
        progress=_ProgressPing(conn),
        plan=job.plan,
    )
    return Trained(result, time.perf_counter())


class _ProgressPing:
    """``progress`` for `run_trial` in the child: a `Progress` message to the parent at most
    every interval (what its trial timeout watches), so a fast training loop does not flood
    the pipe."""

    def __init__(self, conn: Connection, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.conn = conn
        self.interval_s = interval_s
        self.last = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            self.conn.send(Progress())
