"""From a study to plain results: the Pareto front, the baseline and one recommendation.

Everything here returns plain frozen dataclasses (or JSON-ready dicts) so the terminal output,
``best --json`` and reports are all drawn from the same numbers.

Throughput is noisy (5-25% from one run to the next on a small shared CPU), so trials that ran
the exact same settings are one point: its throughput and validation loss are the medians of
their measurements. The study re-measures its best candidates before it ends (see
`loader_search.study._worker`), so the recommendation rests on medians, not on one lucky reading.

The recommendation rule: among the Pareto-optimal points, the fastest one whose validation
loss is at most the baseline's plus ``loss_tolerance`` (relative), i.e. "faster without making
the model worse than what you have now". When the baseline did not complete, the best
validation loss of the study stands in for it. The chosen point is always on the front: any
point dominating it would be faster and also within the tolerance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, dataloader_snippet
from loader_search.study._keys import (
    BASELINE_ATTR,
    CONFIRMATION_ATTR,
    HARDWARE_CLASS_ATTR,
    LOADER_EFFICIENCY_ATTR,
    LR_ATTR,
    PARAMS_ATTR,
    PIPELINE_ATTR,
    stored_params,
)
from loader_search.study._pipeline import PipelineModel


@dataclass(frozen=True)
class TrialPoint:
    """One setting's results, as the user reads it: a completed trial, or the median of
    every completed trial that ran these exact settings (``numbers``, first = ``number``)."""

    number: int
    params: LoaderParams
    throughput: float
    val_loss: float
    is_baseline: bool
    lr: float | None = None  # the learning rate it trained with (scaled for its batch size)
    # Every throughput measured for these exact settings when more than one trial ran them;
    # ``throughput`` is then their median.
    measurements: tuple[float, ...] = ()
    numbers: tuple[int, ...] = ()
    # Throughput / the ceiling (the model fed pre-decoded data on the device); a median.
    loader_efficiency: float | None = None

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the throughput measurements; None for a single one."""
        if len(self.measurements) < 2:
            return None
        return (max(self.measurements) - min(self.measurements)) / self.throughput

    def as_dict(self) -> dict[str, Any]:
        data = {
            "number": self.number,
            "params": self.params.as_dict(),
            "throughput": self.throughput,
            "val_loss": self.val_loss,
            "lr": self.lr,
            "baseline": self.is_baseline,
            "loader_efficiency": self.loader_efficiency,
        }
        if self.measurements:
            data["throughput_measurements"] = list(self.measurements)
            data["throughput_spread"] = self.spread
            data["trials"] = list(self.numbers)
        return data


@dataclass(frozen=True)
class PipelineView:
    """What the pipeline model says of the recommendation (see `loader_search.study._guide`):
    the best its batch size can do on this machine, how close it comes, what bounds it and
    what would lift the limit."""

    limit_samples_per_s: float
    limit_from: str  # "model", or "measurement" where a measured setting beat the model
    efficiency_vs_limit: float
    bottleneck: str  # device | loader_workers | main_process, for the recommended setting
    predicted_samples_per_s: float
    limit_params: LoaderParams  # the setting the model predicts reaches the limit
    lifts: tuple[dict[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "limit_samples_per_s": self.limit_samples_per_s,
            "limit_from": self.limit_from,
            "efficiency_vs_limit": self.efficiency_vs_limit,
            "bottleneck": self.bottleneck,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "limit_params": self.limit_params.as_dict(),
            "lifts": [dict(lift) for lift in self.lifts],
        }


@dataclass(frozen=True)
class Recommendation:
    point: TrialPoint
    speedup_vs_baseline: float | None
    val_loss_change_vs_baseline: float | None  # relative: +0.01 is 1% worse
    rule: str
    pipeline: PipelineView | None = None

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
            "pipeline": self.pipeline.as_dict() if self.pipeline else None,
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
        lr=trial.user_attrs.get(LR_ATTR),
        loader_efficiency=trial.user_attrs.get(LOADER_EFFICIENCY_ATTR),
    )


def tolerance_limit(
    pareto: tuple[TrialPoint, ...], baseline: TrialPoint | None, loss_tolerance: float
) -> tuple[float, float, str]:
    """The largest val_loss the recommendation accepts, its reference, and what that is."""
    if baseline is not None:
        reference, what = baseline.val_loss, "the baseline's val_loss"
    else:
        reference, what = min(p.val_loss for p in pareto), "the best val_loss"
    return reference + loss_tolerance * abs(reference), reference, what


def recommend(
    pareto: tuple[TrialPoint, ...], baseline: TrialPoint | None, loss_tolerance: float
) -> Recommendation | None:
    """Apply the recommendation rule (see the module docstring) to a Pareto front."""
    if not pareto:
        return None
    limit, reference, what = tolerance_limit(pareto, baseline, loss_tolerance)
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


def merge_repeats(points: list[TrialPoint]) -> list[TrialPoint]:
    """One point per distinct setting: trials that ran the same settings become one, with
    the medians of their throughputs and validation losses (in order of first trial)."""
    groups: dict[LoaderParams, list[TrialPoint]] = {}
    for point in sorted(points, key=lambda p: p.number):
        groups.setdefault(point.params, []).append(point)
    merged = []
    for group in groups.values():
        first = group[0]
        if len(group) == 1:
            merged.append(replace(first, numbers=(first.number,)))
            continue
        throughputs = tuple(p.throughput for p in group)
        merged.append(
            replace(
                first,
                throughput=median(throughputs),
                val_loss=median(p.val_loss for p in group),
                is_baseline=any(p.is_baseline for p in group),
                loader_efficiency=_median_or_none([p.loader_efficiency for p in group]),
                measurements=throughputs,
                numbers=tuple(p.number for p in group),
            )
        )
    return merged


def confirmation_candidates(
    summary: StudySummary, top: int, repeats: int
) -> list[tuple[TrialPoint, int]]:
    """What to re-measure before recommending, and how many more times: the ``top`` fastest
    Pareto points the rule can choose (within the loss tolerance) and the baseline, each up
    to ``repeats`` measurements in all."""
    chosen: list[TrialPoint] = []
    if summary.pareto and top > 0:
        limit = tolerance_limit(summary.pareto, summary.baseline, summary.loss_tolerance)[0]
        within = [p for p in summary.pareto if p.val_loss <= limit]
        chosen = sorted(within, key=lambda p: -p.throughput)[:top]
    if summary.baseline is not None and summary.baseline not in chosen:
        chosen.append(summary.baseline)
    wanted = [(point, repeats - max(1, len(point.numbers))) for point in chosen]
    return [(point, missing) for point, missing in wanted if missing > 0]


def confirmation_queue(
    trials: list[FrozenTrial],
    loss_tolerance: float,
    top: int,
    repeats: int,
    hardware_class: str | None = None,
) -> list[dict[str, Any]]:
    """The re-measurements to queue now, as the trial parameters to enqueue, in order.

    What `confirmation_candidates` finds missing, at most ``2 * repeats`` re-measurements
    per setting in all (failed ones count, so that asking again ends), round-robin (A, B,
    baseline, A, B, ...): a change of load on the machine then hits every candidate alike,
    and a timeout leaves them evenly measured. The worker and the benchmarks' replay both
    queue what this returns.
    """
    summary = summarize_trials("", trials, loss_tolerance, hardware_class)
    by_number = {t.number: t for t in trials}
    attempts = Counter(stored_params(t) for t in trials if t.user_attrs.get(CONFIRMATION_ATTR))
    wanted = []
    for point, missing in confirmation_candidates(summary, top, repeats):
        allowed = min(missing, 2 * repeats - attempts[point.params])
        if allowed > 0:
            wanted.append((by_number[point.number], allowed))
    return [
        dict(source.params)
        for round_ in range(max((n for _, n in wanted), default=0))
        for source, allowed in wanted
        if round_ < allowed
    ]


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def pareto_front(points: list[TrialPoint]) -> tuple[TrialPoint, ...]:
    """The points no other point beats on both objectives (faster and lower val_loss, one of
    them strictly), fastest first."""
    front: list[TrialPoint] = []
    for point in sorted(points, key=lambda p: (-p.throughput, p.val_loss, p.number)):
        if not front or point.val_loss < front[-1].val_loss:
            front.append(point)
        elif point.val_loss == front[-1].val_loss and point.throughput == front[-1].throughput:
            front.append(point)  # an exact tie: neither dominates, as in Optuna
    return tuple(front)


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
    summary = summarize_trials(
        study.study_name, study.get_trials(deepcopy=False), loss_tolerance, hardware_class
    )
    stored = study.user_attrs.get(PIPELINE_ATTR)
    if summary.recommended is None or not isinstance(stored, dict) or not stored:
        return summary
    key = hardware_class if hardware_class is not None else next(iter(stored))
    view = pipeline_view(stored.get(key), summary.recommended.point)
    return replace(summary, recommended=replace(summary.recommended, pipeline=view))


def pipeline_view(snapshot: Any, point: TrialPoint) -> PipelineView | None:
    """The stored pipeline model's word on ``point`` (None when there is none, or it is not
    readable: the database is written by other hands too)."""
    try:
        entry = snapshot["batch_sizes"][str(point.params.batch_size)]
        model = PipelineModel.from_dict(snapshot["model"])
        limit = float(entry["limit_samples_per_s"])
        prediction = model.predict(point.params)
        limit_params = LoaderParams.from_dict(entry["limit_params"])
        lifts = tuple(dict(lift) for lift in entry.get("lifts", ()))
    except (KeyError, TypeError, ValueError):
        return None
    if limit <= 0:
        return None
    return PipelineView(
        limit_samples_per_s=limit,
        limit_from=str(entry.get("limit_from", "model")),
        efficiency_vs_limit=point.throughput / limit,
        bottleneck=prediction.bottleneck,
        predicted_samples_per_s=prediction.throughput,
        limit_params=limit_params,
        lifts=lifts,
    )


def summarize_trials(
    study_name: str,
    trials: list[FrozenTrial],
    loss_tolerance: float,
    hardware_class: str | None = None,
) -> StudySummary:
    """`summarize` over given trials (the benchmarks replay studies trial by trial)."""
    if hardware_class is not None:
        trials = [t for t in trials if t.user_attrs.get(HARDWARE_CLASS_ATTR) == hardware_class]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    feasible = [t for t in complete if is_feasible(t)]
    points = merge_repeats([trial_point(t) for t in feasible])
    baseline = next((p for p in points if p.is_baseline), None)
    pareto = pareto_front(points)
    return StudySummary(
        study_name=study_name,
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


def hypervolume_2d(points: Iterable[Sequence[float]], reference: Iterable[float]) -> float:
    """The area that ``points`` dominate up to ``reference``, both objectives minimised: the
    union of the rectangles ``[x, rx] x [y, ry]``. Exact, O(n log n); Optuna has no public
    hypervolume function (``optuna._hypervolume`` is private).

    Sorted by the first objective, a point adds area only below the lowest second objective
    seen so far (a point that does not is dominated), and what it adds is the strip between
    the two, as wide as from its first objective to the reference. As in Optuna, a point
    beyond the reference (or NaN) is an error, not ignored.
    """
    rx, ry = (float(v) for v in reference)
    pairs = [(float(x), float(y)) for x, y in points]
    if not all(x <= rx and y <= ry for x, y in pairs):
        raise ValueError(f"every point must be at or below the reference {(rx, ry)}: {pairs}")
    area, lowest = 0.0, ry
    for x, y in sorted(pairs):
        if y < lowest:
            area += (rx - x) * (lowest - y)
            lowest = y
    return area
