"""Report data: everything the study report shows, as plain values.

Compute first, draw second: `loader_search.reports._collect.collect` reads a study into a
`ReportData` made of frozen dataclasses; `ReportData.as_dict` is what ``loader-search report
--format json`` prints, and `loader_search.reports._html` only draws it. Tests check this
structure, not pictures. The choices made computing the values are stated in
`loader_search.reports._collect`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from loader_search.params import LoaderParams
from loader_search.study import StudySummary, TrialPoint

# data_wait_fraction above this: the loader, not the model, set the pace of the trial.
INPUT_BOUND_THRESHOLD = 0.1
# Hypervolume reference: the worst feasible val_loss plus this share of its magnitude.
HV_LOSS_MARGIN = 0.1

TrialStatus = Literal["pareto", "dominated", "infeasible", "failed"]
Bound = Literal["input", "compute"]


@dataclass(frozen=True)
class ReportTrial:
    """One finished trial as the report shows it.

    ``throughput`` and ``val_loss`` are None for failed and infeasible trials: an infeasible
    trial's stored values are placeholders, not measurements.
    """

    number: int
    status: TrialStatus
    is_baseline: bool
    params: LoaderParams | None
    throughput: float | None
    val_loss: float | None
    data_wait_fraction: float | None
    bound: Bound | None
    loader_efficiency: float | None  # throughput / ceiling (see loader_search.study.work._plan)
    peak_host_rss_bytes: int | None
    peak_gpu_bytes: int | None
    duration_s: float | None  # wall time from the trial's start to its end
    failure_reason: str | None
    failure_message: str | None
    failure_hint: str | None
    hardware_class: str | None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["params"] = self.params.as_dict() if self.params else None
        return data


@dataclass(frozen=True)
class HypervolumePoint:
    number: int  # the trial after which it was measured
    elapsed_s: float  # wall time of every finished trial up to this one, failed ones included
    hypervolume: float


@dataclass(frozen=True)
class Hypervolume:
    """Hypervolume after each finished trial, against one fixed reference point."""

    reference_throughput: float
    reference_val_loss: float | None  # None: no feasible trial yet
    rule: str
    points: tuple[HypervolumePoint, ...]


@dataclass(frozen=True)
class Importances:
    """Parameter importances for one objective (normalised to sum to 1), largest first."""

    objective: str
    evaluator: str
    values: tuple[tuple[str, float], ...]
    note: str  # how it was computed, or why it could not be


@dataclass(frozen=True)
class GridCell:
    """Median throughput of the feasible trials with one batch size, worker count and
    prefetch factor (other settings pooled)."""

    batch_size: int
    num_workers: int
    prefetch_factor: int | None
    throughput: float
    n_trials: int


@dataclass(frozen=True)
class MemoryBoundary:
    """Out-of-memory trials by batch size: below ``smallest_oom_batch_size`` every batch
    size ran; None when nothing ran out of memory."""

    oom_trials: tuple[int, ...]
    smallest_oom_batch_size: int | None
    largest_ok_batch_size: int | None


@dataclass(frozen=True)
class FailureGroup:
    """Failed and infeasible trials that share a failure reason."""

    reason: str
    trials: tuple[int, ...]
    infeasible: tuple[int, ...]  # the ones among ``trials`` that completed but were infeasible
    message: str | None  # the first trial's message (first line)
    hint: str | None


@dataclass(frozen=True)
class HardwareGroup:
    """Trials that ran on one machine, by its fingerprint."""

    hardware_class: str | None
    details: tuple[tuple[str, str], ...]
    trials: tuple[int, ...]


@dataclass(frozen=True)
class ReportData:
    study: str
    hardware_class: str | None  # the class the report is restricted to, if any
    generated_at: str  # ISO 8601, UTC
    metric_names: tuple[str, str]
    summary: StudySummary
    trials: tuple[ReportTrial, ...]  # finished trials, by number
    # One per distinct feasible setting, repeats merged into medians: the points `best`,
    # ``best --json`` and ``studies`` show, whose front is ``summary.pareto``.
    points: tuple[TrialPoint, ...]
    # How many trials Optuna's own front (``study.best_trials``: the dashboard, ``optuna
    # best-trials``) holds: it is computed over raw trials, repeats not merged.
    optuna_front_trials: int
    n_running: int
    input_bound_threshold: float
    hypervolume: Hypervolume
    importances: tuple[Importances, ...]
    throughput_grid: tuple[GridCell, ...]
    memory: MemoryBoundary
    failures: tuple[FailureGroup, ...]  # most frequent first
    hardware: tuple[HardwareGroup, ...]
    environment: tuple[tuple[str, str], ...]  # the study's own record of its machine

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready; ``summary`` is exactly `StudySummary.as_dict` (as in ``best --json``)."""
        return {
            "study": self.study,
            "hardware_class": self.hardware_class,
            "generated_at": self.generated_at,
            "metric_names": list(self.metric_names),
            "summary": self.summary.as_dict(),
            "optuna_front_trials": self.optuna_front_trials,
            "trials": [t.as_dict() for t in self.trials],
            "n_running": self.n_running,
            "input_bound_threshold": self.input_bound_threshold,
            "hypervolume": asdict(self.hypervolume),
            "importances": [asdict(i) for i in self.importances],
            "throughput_grid": [asdict(c) for c in self.throughput_grid],
            "memory": asdict(self.memory),
            "failures": [asdict(f) for f in self.failures],
            "hardware": [
                {
                    "hardware_class": h.hardware_class,
                    "details": dict(h.details),
                    "trials": h.trials,
                }
                for h in self.hardware
            ],
            "environment": dict(self.environment),
        }

    def trial(self, number: int) -> ReportTrial:
        return next(t for t in self.trials if t.number == number)
