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
  never touch CUDA; importing this module (through `loader_search.trial._processes`) sets
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set) so that ``torch.cuda.is_available()`` in
  the parent asks NVML instead of initialising the driver. ``torch.cuda.get_device_name``
  and the like still initialise it: the parent must not call them (`run_isolated` refuses to
  fork once torch reports CUDA initialised).
- GNU OpenMP (the libgomp torch's Linux wheels use) is not fork-safe: a child forked after the
  parent ran a multi-threaded torch op hangs in its first parallel op (measured: every time,
  with 2 threads). `run_isolated` releases the forking thread's OpenMP threads just before the
  fork (``omp_pause_resource_all``), so the child starts a fresh team.
- The child inherits the parent's open database connections. It ends with ``os._exit`` (as a
  multiprocessing fork child does), so no finaliser ever closes or talks on them.

The child's side (its group, pinning, progress pings, the parent-death signal, the inherited
locks it closes) is `loader_search.trial._child`.

**A fresh process instead** (``TrialJob.fresh``): the trial runs in a child of a kept fresh
interpreter, watched, limited and killed the same way (`loader_search.trial._fresh`).

Where fork is not available (not Linux) trials run in-process, classified the same way, but
without the timeout, the memory limit, CPU pinning or GPU pinning.

This module imports neither Optuna nor (at import time) torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from loader_search import interrupts
from loader_search.params import TrialLimits
from loader_search.trial._child import child_main, warm_up
from loader_search.trial._failures import (
    HOST_OOM,
    TIMEOUT,
    TrialFailure,
    TrialOutcome,
    classify_exception,
    classify_exit,
    failure_for,
)
from loader_search.trial._fresh import FreshHost, children_gone
from loader_search.trial._job import TrialJob
from loader_search.trial._messages import Ended, Failed, Ready, Start, Trained
from loader_search.trial._processes import (
    POLL_S,
    ChildProcess,
    dead_worker_failure,
    exited,
    gib,
    kill_tree,
    release_openmp_threads,
    tree_pss,
    wait_for_exit,
)

NO_LIMITS = TrialLimits()  # the defaults: a 600 s progress timeout, no memory limit

if TYPE_CHECKING:
    from multiprocessing.context import ForkProcess

    from loader_search.trial._ranks import RankExits

MEMORY_POLL_S = 0.5  # reading PSS costs ~4 ms per process: not more often than this
_EXIT_GRACE_S = 10.0  # a child that sent its result gets this long to exit by itself
_CLOSED_GRACE_S = 2.0  # and one that closed its pipe, this long


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

    A ``job.command`` runs the user's own training command instead
    (`loader_search.trial._command`), watched, limited and classified the same way.
    """
    job = _checked(job)
    if job.command is not None:  # the user's own command: a process of its own already
        from loader_search.trial._command import run_command
        from loader_search.trial._ranks import resolve_ranks

        return run_command(job, limits, resolve_ranks(job.settings.ranks, job.device))
    if not can_isolate():
        if job.gpu is not None:
            job = dataclasses.replace(job, device=f"cuda:{job.gpu}")
        return _run_in_process(job)
    exits = _rank_exits(job)
    if job.fresh is not None:
        if host is not None:
            return _Supervisor(limits, exits).run_fresh(job, host, keep=True)
        with FreshHost() as once:
            return _Supervisor(limits, exits).run_fresh(job, once, keep=False)
    _refuse_if_cuda_initialised()
    warm_up(job.built)
    return _Supervisor(limits, exits).run(job)


def _rank_exits(job: TrialJob) -> RankExits | None:
    """For a multi-rank job, its ranks' exit classifier (the kernel's count of out-of-memory
    kills read now, before the trial); None for one rank."""
    if job.settings.ranks == 1:
        return None
    from loader_search.trial._ranks import RankExits, resolve_ranks  # torch: only here

    return RankExits() if resolve_ranks(job.settings.ranks, job.device) > 1 else None


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


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: only checked for range
        return set(range(os.cpu_count() or 1))


def _run_in_process(job: TrialJob) -> TrialOutcome:
    from loader_search.trial._run import run_trial

    started = time.perf_counter()
    try:
        result = run_trial(job.built, job.params, job.settings, job.device, plan=job.plan)
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


class _Supervisor:
    """The parent's side of one isolated trial: start, watch, kill, classify."""

    def __init__(self, limits: TrialLimits, rank_exits: RankExits | None = None) -> None:
        self.limits = limits
        self.killed: TrialFailure | None = None  # why the parent killed the trial
        self.reaped = False
        # A multi-rank trial's child is its rank 0: a SIGKILL of it is the out-of-memory
        # killer's only with the kernel's count as evidence, as for its other ranks.
        self.rank_exits = rank_exits

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
                conn.send(Start(dataclasses.replace(job, workload=None), last=not keep))
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
            target=child_main,
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
            ready = wait([reader, process.sentinel], timeout=POLL_S)
            now = time.perf_counter()
            if reader in ready:
                try:
                    received = reader.recv()
                except EOFError:  # the child closed the pipe: it is exiting or dead
                    received = None
                if received is None:
                    # Its end is read from its exit: a fresh process closes the pipe just
                    # before it ends as its trial's child did, and a kill now would be read
                    # as an out-of-memory kill (once under load, a segfault recorded so).
                    wait_for_exit(process, _CLOSED_GRACE_S, POLL_S)
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
        kept = keep and isinstance(message, Trained) and children_gone(process, _EXIT_GRACE_S)
        if not kept:
            if message is not None:
                wait_for_exit(process, _EXIT_GRACE_S, POLL_S)
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
            outcome_failure = self._exit_failure(process.exitcode)
        return TrialOutcome(
            result=result,
            failure=outcome_failure,
            wall_s=ended - started,
            startup_s=startup_s,
            transfer_s=max(0.0, received_at - sent_at) if sent_at is not None else 0.0,
            teardown_s=ended - received_at,
            exitcode=None if kept else process.exitcode,
        )

    def _exit_failure(self, exitcode: int | None) -> TrialFailure:
        """Why a child that sent nothing ended (see `RankExits` for a multi-rank trial)."""
        if self.rank_exits is not None and exitcode == -signal.SIGKILL:
            failure = self.rank_exits.failure(exitcode)
            return dataclasses.replace(failure, message=f"rank 0: {failure.message}")
        return classify_exit(exitcode)

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
