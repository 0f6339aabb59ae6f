"""A study's trials as points a person reads: one per distinct setting (repeats merged into
medians), and the Pareto front over them. `best`, the report, `studies`, the confirmation
rounds and the recommendation all read the same points (see `points_of`).

Throughput is noisy (5-25% from one run to the next on a small shared CPU), so trials that ran
the exact same settings are one point: its throughput and validation loss are the medians of
their measurements.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.study._keys import (
    BASELINE_ATTR,
    HARDWARE_CLASS_ATTR,
    LOADER_EFFICIENCY_ATTR,
    LR_ATTR,
    PARAMS_ATTR,
    UNTRAINED_LOSS_ATTR,
    number,
)


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


def trial_points(trials: Iterable[FrozenTrial]) -> list[TrialPoint]:
    """`trial_point` of each completed trial whose stored settings can be read; one whose
    record was damaged (the database is written by other hands too) is left out, so that
    the study's other results stay readable for everyone who shares it."""
    points = []
    for trial in trials:
        try:
            points.append(trial_point(trial))
        except ValueError:
            continue
    return points


def trial_point(trial: FrozenTrial) -> TrialPoint:
    """A completed trial's effective settings and objective values (`ValueError` for
    settings that cannot be read)."""
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


# A baseline val_loss is not credible above this many times the untrained model's loss, or
# this many times the best val_loss of another batch size (a batch size that blew up while
# staying finite: 3,955,186,741 against 0.82 was seen).
UNTRAINED_MARGIN = 1.5
OTHER_BATCHES_FACTOR = 10.0


def baseline_doubt(
    points: Sequence[TrialPoint], baseline: TrialPoint | None, untrained_loss: float | None
) -> str | None:
    """Why the baseline's validation loss cannot serve as the recommendation's reference,
    or None when it can."""
    if baseline is None:
        return None
    loss = baseline.val_loss
    if untrained_loss is not None and loss > UNTRAINED_MARGIN * untrained_loss:
        return (
            f"the baseline's val_loss {loss:.4g} is worse than the untrained model's loss"
            f" ({untrained_loss:.4g})"
        )
    others = [p.val_loss for p in points if p.params.batch_size != baseline.params.batch_size]
    if others and loss > OTHER_BATCHES_FACTOR * min(others):
        return (
            f"the baseline's val_loss {loss:.4g} is over {OTHER_BATCHES_FACTOR:.0f}x the best"
            f" of another batch size ({min(others):.4g})"
        )
    return None


def tolerance_limit(
    pareto: tuple[TrialPoint, ...],
    baseline: TrialPoint | None,
    loss_tolerance: float,
    doubt: str | None = None,
) -> tuple[float, float, str]:
    """The largest val_loss the recommendation accepts, its reference, and what that is:
    the baseline's val_loss, or the best of the study when there is no baseline or its
    val_loss is in ``doubt`` (then the text says why)."""
    if baseline is not None and doubt is None:
        reference, what = baseline.val_loss, "the baseline's val_loss"
    else:
        reference = min(p.val_loss for p in pareto)
        what = "the best val_loss" + (f", not the baseline's, because {doubt}," if doubt else "")
    return reference + loss_tolerance * abs(reference), reference, what


@dataclass(frozen=True)
class Points:
    """The points of a study's completed trials (of one hardware class, when given)."""

    points: tuple[TrialPoint, ...]  # one per distinct feasible setting, in order of first trial
    baseline: TrialPoint | None
    pareto: tuple[TrialPoint, ...]  # fastest first
    n_complete: int  # feasible completed trials
    n_infeasible: int
    n_failed: int
    n_running: int
    # The median loss of the untrained model over the trials (None in older studies).
    untrained_loss: float | None = None

    @property
    def baseline_doubt(self) -> str | None:
        return baseline_doubt(self.points, self.baseline, self.untrained_loss)


def points_of(trials: Sequence[FrozenTrial], hardware_class: str | None = None) -> Points:
    if hardware_class is not None:
        trials = [t for t in trials if t.user_attrs.get(HARDWARE_CLASS_ATTR) == hardware_class]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    feasible = [t for t in complete if is_feasible(t)]
    points = merge_repeats(trial_points(feasible))
    untrained = [v for t in feasible if (v := number(t.user_attrs, UNTRAINED_LOSS_ATTR))]
    return Points(
        points=tuple(points),
        baseline=next((p for p in points if p.is_baseline), None),
        pareto=pareto_front(points),
        n_complete=len(feasible),
        n_infeasible=len(complete) - len(feasible),
        n_failed=sum(t.state == TrialState.FAIL for t in trials),
        n_running=sum(t.state == TrialState.RUNNING for t in trials),
        untrained_loss=median(untrained) if untrained else None,
    )
