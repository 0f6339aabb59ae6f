"""Collecting a study into `ReportData` (`loader_search.reports._data`): the trials' rows, the
hypervolume history, the importances, the throughput grid, the memory boundary, the failures
and the hardware groups.

Choices made here, and stated in the report itself:

- The Pareto set, the baseline and the recommendation come from `recommend.summarize`, and the
  JSON embeds its ``as_dict()`` unchanged, so ``best --json`` and the report always agree.
- Infeasible trials (COMPLETE, but a constraint above 0, e.g. out of memory) carry placeholder
  objective values: they are never points on the front, in the hypervolume or in the
  importances; their measurements that are real (memory) are still shown.
- Hypervolume is computed in minimisation form (``-throughput``, ``val_loss``) against a
  reference point fixed for a study's trials: throughput 0 and the worst feasible validation
  loss plus 10% of its magnitude, so every feasible trial adds to it.
- A trial is *input-bound* when its training loop waited for data more than
  `INPUT_BOUND_THRESHOLD` of the measured window, else *compute-bound*.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from statistics import median
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.reports._data import (
    HV_LOSS_MARGIN,
    INPUT_BOUND_THRESHOLD,
    Bound,
    FailureGroup,
    GridCell,
    HardwareGroup,
    Hypervolume,
    HypervolumePoint,
    Importances,
    MemoryBoundary,
    ReportData,
    ReportTrial,
    TrialStatus,
)
from loader_search.study import (
    BASELINE_ATTR,
    DATA_WAIT,
    ENVIRONMENT_ATTRS,
    FAILURE_HINT,
    FAILURE_MESSAGE,
    FAILURE_REASON,
    HARDWARE_ATTR,
    HARDWARE_CLASS_ATTR,
    LOADER_EFFICIENCY_ATTR,
    MEASURED_OOM_REASONS,
    PARAMS_ATTR,
    PEAK_GPU,
    PEAK_RSS,
    THROUGHPUT,
    VAL_LOSS,
    hypervolume_2d,
    is_feasible,
    pareto_front,
    points_of,
    summarize,
    trial_points,
)


def collect(
    study: optuna.Study, loss_tolerance: float, hardware_class: str | None = None
) -> ReportData:
    """Everything the report shows, computed from the study's stored trials; with
    ``hardware_class``, from the trials of that class only (as ``best`` summarises a study
    that ran on several: throughputs from different machines never compare)."""
    summary = summarize(study, loss_tolerance, hardware_class)
    all_trials = study.get_trials(deepcopy=False)
    if hardware_class is not None:
        all_trials = [
            t for t in all_trials if t.user_attrs.get(HARDWARE_CLASS_ATTR) == hardware_class
        ]
    finished = [t for t in all_trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    feasible = [t for t in complete if is_feasible(t)]
    feasible_numbers = {t.number for t in feasible}
    # Every trial of a Pareto-optimal setting (repeats are one point: their median).
    pareto_numbers = {n for p in summary.pareto for n in (p.numbers or (p.number,))}
    rows = tuple(_report_trial(t, _status(t, pareto_numbers, feasible_numbers)) for t in finished)
    return ReportData(
        study=study.study_name,
        hardware_class=hardware_class,
        generated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        metric_names=(THROUGHPUT, VAL_LOSS),
        summary=summary,
        trials=rows,
        points=points_of(all_trials).points,
        optuna_front_trials=len(pareto_front(trial_points(feasible))),
        n_running=sum(t.state == TrialState.RUNNING for t in all_trials),
        input_bound_threshold=INPUT_BOUND_THRESHOLD,
        hypervolume=hypervolume_history(finished),
        importances=importances(feasible, study.directions),
        throughput_grid=throughput_grid(rows),
        memory=memory_boundary(rows),
        failures=failure_groups(rows),
        hardware=hardware_groups(finished),
        environment=tuple(
            (key, str(study.user_attrs[key]))
            for key in ENVIRONMENT_ATTRS
            if key in study.user_attrs
        ),
    )


def _status(trial: FrozenTrial, pareto: set[int], feasible: set[int]) -> TrialStatus:
    if trial.state == TrialState.FAIL:
        return "failed"
    if trial.number not in feasible:
        return "infeasible"
    return "pareto" if trial.number in pareto else "dominated"


def _number(value: Any) -> float | None:
    """A finite float from a stored attribute, else None (absent in older studies)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _first_line(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip().splitlines()[0]


def _params(trial: FrozenTrial) -> LoaderParams | None:
    stored = trial.user_attrs.get(PARAMS_ATTR) or trial.params
    try:
        return LoaderParams.from_dict(stored)
    except ValueError:
        return None  # failed before its settings were complete, or a damaged record


def _duration(trial: FrozenTrial) -> float | None:
    if trial.datetime_start is None or trial.datetime_complete is None:
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def _report_trial(trial: FrozenTrial, status: TrialStatus) -> ReportTrial:
    attrs = trial.user_attrs
    measured = status in ("pareto", "dominated")
    wait = _number(attrs.get(DATA_WAIT)) if status != "failed" else None
    rss, gpu = _number(attrs.get(PEAK_RSS)), _number(attrs.get(PEAK_GPU))
    bound: Bound | None = None
    if wait is not None and measured:
        bound = "input" if wait > INPUT_BOUND_THRESHOLD else "compute"
    return ReportTrial(
        number=trial.number,
        status=status,
        is_baseline=bool(attrs.get(BASELINE_ATTR, False)),
        params=_params(trial),
        throughput=trial.values[0] if measured and trial.values else None,
        val_loss=trial.values[1] if measured and trial.values else None,
        data_wait_fraction=wait if measured else None,
        bound=bound,
        loader_efficiency=_number(attrs.get(LOADER_EFFICIENCY_ATTR)) if measured else None,
        peak_host_rss_bytes=int(rss) if rss is not None else None,
        peak_gpu_bytes=int(gpu) if gpu is not None else None,
        duration_s=_duration(trial),
        failure_reason=attrs.get(FAILURE_REASON) if not measured else None,
        failure_message=_first_line(attrs.get(FAILURE_MESSAGE)) if not measured else None,
        failure_hint=_first_line(attrs.get(FAILURE_HINT)) if not measured else None,
        hardware_class=attrs.get(HARDWARE_CLASS_ATTR),
    )


def hypervolume_history(trials: Sequence[FrozenTrial]) -> Hypervolume:
    """Hypervolume of the feasible trials finished so far, after each finished trial.

    The reference point is fixed for the given trials (see the module docstring), so the
    history never decreases: each step only adds points.
    """
    ordered = sorted(trials, key=lambda t: t.number)
    feasible = {t.number for t in ordered if t.state == TrialState.COMPLETE and is_feasible(t)}
    losses = [t.values[1] for t in ordered if t.number in feasible and math.isfinite(t.values[1])]
    rule = (
        "reference point: throughput 0 samples/s and val_loss = the worst feasible val_loss"
        f" + {HV_LOSS_MARGIN:.0%} of its magnitude; area in (samples/s x val_loss) units,"
        " computed as minimisation (-throughput, val_loss)"
    )
    if not losses:
        return Hypervolume(0.0, None, rule, ())
    worst = max(losses)
    reference_loss = worst + HV_LOSS_MARGIN * abs(worst) if worst else HV_LOSS_MARGIN
    reference = (0.0, reference_loss)
    points: list[list[float]] = []
    history: list[HypervolumePoint] = []
    elapsed = 0.0
    for trial in ordered:
        elapsed += _duration(trial) or 0.0
        if trial.number in feasible:
            point = [-trial.values[0], trial.values[1]]
            if all(math.isfinite(v) for v in point) and point[0] < 0 and point[1] < reference_loss:
                points.append(point)
        volume = hypervolume_2d(points, reference) if points else 0.0
        history.append(HypervolumePoint(trial.number, elapsed, volume))
    return Hypervolume(0.0, reference_loss, rule, tuple(history))


def importances(
    feasible: Sequence[FrozenTrial], directions: Sequence[optuna.study.StudyDirection]
) -> tuple[Importances, ...]:
    """Parameter importances for each objective, over the feasible completed trials only.

    Optuna 5's default evaluator is PED-ANOVA, which handles the conditional parameters
    (``prefetch_factor`` exists only with workers) and, given a ``target``, treats lower as
    better: throughput is negated so that its top quantile is the fastest trials.
    """
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    targets: tuple[tuple[str, Callable[[FrozenTrial], float], str], ...] = (
        (THROUGHPUT, lambda t: -t.values[0], "target = -throughput (PED-ANOVA minimises)"),
        (VAL_LOSS, lambda t: t.values[1], "target = val_loss"),
    )
    varying = {
        name
        for name in {n for t in feasible for n in t.params}
        if len({repr(t.params.get(name)) for t in feasible}) > 1
    }
    results = []
    for objective, target, how in targets:
        if objective == VAL_LOSS:
            results.append(_val_loss_by_batch(feasible))
            continue
        evaluator = PedAnovaImportanceEvaluator()
        name = type(evaluator).__name__
        if len(feasible) < 2 or not varying:
            note = "not computable: needs at least 2 feasible trials whose parameters differ"
            results.append(Importances(objective, name, (), note))
            continue
        # A throw-away in-memory study: the importance API reads whole studies, and
        # infeasible trials' placeholder values must not count.
        scratch = optuna.create_study(directions=list(directions))
        used = 0
        for trial in feasible:
            try:
                scratch.add_trial(trial)
                used += 1
            except ValueError:
                # A setting outside its searched range: the baseline's num_workers=0 when
                # the range starts higher. It was measured, but Optuna cannot weigh it.
                continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values = get_param_importances(scratch, evaluator=evaluator, target=target)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            note = f"not computable: {type(exc).__name__}: {_first_line(str(exc))}"
            results.append(Importances(objective, name, (), note))
            continue
        pairs = tuple((k, float(v)) for k, v in values.items() if math.isfinite(v))
        note = f"{name} (Optuna's default) over {used} feasible trials; {how}"
        results.append(Importances(objective, name, pairs, note))
    return tuple(results)


def _val_loss_by_batch(feasible: Sequence[FrozenTrial]) -> Importances:
    """val_loss has one cause among the searched settings, by design: every trial trains the
    same model from the same weights on the same samples in the same order, so the loader
    settings cannot change what it learns; only the batch size (with its learning rate) can.
    A statistical importance would rank the loader settings on noise; this says so instead,
    with the median val_loss of each batch size."""
    by_batch: dict[int, list[float]] = defaultdict(list)
    for trial in feasible:
        params = _params(trial)
        if params is not None and trial.values:
            by_batch[params.batch_size].append(trial.values[1])
    medians = ", ".join(f"{b}: {median(v):.4g}" for b, v in sorted(by_batch.items()))
    note = (
        "only batch_size can change it: the loader settings cannot change what the model"
        " learns (every trial trains the same model from the same weights on the same samples"
        " in the same order), so no importance is estimated for them"
        + (f"; median val_loss by batch size: {medians}" if medians else "")
    )
    values = (("batch_size", 1.0),) if len(by_batch) > 1 else ()
    return Importances(VAL_LOSS, "by design", values, note)


def throughput_grid(rows: Sequence[ReportTrial]) -> tuple[GridCell, ...]:
    """Median throughput per (batch size, workers, prefetch), feasible trials only."""
    groups: dict[tuple[int, int, int | None], list[float]] = defaultdict(list)
    for row in rows:
        if row.params is not None and row.throughput is not None:
            p = row.params
            groups[(p.batch_size, p.num_workers, p.prefetch_factor)].append(row.throughput)
    return tuple(
        GridCell(batch, workers, prefetch, median(values), len(values))
        for (batch, workers, prefetch), values in sorted(
            groups.items(), key=lambda item: (item[0][0], item[0][1], item[0][2] or 0)
        )
    )


def memory_boundary(rows: Sequence[ReportTrial]) -> MemoryBoundary:
    oom = [r for r in rows if r.failure_reason in MEASURED_OOM_REASONS]
    smallest = min((r.params.batch_size for r in oom if r.params), default=None)
    ok = [
        r.params.batch_size
        for r in rows
        if r.params
        and r.status in ("pareto", "dominated")
        and (smallest is None or r.params.batch_size < smallest)
    ]
    return MemoryBoundary(tuple(r.number for r in oom), smallest, max(ok, default=None))


def failure_groups(rows: Sequence[ReportTrial]) -> tuple[FailureGroup, ...]:
    groups: dict[str, list[ReportTrial]] = defaultdict(list)
    for row in rows:
        if row.status in ("failed", "infeasible"):
            groups[row.failure_reason or "unknown"].append(row)
    return tuple(
        FailureGroup(
            reason=reason,
            trials=tuple(r.number for r in members),
            infeasible=tuple(r.number for r in members if r.status == "infeasible"),
            message=next((r.failure_message for r in members if r.failure_message), None),
            hint=next((r.failure_hint for r in members if r.failure_hint), None),
        )
        for reason, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    )


def hardware_groups(trials: Sequence[FrozenTrial]) -> tuple[HardwareGroup, ...]:
    """Trials grouped by the hardware fingerprint they recorded (none for older trials)."""
    groups: dict[str, tuple[str | None, dict[str, Any], list[int]]] = {}
    for trial in trials:
        details = trial.user_attrs.get(HARDWARE_ATTR)
        if not isinstance(details, Mapping):
            continue
        key_class = trial.user_attrs.get(HARDWARE_CLASS_ATTR)
        key = repr((key_class, sorted(details.items(), key=lambda kv: kv[0])))
        groups.setdefault(key, (key_class, dict(details), []))[2].append(trial.number)
    return tuple(
        HardwareGroup(
            hardware_class=str(key_class) if key_class is not None else None,
            details=tuple(_detail(str(k), v) for k, v in details.items()),
            trials=tuple(numbers),
        )
        for key_class, details, numbers in groups.values()
    )


def _detail(key: str, value: Any) -> tuple[str, str]:
    """One hardware fact for people: byte counts in GiB (``ram_bytes`` -> ``ram``)."""
    if key.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return key.removesuffix("_bytes"), f"{value / 2**30:,.1f} GiB"
    return key, _show(value)


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_show(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_show(v) for v in value)
    return str(value)
