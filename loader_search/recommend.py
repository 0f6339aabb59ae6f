"""From a study to plain results: the Pareto front, the baseline and one recommendation.

Everything here returns plain frozen dataclasses (or JSON-ready dicts) so the terminal output,
``best --json`` and reports are all drawn from the same numbers.

The recommendation rule: among the Pareto-optimal trials, the fastest one whose validation
loss is at most the baseline's plus ``loss_tolerance`` (relative), i.e. "faster without making
the model worse than what you have now". The baseline's throughput is the median of every
trial that ran its exact settings. When the baseline trial did not complete, the best
validation loss of the study stands in for it. The chosen trial is always on the front: any
trial dominating it would be faster and also within the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import median
from typing import Any, Literal

import optuna
from optuna.study._multi_objective import _get_pareto_front_trials_by_trials
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, dataloader_snippet

THROUGHPUT = "throughput_samples_per_s"
VAL_LOSS = "val_loss"
METRIC_NAMES = (THROUGHPUT, VAL_LOSS)
DIRECTIONS: tuple[Literal["maximize"], Literal["minimize"]] = ("maximize", "minimize")
BASELINE_ATTR = "baseline"
PARAMS_ATTR = "loader_params"
# Trial attributes: the machine a trial ran on (a dict) and its short hardware-class key.
HARDWARE_ATTR = "hardware"
HARDWARE_CLASS_ATTR = "hardware_class"
# Study attributes.
FINGERPRINT_ATTR = "fingerprint"
BUDGET_ATTR = "trial_budget"
TOLERANCE_ATTR = "loss_tolerance"


@dataclass(frozen=True)
class TrialPoint:
    """One completed trial, as the user reads it."""

    number: int
    params: LoaderParams
    throughput: float
    val_loss: float
    is_baseline: bool
    lr: float | None = None  # the learning rate it trained with (scaled for its batch size)
    # Every throughput measured for these exact settings when more than one trial ran them;
    # ``throughput`` is then their median (used for the baseline, see `summarize`).
    measurements: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        data = {
            "number": self.number,
            "params": self.params.as_dict(),
            "throughput": self.throughput,
            "val_loss": self.val_loss,
            "lr": self.lr,
            "baseline": self.is_baseline,
        }
        if self.measurements:
            data["throughput_measurements"] = list(self.measurements)
        return data


@dataclass(frozen=True)
class Recommendation:
    point: TrialPoint
    speedup_vs_baseline: float | None
    val_loss_change_vs_baseline: float | None  # relative: +0.01 is 1% worse
    rule: str

    @property
    def snippet(self) -> str:
        return dataloader_snippet(self.point.params, lr=self.point.lr)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.point.as_dict(),
            "speedup_vs_baseline": self.speedup_vs_baseline,
            "val_loss_change_vs_baseline": self.val_loss_change_vs_baseline,
            "rule": self.rule,
            "snippet": self.snippet,
        }


@dataclass(frozen=True)
class StudySummary:
    study_name: str
    n_complete: int
    n_failed: int
    n_running: int
    baseline: TrialPoint | None
    pareto: tuple[TrialPoint, ...]  # fastest first
    recommended: Recommendation | None
    loss_tolerance: float
    n_infeasible: int = 0  # completed, but ran out of memory or diverged: never recommended
    hardware_class: str | None = None  # set when the summary covers one class of several

    def as_dict(self) -> dict[str, Any]:
        return {
            "study": self.study_name,
            "hardware_class": self.hardware_class,
            "trials": {
                "complete": self.n_complete,
                "infeasible": self.n_infeasible,
                "failed": self.n_failed,
                "running": self.n_running,
            },
            "loss_tolerance": self.loss_tolerance,
            "baseline": self.baseline.as_dict() if self.baseline else None,
            "pareto": [p.as_dict() for p in self.pareto],
            "recommended": self.recommended.as_dict() if self.recommended else None,
        }


def trial_point(trial: FrozenTrial) -> TrialPoint:
    """A completed trial's effective settings and objective values."""
    assert trial.values is not None, "only completed trials have values"
    stored = trial.user_attrs.get(PARAMS_ATTR)
    params = LoaderParams.from_dict(stored if stored else trial.params)
    return TrialPoint(
        number=trial.number,
        params=params,
        throughput=trial.values[0],
        val_loss=trial.values[1],
        is_baseline=bool(trial.user_attrs.get(BASELINE_ATTR, False)),
        lr=trial.user_attrs.get("lr"),
    )


def recommend(
    pareto: tuple[TrialPoint, ...], baseline: TrialPoint | None, loss_tolerance: float
) -> Recommendation | None:
    """Apply the recommendation rule (see the module docstring) to a Pareto front."""
    if not pareto:
        return None
    if baseline is not None:
        reference, what = baseline.val_loss, "the baseline's val_loss"
    else:
        reference, what = min(p.val_loss for p in pareto), "the best val_loss"
    limit = reference + loss_tolerance * abs(reference)
    candidates = [p for p in pareto if p.val_loss <= limit]
    chosen = max(candidates, key=lambda p: (p.throughput, -p.val_loss))
    rule = (
        f"fastest Pareto-optimal trial with val_loss <= {limit:.4g}"
        f" ({what} {reference:.4g} + {loss_tolerance:.0%})"
    )
    speedup = change = None
    if baseline is not None:
        speedup = chosen.throughput / baseline.throughput
        change = (chosen.val_loss - baseline.val_loss) / abs(baseline.val_loss)
    return Recommendation(chosen, speedup, change, rule)


def is_feasible(trial: FrozenTrial) -> bool:
    """Optuna's rule: every constraint set with ``trial.set_constraint`` is <= 0."""
    return all(value <= 0.0 for value in trial.constraints.values())


def hardware_classes(study: optuna.Study) -> list[str]:
    """The hardware classes the study's trials ran on, in order of first appearance."""
    seen: dict[str, None] = {}
    for trial in study.get_trials(deepcopy=False):
        key = trial.user_attrs.get(HARDWARE_CLASS_ATTR)
        if key is not None:
            seen.setdefault(key, None)
    return list(seen)


def summarize(
    study: optuna.Study, loss_tolerance: float, hardware_class: str | None = None
) -> StudySummary:
    """The study's results, or those of one ``hardware_class`` (throughputs measured on
    different machines never compare). The Pareto set is that of the feasible completed
    trials (equal to Optuna's ``best_trials`` for a whole study), sorted fastest first."""
    trials = study.get_trials(deepcopy=False)
    if hardware_class is not None:
        trials = [t for t in trials if t.user_attrs.get(HARDWARE_CLASS_ATTR) == hardware_class]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    feasible = [t for t in complete if is_feasible(t)]
    baseline = next((trial_point(t) for t in feasible if t.user_attrs.get(BASELINE_ATTR)), None)
    if baseline is not None:
        # Speedups divide by the baseline: use every measurement of its exact settings (the
        # sampler may run them again), not only the first, which is the noisiest (it is the
        # first training in the process).
        same = [p.throughput for p in map(trial_point, feasible) if p.params == baseline.params]
        if len(same) > 1:
            baseline = replace(baseline, throughput=median(same), measurements=tuple(same))
    front = _get_pareto_front_trials_by_trials(feasible, study.directions)
    pareto = tuple(sorted(map(trial_point, front), key=lambda p: (-p.throughput, p.val_loss)))
    return StudySummary(
        study_name=study.study_name,
        n_complete=len(feasible),
        n_failed=sum(t.state == TrialState.FAIL for t in trials),
        n_running=sum(t.state == TrialState.RUNNING for t in trials),
        baseline=baseline,
        pareto=pareto,
        recommended=recommend(pareto, baseline, loss_tolerance),
        loss_tolerance=loss_tolerance,
        n_infeasible=len(complete) - len(feasible),
        hardware_class=hardware_class,
    )
