"""What the study layer hands to its callers: the session a worker runs, the study it opened,
and the progress it reports (`Reporter`; the CLI draws it, the Python API ignores it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import optuna
import torch

from loader_search.params import LoaderParams
from loader_search.study._config import StudyConfig
from loader_search.study._space import ResolvedSpace
from loader_search.team._hardware import Hardware
from loader_search.workloads import Workload


@dataclass(frozen=True)
class TrialEvent:
    number: int
    params: LoaderParams | None
    state: str  # "complete", "infeasible" or "failed"
    throughput: float | None
    val_loss: float | None
    failure: str | None  # "reason: message"
    hint: str | None
    duration_s: float
    finished: int
    budget: int
    pareto_size: int
    best_throughput: float | None
    best_val_loss: float | None
    confirmation: bool = False  # a trial of the paired confirmation rounds, after the budget
    confirm_round: int | None = None  # its round
    val_loss_from: tuple[int, ...] = ()  # stopped early: the val_loss is theirs
    loader_efficiency: float | None = None  # throughput / ceiling

    @property
    def complete(self) -> bool:
        return self.state == "complete"


class Reporter(Protocol):
    """Receives progress; the CLI draws it, the Python API ignores it (`NullReporter`)."""

    def preparing(self, what: str) -> None:
        """A step before the trials start (or a wait between them)."""

    def study_started(self, info: StudyInfo) -> None:
        """The study is open; ``info`` says what will run."""

    def trial_started(self, number: int, params: LoaderParams) -> None:
        """A trial begins training."""

    def trial_finished(self, event: TrialEvent) -> None:
        """A trial's outcome was stored."""

    def warning(self, what: str) -> None:
        """Something went wrong that the work survives (a database outage, a retry)."""


class NullReporter:
    def preparing(self, what: str) -> None:
        pass

    def study_started(self, info: StudyInfo) -> None:
        pass

    def trial_started(self, number: int, params: LoaderParams) -> None:
        pass

    def trial_finished(self, event: TrialEvent) -> None:
        pass

    def warning(self, what: str) -> None:
        pass


@dataclass(frozen=True)
class StudyInfo:
    name: str
    storage: str  # masked
    created: bool
    budget: int
    finished: int
    device: str
    hardware_class: str
    workload: str
    usable_cpus: int
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Session:
    """Everything one worker process needs to run trials of one study."""

    study: optuna.Study
    config: StudyConfig
    workload: Workload
    space: ResolvedSpace
    device: torch.device
    hardware: Hardware
    budget: int  # as the study stored it when this worker started; re-read before each trial
    # The storage the study was opened with (`loader_search.team._storage.open_storage`): its
    # engine carries the study lock, and its id the lock's key. Public routes, where the
    # study's own storage is Optuna's private cache around it.
    rdb: optuna.storages.RDBStorage
    study_id: int
    cpus: Sequence[int] | None = None
    gpu: int | None = None
    allow_mixed_hardware: bool = False
