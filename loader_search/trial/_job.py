"""What one trial is asked to run: one plain value from the study layer down to the child."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loader_search.params import FULL_RUN, RunPlan

if TYPE_CHECKING:
    import torch

    from loader_search.params import LoaderParams, TrainingSettings
    from loader_search.workloads import Workload


@dataclass(frozen=True)
class TrialJob:
    """One trial: train ``workload`` with the loader ``params`` under ``settings`` on
    ``device``, doing what ``plan`` asks (see `RunPlan`).

    ``cpus`` pins the trial (and so its loader workers) to those CPUs; ``gpu`` makes only that
    GPU visible to the trial, which then trains on it as ``cuda:0``; ``gpu`` needs a CUDA
    ``device``. Both apply only where the trial runs in a child process (see
    `loader_search.trial._supervisor.run_isolated`, which checks them before forking).
    """

    workload: Workload
    params: LoaderParams
    settings: TrainingSettings
    device: torch.device | str = "cpu"
    plan: RunPlan = FULL_RUN
    cpus: Sequence[int] | None = None
    gpu: int | None = None
