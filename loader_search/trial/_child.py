"""The trial's own process: the child that trains, whether forked from the worker
(`loader_search.trial._supervisor`) or from a kept fresh interpreter
(`loader_search.trial._fresh`). It pins itself, announces itself (`Ready`), trains
(`loader_search.trial._run.run_trial`) with a progress ping the parent's no-progress limit
watches, and sends the result or the classified failure (`Trained`, `Failed`).

A forked child runs in a process group of its own: Ctrl-C in a terminal reaches only the
parent, which then kills the whole group (the child and its loader workers). The child asks
the kernel to kill it should the parent die (``PR_SET_PDEATHSIG``), and its loader workers ask
the same of the child (`loader_search.trial._loader.WorkerStart`). It closes its copies of the
parent's host lock (`close_inherited_locks`) before it forks any worker: a worker that
outlived a killed run kept the lock, and the machine, for good. It ends with ``os._exit`` (as
a multiprocessing fork child does), so no finaliser ever closes or talks on the parent's
database connections it inherited.

This module imports neither Optuna nor (at import time) torch.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from loader_search._inherited import close_inherited_locks
from loader_search.trial._messages import Progress, Ready, Trained, report_failure
from loader_search.trial._processes import die_with_parent

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.connection import Connection

    from loader_search.trial._job import TrialJob
    from loader_search.workloads import Workload

PROGRESS_INTERVAL_S = 0.5  # the child reports progress at most this often


def child_main(conn: Connection, parent_pid: int, job: TrialJob) -> None:
    """A child forked from the worker: its own group, pin, announce, train, send the result
    or the classified failure."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group of its own: terminal Ctrl-C reaches the parent only
    die_with_parent(parent_pid)
    close_inherited_locks()  # the parent's host lock, which no loader worker may keep
    try:
        device = pin_trial(job.cpus, job.gpu, str(job.device))
        message = train_and_report(conn, job, device)
    except BaseException as exc:  # everything is reported; the process ends right after
        report_failure(conn, exc)
    conn.send(message)
    conn.close()


def pin_trial(cpus: Sequence[int] | None, gpu: int | None, device: str) -> str:
    """Pin this process to ``cpus`` and make only ``gpu`` visible; the device to train on."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before torch starts threads: they inherit it
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # read when CUDA initialises
        return "cuda:0"
    return device


def train_and_report(conn: Connection, job: TrialJob, device: str) -> Trained:
    """Announce the trial (`Ready`: its start-up ends here), train it, and say how it went."""
    from loader_search.trial._run import run_trial

    conn.send(Ready())
    result = run_trial(
        job.built,
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


_WARM: dict[int, Workload] = {}  # holds each workload, so that its id() is never reused


def warm_up(workload: Workload) -> None:
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
