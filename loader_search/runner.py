"""Creating or continuing a study and running its trials.

The study's trial budget (``[study] trials``, or ``--n-trials``) is a total stored with the
study: running the same study again continues until the budget is used, so an interrupted run
picks up where it stopped.
"""

from __future__ import annotations

import math
import platform
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from loader_search import __version__
from loader_search.config import StudyConfig
from loader_search.errors import StudyAborted, UserError
from loader_search.objective import (
    FAILURE_MESSAGE,
    FAILURE_REASON,
    INTERRUPTED,
    Objective,
    TrialFailed,
)
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.recommend import (
    BASELINE_ATTR,
    BUDGET_ATTR,
    DIRECTIONS,
    FINGERPRINT_ATTR,
    METRIC_NAMES,
    PARAMS_ATTR,
    TOLERANCE_ATTR,
    StudySummary,
    summarize,
    trial_point,
)
from loader_search.space import ResolvedSpace
from loader_search.storage import mask_url, open_storage, resolve_storage_url
from loader_search.system import device_name, resolve_device, usable_cpus
from loader_search.trial import MIN_MEASURED_BATCHES, batches_needed
from loader_search.workloads import Workload, load_workload

DEFAULT_STUDY_NAME = "loader-search"
FINISHED_STATES = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


@dataclass(frozen=True)
class StudyInfo:
    name: str
    storage: str  # masked
    created: bool
    budget: int
    finished: int
    device: str
    workload: str
    usable_cpus: int
    notes: tuple[str, ...]


@dataclass(frozen=True)
class TrialEvent:
    number: int
    complete: bool
    params: LoaderParams | None
    throughput: float | None
    val_loss: float | None
    failure: str | None
    duration_s: float
    finished: int
    budget: int
    pareto_size: int
    best_throughput: float | None
    best_val_loss: float | None


class Reporter(Protocol):
    """Receives progress; the CLI draws it, the Python API may ignore it."""

    def preparing(self, what: str) -> None: ...

    def study_started(self, info: StudyInfo) -> None: ...

    def trial_started(self, number: int, params: LoaderParams) -> None: ...

    def trial_finished(self, event: TrialEvent) -> None: ...


class NullReporter:
    def preparing(self, what: str) -> None:
        pass

    def study_started(self, info: StudyInfo) -> None:
        pass

    def trial_started(self, number: int, params: LoaderParams) -> None:
        pass

    def trial_finished(self, event: TrialEvent) -> None:
        pass


def check_budget(settings: TrainingSettings, space: ResolvedSpace) -> None:
    """Refuse a training budget too small to measure the largest batch size's steady state."""
    batch = max(space.batch_sizes)
    worst = LoaderParams(
        batch_size=batch,
        num_workers=space.num_workers.high,
        prefetch_factor=space.prefetch_factor.high if space.num_workers.high else None,
    )
    needed = batches_needed(worst, settings.warmup_batches)
    if math.ceil(settings.train_samples / batch) < needed:
        raise UserError(
            f"training.train_samples = {settings.train_samples} is too small: batch size"
            f" {batch} with {worst.num_workers} workers x prefetch {worst.prefetch_factor}"
            f" needs {needed} batches (warm-up + {MIN_MEASURED_BATCHES} measured); raise it to"
            f" at least {needed * batch} or lower space.batch_size / prefetch_factor max"
        )


def make_sampler(config: StudyConfig, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The configured sampler. ``seed_offset`` (the trials a continued study already has)
    shifts the seed, so a continued study does not propose its first settings again."""
    sampler = config.sampler
    seed = (config.seed + seed_offset) % 2**32
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler.name == "nsga2":
        kwargs: dict[str, Any] = {"seed": seed}
        if sampler.population_size is not None:
            kwargs["population_size"] = sampler.population_size
        return optuna.samplers.NSGAIISampler(**kwargs)
    if sampler.name == "grid":
        # Every valid combination once: unlike GridSampler, BruteForceSampler follows the
        # conditional parameters (no prefetch_factor grid for num_workers=0).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.BruteForceSampler(seed=seed)
    kwargs = {"seed": seed}
    if sampler.multivariate is not None:
        # Conditional parameters (prefetch only with workers) need group sampling.
        kwargs["multivariate"] = sampler.multivariate
        kwargs["group"] = sampler.multivariate
    if sampler.n_startup_trials is not None:
        kwargs["n_startup_trials"] = sampler.n_startup_trials
    return optuna.samplers.TPESampler(**kwargs)


def _fingerprint(
    config: StudyConfig, workload: Workload, spec: str, device: torch.device, cpus: int
) -> dict[str, Any]:
    """What a continued study must share with the one that created it: throughput measured
    on other hardware, or validation loss under other training settings, would not compare."""
    return {
        "hardware": {"device": device_name(device), "usable_cpus": cpus},
        "workload": spec,
        "workload_options": dict(workload.options or config.workload_options),
        "space": config.space.as_dict(),
        "training": {
            "train_samples": config.training.train_samples,
            "batch_size": config.training.base_batch_size,
            "lr_scaling": config.training.lr_scaling,
            "lr": config.training.lr,
            "warmup_batches": config.training.warmup_batches,
            "eval_batch_size": config.training.eval_batch_size,
            "seed": config.training.seed,
        },
    }


def _environment(device: torch.device, cpus: int) -> dict[str, Any]:
    return {
        "device": str(device),
        "device_name": device_name(device),
        "usable_cpus": cpus,
        "torch_version": torch.__version__,
        "optuna_version": optuna.__version__,
        "python_version": platform.python_version(),
        "loader_search_version": __version__,
    }


def _uses_budget(trial: FrozenTrial) -> bool:
    """Interrupted trials gave no result, and a failed baseline stopped the study (it is
    queued again): neither uses the budget."""
    if trial.user_attrs.get(FAILURE_REASON) == INTERRUPTED:
        return False
    return not (trial.state == TrialState.FAIL and trial.user_attrs.get(BASELINE_ATTR))


def count_finished(study: optuna.Study) -> int:
    """Trials that used the study's budget (see `_uses_budget`)."""
    return sum(map(_uses_budget, study.get_trials(deepcopy=False, states=FINISHED_STATES)))


def _combinations_left(study: optuna.Study, space: ResolvedSpace) -> int:
    """For the grid sampler: valid combinations not yet measured (it would repeat them)."""
    done = {
        tuple(sorted(t.params.items()))
        for t in study.get_trials(deepcopy=False, states=FINISHED_STATES)
        if _uses_budget(t)
    }
    return max(0, space.size() - len(done))


def _ensure_baseline(study: optuna.Study, space: ResolvedSpace, batch_size: int) -> None:
    """Queue the baseline unless one completed or is queued.

    The baseline is the loader most users start from, so every result reads as a speedup
    over it; it runs first in a new study, and again in a continued study whose baseline was
    interrupted, failed, or left RUNNING by a process that was killed.
    """
    present = (TrialState.COMPLETE, TrialState.WAITING)
    if not any(t.user_attrs.get(BASELINE_ATTR) for t in study.get_trials(states=present)):
        study.enqueue_trial(space.baseline(batch_size), user_attrs={BASELINE_ATTR: True})


def _open_study(
    storage: optuna.storages.RDBStorage,
    name: str,
    config: StudyConfig,
    fingerprint: Mapping[str, Any],
) -> tuple[optuna.Study, bool]:
    if name not in optuna.study.get_all_study_names(storage):
        try:
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                sampler=make_sampler(config),
                directions=list(DIRECTIONS),
            )
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago: continue it below
        else:
            study.set_user_attr(
                FINGERPRINT_ATTR, dict(fingerprint)
            )  # at once: see the check below
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(METRIC_NAMES))  # the dashboard shows these names
            return study, True
    study = optuna.load_study(study_name=name, storage=storage)
    study.sampler = make_sampler(config, seed_offset=len(study.get_trials(deepcopy=False)))
    stored = study.user_attrs.get(FINGERPRINT_ATTR)
    has_results = bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if stored is not None and stored != fingerprint and has_results:
        differs = sorted(k for k in fingerprint if stored.get(k) != fingerprint[k])
        raise UserError(
            f"study {name!r} was created with different settings ({', '.join(differs)});"
            " its results would not compare: use another --study-name"
        )
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
        raise UserError(f"study {name!r} is not a loader-search study: use another name")
    return study, False


def run_study(
    config: StudyConfig,
    *,
    workload: Workload | None = None,
    storage: str | None = None,
    n_trials: int | None = None,
    reporter: Reporter | None = None,
) -> StudySummary:
    """Create (or continue) the study ``config`` describes, run it, and summarise it.

    ``workload`` overrides ``config.workload``: the Python API passes one built in memory.
    ``n_trials`` sets the study's total trial budget; without it a new study takes
    ``config.trials`` and a continued one keeps the budget stored with it.
    Bad input raises `UserError` before anything is stored.
    """
    reporter = reporter or NullReporter()
    verbosity = optuna.logging.get_verbosity()
    # The reporter speaks instead of Optuna's per-trial log lines; Optuna logs each failed
    # trial with a traceback, which is stored on the trial (failure_traceback) instead.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        return _run(config, workload, storage, n_trials, reporter)
    finally:
        optuna.logging.set_verbosity(verbosity)


def _run(
    config: StudyConfig,
    workload: Workload | None,
    storage: str | None,
    n_trials: int | None,
    reporter: Reporter,
) -> StudySummary:
    # Everything that can be wrong with the input is checked before the storage is touched.
    if n_trials is not None and n_trials < 1:
        raise UserError(f"--n-trials {n_trials}: must be at least 1")
    url = resolve_storage_url(storage)
    device = resolve_device(config.device)
    cpus = usable_cpus()
    space = config.space.resolve(cpus, cuda=device.type == "cuda")
    check_budget(config.training, space)
    if workload is None:
        spec = config.workload
        reporter.preparing(f"building workload {spec} (its data and model)")
        workload = load_workload(config.workload, config.workload_options)
    else:
        spec = f"python:{workload.name}"  # built in memory by the caller
    name = config.name or DEFAULT_STUDY_NAME
    fingerprint = _fingerprint(config, workload, spec, device, cpus)

    shown = mask_url(url)
    reporter.preparing(f"opening storage {shown}")
    rdb = open_storage(url)
    study, created = _open_study(rdb, name, config, fingerprint)
    finished = count_finished(study)
    if n_trials is not None and n_trials < finished:
        raise UserError(
            f"--n-trials {n_trials} is below the {finished} trials study {name!r} already has;"
            f" give at least {finished}, or use `loader-search best {name}` to see its results"
        )
    notes = list(space.notes)
    budget = n_trials
    if budget is None:
        stored_budget = study.user_attrs.get(BUDGET_ATTR)
        budget = config.trials if created or stored_budget is None else int(stored_budget)
        if budget != config.trials:
            notes.append(
                f"continuing with the study's stored budget of {budget} trials, not the"
                f" config's {config.trials}; pass --n-trials to change it"
            )
    if created or study.user_attrs.get(FINGERPRINT_ATTR) != fingerprint:
        # New, made by plain Optuna, or nothing measured yet under the old settings.
        study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
        study.set_user_attr("workload_description", workload.description)
        study.set_user_attr("sampler", config.sampler.name)
        for key, value in _environment(device, cpus).items():
            study.set_user_attr(key, value)
    _ensure_baseline(study, space, config.training.base_batch_size)
    study.set_user_attr(BUDGET_ATTR, budget)
    study.set_user_attr(TOLERANCE_ATTR, config.loss_tolerance)

    remaining = budget - finished
    if config.sampler.name == "grid":
        left = _combinations_left(study, space)
        if left < remaining:
            notes.append(f"the grid has {left} combination(s) left to measure")
            remaining = left
    reporter.study_started(
        StudyInfo(
            name=name,
            storage=shown,
            created=created,
            budget=budget,
            finished=finished,
            device=device_name(device),
            workload=workload.description or workload.name,
            usable_cpus=cpus,
            notes=tuple(notes),
        )
    )
    if remaining > 0:
        _optimize(study, config, budget, workload, space, device, reporter, remaining)
    return summarize(study, config.loss_tolerance)


def _optimize(
    study: optuna.Study,
    config: StudyConfig,
    budget: int,
    workload: Workload,
    space: ResolvedSpace,
    device: torch.device,
    reporter: Reporter,
    n_trials: int,
) -> None:
    started: dict[int, float] = {}
    failed_baseline: list[FrozenTrial] = []

    def on_start(number: int, params: LoaderParams) -> None:
        started[number] = time.perf_counter()
        reporter.trial_started(number, params)

    def on_end(study: optuna.Study, trial: FrozenTrial) -> None:
        complete = trial.state == TrialState.COMPLETE
        point = trial_point(trial) if complete else None
        stored = trial.user_attrs.get(PARAMS_ATTR)
        pareto = study.best_trials
        values = [
            t.values for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        ]
        failure = None
        if not complete:
            failure = trial.user_attrs.get(FAILURE_MESSAGE) or trial.user_attrs.get(
                FAILURE_REASON, "failed"
            )
        reporter.trial_finished(
            TrialEvent(
                number=trial.number,
                complete=complete,
                params=LoaderParams.from_dict(stored) if stored else None,
                throughput=point.throughput if point else None,
                val_loss=point.val_loss if point else None,
                failure=failure,
                duration_s=time.perf_counter() - started.get(trial.number, time.perf_counter()),
                finished=count_finished(study),
                budget=budget,
                pareto_size=len(pareto),
                best_throughput=max((v[0] for v in values), default=None),
                best_val_loss=min((v[1] for v in values), default=None),
            )
        )
        if not complete and trial.user_attrs.get(BASELINE_ATTR):
            failed_baseline.append(trial)
            study.stop()

    objective = Objective(workload, space, config.training, device, on_start)
    study.optimize(
        objective,
        n_trials=n_trials,
        timeout=config.timeout_s,
        catch=(TrialFailed,),
        callbacks=[on_end],
    )
    if failed_baseline:
        baseline = failed_baseline[0]
        message = baseline.user_attrs.get(FAILURE_MESSAGE, "failed")
        raise StudyAborted(
            f"the baseline trial (#{baseline.number}) failed: {message}. The workload does not"
            " train with the plainest loader; fix it before searching"
        )
