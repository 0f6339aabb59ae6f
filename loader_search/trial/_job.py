"""What one trial is asked to run: one plain value from the study layer down to the child."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loader_search.params import FULL_RUN, RunPlan

if TYPE_CHECKING:
    import torch

    from loader_search.params import LoaderParams, TrainingSettings
    from loader_search.workloads import Workload


@dataclass(frozen=True)
class WorkloadRecipe:
    """How a fresh process builds a workload: ``load_workload(spec, options)`` (the process
    imports with this one's ``sys.path``, so a plug-in is found as it was here)."""

    spec: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CommandSpec:
    """The user's own training command as a trial's workload (`loader_search.trial._command`).

    ``argv`` is the command with its placeholders (``{batch_size}``, ...) not yet filled in;
    it runs in ``workdir``, never through a shell. ``val_loss_pattern`` is a regular
    expression whose first group is the validation loss in the command's output (besides
    ``loader_search.report(val_loss=...)``); without one, the default rule reads the common
    printed forms (`loader_search.trial._command_val_loss`). ``train_loader`` picks the N-th
    DataLoader the script builds as the training loader instead of the documented rule
    (`loader_search.trial._inject`).
    """

    argv: tuple[str, ...]
    workdir: str
    val_loss_pattern: str | None = None
    train_loader: int | None = None


@dataclass(frozen=True)
class TrialJob:
    """One trial: train ``workload`` with the loader ``params`` under ``settings`` on
    ``device``, doing what ``plan`` asks (see `RunPlan`).

    ``cpus`` pins the trial (and so its loader workers) to those CPUs; ``gpu`` makes only that
    GPU visible to the trial, which then trains on it as ``cuda:0``; ``gpu`` needs a CUDA
    ``device``. Both apply only where the trial runs in a child process (see
    `loader_search.trial._supervisor.run_isolated`, which checks them before forking).

    ``fresh`` runs the trial in a fresh Python process that builds its own workload from
    that recipe, instead of a child forked from this process that inherits ``workload``: the
    trial then shares no memory and no process state with this one, as a user's training
    script does (it costs the imports and the build, seconds, outside the measured window).

    ``command`` runs the user's own training command instead of a workload (``workload`` is
    then None): see `CommandSpec`.
    """

    workload: Workload | None
    params: LoaderParams
    settings: TrainingSettings
    device: torch.device | str = "cpu"
    plan: RunPlan = FULL_RUN
    cpus: Sequence[int] | None = None
    gpu: int | None = None
    fresh: WorkloadRecipe | None = None
    command: CommandSpec | None = None

    def __post_init__(self) -> None:
        # A workload: built, or rebuilt from its recipe where the job crosses to a fresh
        # process (a workload holds functions that do not cross a pipe); or a command.
        trains = self.workload is not None or self.fresh is not None
        if trains == (self.command is not None):
            raise ValueError("a TrialJob trains either a workload or a command")

    @property
    def built(self) -> Workload:
        """The workload a child trains (a job without a command has one)."""
        if self.workload is None:
            raise ValueError("this job runs a command, not a workload")
        return self.workload
