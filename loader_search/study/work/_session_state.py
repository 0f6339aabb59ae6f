"""The session: everything one worker process needs to run trials of one study, built by
`loader_search.study._session` (create, continue or join a study) and carried through the
worker loop (`_worker`, `_take`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import optuna
import torch

from loader_search.study.config import StudyConfig
from loader_search.study.search import ResolvedSpace
from loader_search.team import Hardware
from loader_search.trial import FreshHost, WorkloadRecipe
from loader_search.workloads import Workload


@dataclass(frozen=True)
class Session:
    """Everything one worker process needs to run trials of one study."""

    study: optuna.Study
    config: StudyConfig
    workload: Workload | None  # None: the study's workload is a command (config.command)
    # How a fresh process builds the workload; None: the caller's, built in memory.
    recipe: WorkloadRecipe | None
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
    # The fresh process the confirmation trials train in (``study.confirm_process =
    # "fresh"``), started with the session so that it builds beside the worker's start-up
    # (`loader_search.study._session`); the worker keeps it between those trials.
    fresh: FreshHost = field(default_factory=FreshHost)
