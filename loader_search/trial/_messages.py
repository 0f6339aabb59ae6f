"""What a trial process tells the process that started it, through a pipe.

A fresh trial process (not forked: see `loader_search.trial._fresh`) receives `Start`
for each trial, the one message sent the other way but `Build`, which asks it to build its
workload ahead of its first trial (it answers `Built`). The trial's process sends `Ready`
once pinned, `Progress` at most every `PROGRESS_INTERVAL_S` while it trains (what the trial
timeout watches), and last `Trained` or `Failed` (a failure through `report_failure`, which
ends the process); a sibling rank (`loader_search.trial._ranks`) sends only the last. Plain
frozen dataclasses defined at module level, so that they pickle through the pipe; the parent
reads anything else as progress.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from loader_search.trial._failures import classify_exception

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.connection import Connection

    from loader_search.trial._failures import TrialFailure
    from loader_search.trial._job import TrialJob, WorkloadRecipe
    from loader_search.trial._result import TrialResult


@dataclass(frozen=True)
class Start:
    """What a fresh trial process is to run: the `TrialJob` itself, whole but for its
    workload, which the process builds from the job's ``fresh`` recipe (a workload holds
    functions that do not cross a pipe)."""

    job: TrialJob
    last: bool = False  # end after this trial, instead of waiting for the next `Start`

    @property
    def recipe(self) -> WorkloadRecipe:
        assert self.job.fresh is not None
        return self.job.fresh

    @property
    def device(self) -> str:
        return str(self.job.device)

    @property
    def cpus(self) -> Sequence[int] | None:
        return self.job.cpus

    @property
    def gpu(self) -> int | None:
        return self.job.gpu


@dataclass(frozen=True)
class Build:
    """Build the workload from ``recipe`` now, pinned as its trials will be, before any trial
    asks for it (`loader_search.trial._fresh.FreshHost.prepare`)."""

    recipe: WorkloadRecipe
    device: str
    cpus: Sequence[int] | None
    gpu: int | None


@dataclass(frozen=True)
class Built:
    """The fresh process has built its workload and idles until the first `Start`."""


@dataclass(frozen=True)
class Ready:
    """The trial's process is pinned and about to train: its start-up ends here."""


@dataclass(frozen=True)
class Progress:
    """Training goes on: a training step or an evaluation batch since the last ping."""


@dataclass(frozen=True)
class Trained:
    """The trial ended well: its result, and when it was sent (``time.perf_counter``; the
    parent's ``transfer_s`` measures how long the result took through the pipe)."""

    result: TrialResult
    sent_at: float


@dataclass(frozen=True)
class Failed:
    """The trial raised: its classified failure, and when it was sent."""

    failure: TrialFailure
    sent_at: float


Ended = Trained | Failed


def report_failure(conn: Connection, exc: BaseException) -> NoReturn:
    """Send ``exc``'s classified failure and end this trial process at once (exit code 1),
    while ``exc`` still holds what the failed training held.

    Letting it go first freed a DDP model whose gloo process group joins its worker thread
    with the GIL held, while that thread needed the GIL to free the failed collective: a
    deadlock, and a rank's segfault recorded as a "timeout" (seen under load). Nothing of a
    failed trial needs its finalisers: its loader workers and sibling ranks die with it, and
    the supervisor reaps what is left."""
    with contextlib.suppress(Exception):  # a parent gone: nobody to tell
        conn.send(Failed(classify_exception(exc), time.perf_counter()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
