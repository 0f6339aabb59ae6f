"""One real training run, without Optuna: the run itself, its measurements, the DataLoader it
builds, and the processes that isolate it (with the failure taxonomy). The study layer asks
for a trial with a `TrialJob` and gets a `TrialOutcome`.

What the layer offers is named here; callers outside it import from ``loader_search.trial``,
never from its private modules. Names load lazily: reading a stored failure reason (``best``,
``report``) must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # asking for a trial, and what comes back
    "TrialJob": "loader_search.trial._job",
    "CommandSpec": "loader_search.trial._job",
    "PLACEHOLDERS": "loader_search.trial._placeholders",
    "report_val_loss": "loader_search.trial._report",
    "placeholders_in": "loader_search.trial._placeholders",
    "render_command": "loader_search.trial._placeholders",
    "placeholder_values": "loader_search.trial._placeholders",
    "WorkloadRecipe": "loader_search.trial._job",
    "TrialResult": "loader_search.trial._result",
    "TrialOutcome": "loader_search.trial._failures",
    "TrialFailure": "loader_search.trial._failures",
    # running one
    "run_trial": "loader_search.trial._run",
    "run_isolated": "loader_search.trial._supervisor",
    "can_isolate": "loader_search.trial._supervisor",
    "NO_LIMITS": "loader_search.trial._supervisor",
    "FreshHost": "loader_search.trial._fresh",
    "probe_command": "loader_search.trial._probe",
    "ScriptFacts": "loader_search.trial._probe",
    # what the study plans with
    "MIN_MEASURED_BATCHES": "loader_search.trial._run",
    "batches_needed": "loader_search.trial._run",
    "short_run_samples": "loader_search.trial._run",
    "resolve_ranks": "loader_search.trial._ranks",
    "check_step_settings": "loader_search.trial._step",
    "build_loader": "loader_search.trial._loader",
    # the gradient noise scale a trial measures (its fields of TrialResult)
    "GradientNoiseScale": "loader_search.trial._noise",
    "NoiseEstimate": "loader_search.trial._noise",
    # failure reasons (stored with a failed trial)
    "CUDA_OOM": "loader_search.trial._failures",
    "HOST_OOM": "loader_search.trial._failures",
    "WORKER_KILLED": "loader_search.trial._failures",
    "TIMEOUT": "loader_search.trial._failures",
    "EXCEPTION": "loader_search.trial._failures",
    "DIVERGED": "loader_search.trial._failures",
    "CRASHED": "loader_search.trial._failures",
    "INTERRUPTED": "loader_search.trial._failures",
    "INFEASIBLE_REASONS": "loader_search.trial._failures",
}

__all__ = [
    "CRASHED",
    "CUDA_OOM",
    "DIVERGED",
    "EXCEPTION",
    "HOST_OOM",
    "INFEASIBLE_REASONS",
    "INTERRUPTED",
    "MIN_MEASURED_BATCHES",
    "NO_LIMITS",
    "PLACEHOLDERS",
    "TIMEOUT",
    "WORKER_KILLED",
    "CommandSpec",
    "FreshHost",
    "GradientNoiseScale",
    "NoiseEstimate",
    "ScriptFacts",
    "TrialFailure",
    "TrialJob",
    "TrialOutcome",
    "TrialResult",
    "WorkloadRecipe",
    "batches_needed",
    "build_loader",
    "can_isolate",
    "check_step_settings",
    "placeholder_values",
    "placeholders_in",
    "probe_command",
    "render_command",
    "report_val_loss",
    "resolve_ranks",
    "run_isolated",
    "run_trial",
    "short_run_samples",
]

if TYPE_CHECKING:
    from loader_search.trial._failures import (
        CRASHED,
        CUDA_OOM,
        DIVERGED,
        EXCEPTION,
        HOST_OOM,
        INFEASIBLE_REASONS,
        INTERRUPTED,
        TIMEOUT,
        WORKER_KILLED,
        TrialFailure,
        TrialOutcome,
    )
    from loader_search.trial._fresh import FreshHost
    from loader_search.trial._job import CommandSpec, TrialJob, WorkloadRecipe
    from loader_search.trial._loader import build_loader
    from loader_search.trial._noise import GradientNoiseScale, NoiseEstimate
    from loader_search.trial._placeholders import (
        PLACEHOLDERS,
        placeholder_values,
        placeholders_in,
        render_command,
    )
    from loader_search.trial._probe import ScriptFacts, probe_command
    from loader_search.trial._ranks import resolve_ranks
    from loader_search.trial._report import report_val_loss
    from loader_search.trial._result import TrialResult
    from loader_search.trial._run import (
        MIN_MEASURED_BATCHES,
        batches_needed,
        run_trial,
        short_run_samples,
    )
    from loader_search.trial._step import check_step_settings
    from loader_search.trial._supervisor import NO_LIMITS, can_isolate, run_isolated


__getattr__ = lazy(__name__, _EXPORTS)
