"""Creating, continuing and joining studies; the trials themselves run in `worker`.

The study's trial budget (``[study] trials``, or ``--n-trials``) is a total stored with the
study and shared by every process that works on it: running the same study again continues
until the budget is used, so an interrupted run picks up where it stopped, and ``loader-search
worker`` processes on other machines join it. `run` stores its config document with the
study, so a worker needs nothing but the study's name and the database.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from loader_search._version import __version__
from loader_search.errors import UserError
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study._config import StudyConfig, parse_config
from loader_search.study._fit import fit_space, sample_bytes
from loader_search.study._recommend import (
    BUDGET_ATTR,
    CONFIRM_ATTR,
    DIRECTIONS,
    FINGERPRINT_ATTR,
    METRIC_NAMES,
    TOLERANCE_ATTR,
    StudySummary,
    hardware_classes,
    summarize,
)
from loader_search.study._space import ResolvedSpace
from loader_search.study._worker import (
    STUDY_HARDWARE_ATTR,
    NullReporter,
    Reporter,
    RetryStaleTrial,
    Session,
    StudyInfo,
    TrialEvent,
    count_finished,
    hardware_mismatch,
    work,
)
from loader_search.team._hardware import Hardware, collect, gpu_count
from loader_search.team._storage import mask_url, open_storage, resolve_storage_url
from loader_search.trial._run import MIN_MEASURED_BATCHES, batches_needed
from loader_search.trial._system import resolve_device, shm_bytes, usable_cpus
from loader_search.workloads import Workload, check_allowed, load_workload

if TYPE_CHECKING:
    import torch

__all__ = ["Reporter", "StudyInfo", "TrialEvent", "init_study", "run_study", "run_worker"]

DEFAULT_STUDY_NAME = "loader-search"
CONFIG_ATTR = "config"  # study attribute: the config document, for workers


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


def _fingerprint(config: StudyConfig, workload: Workload, spec: str) -> dict[str, Any]:
    """What a continued study must share with the one that created it: validation loss
    under other training settings would not compare. (Hardware is checked apart, per trial:
    see `_check_hardware`.)"""
    return {
        # How throughput is measured: warm-up to the early-stop mark (loader_search.trial._run).
        # Studies that earlier versions measured over the whole run do not compare.
        "throughput_window": "warmup-to-mark",
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
            "reuse_val_loss": config.training.reuse_val_loss,
        },
    }


def _environment() -> dict[str, Any]:
    import torch

    return {
        "torch_version": torch.__version__,
        "optuna_version": optuna.__version__,
        "python_version": platform.python_version(),
        "loader_search_version": __version__,
    }


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
    study.sampler = make_sampler(config, seed_offset=_seed_offset(study))
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


def _seed_offset(study: optuna.Study) -> int:
    """Shifts a continued study's sampler seed: by the trials it has (so it does not propose
    its first settings again) and by this process (so that workers joining at the same moment
    do not all propose the same settings)."""
    return len(study.get_trials(deepcopy=False)) + os.getpid() * 7919


def _check_hardware(study: optuna.Study, hardware: Hardware, allow_mixed: bool) -> list[str]:
    """Refuse early (before the workload is built) a machine of another class than the
    study's first trial; the worker checks again under the study lock before each trial."""
    bound = study.user_attrs.get(STUDY_HARDWARE_ATTR)
    if bound is None or bound == hardware.hardware_class:
        return []
    if not allow_mixed:
        raise hardware_mismatch(study.study_name, bound, hardware)
    return [
        f"mixed hardware: this machine is {hardware.hardware_class}, the study's first"
        f" trials ran on {bound}; results are reported per class"
    ]


def _pin(cpus: Sequence[int] | None, gpu: int | None, device_spec: str) -> str:
    """Pin this process (and so every trial it forks) to ``cpus`` and ``gpu``; returns the
    device spec to use. Called before anything asks CUDA about its devices."""
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        outside = sorted(set(cpus) - allowed)
        if not cpus or outside:
            raise UserError(
                f"--cpus {','.join(map(str, cpus))}: CPU(s) {outside or 'none'} are not"
                f" available to this process (it may use {_ranges(sorted(allowed))})"
            )
        os.sched_setaffinity(0, set(cpus))
    if gpu is None:
        return device_spec
    if device_spec == "cpu":
        raise UserError(f"--gpu {gpu} but the study trains on the CPU: leave --gpu out")
    count = gpu_count()
    if gpu < 0 or gpu >= count:
        raise UserError(f"--gpu {gpu}: this machine has {count} GPU(s) (0 .. {count - 1})")
    # Set before CUDA starts (in this process or the trials it forks): the trial then sees
    # one device, cuda:0.
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return "cuda"


def _this_machine(
    config: StudyConfig, cpus: Sequence[int] | None, gpu: int | None
) -> tuple[torch.device, Hardware]:
    """Pin this process, then resolve its device and describe the hardware its trials use
    (in that order: pinning must precede any question to CUDA)."""
    device = resolve_device(_pin(cpus, gpu, config.device))
    return device, collect(device.type, usable_cpus(), 1 if gpu is not None else None)


def _ranges(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    # The reporter speaks instead of Optuna's per-trial log lines.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def run_study(
    config: StudyConfig,
    *,
    workload: Workload | None = None,
    storage: str | None = None,
    n_trials: int | None = None,
    reporter: Reporter | None = None,
    cpus: Sequence[int] | None = None,
    gpu: int | None = None,
    allow_mixed_hardware: bool = False,
) -> StudySummary:
    """Create (or continue) the study ``config`` describes, run it, and summarise it.

    ``workload`` overrides ``config.workload``: the Python API passes one built in memory.
    ``n_trials`` sets the study's total trial budget, shared by every worker that joins;
    without it a new study takes ``config.trials`` and a continued one keeps the budget
    stored with it. ``cpus`` and ``gpu`` pin this process's trials (see `run_worker`).
    Bad input raises `UserError` before anything is stored.
    """
    reporter = reporter or NullReporter()
    with _quiet_optuna():
        # Everything that can be wrong with the input is checked before the storage is
        # touched; the device first, as pinning must precede any question to CUDA.
        device, hardware = _this_machine(config, cpus, gpu)
        study, info, workload, space = _create_or_continue(
            config, workload, storage, n_trials, reporter, hardware, allow_mixed_hardware
        )
        reporter.study_started(info)
        session = Session(
            study,
            config,
            workload,
            space,
            device,
            hardware,
            info.budget,
            cpus,
            gpu,
            allow_mixed_hardware,
        )
        work(session, reporter, timeout_s=config.timeout_s)
        return _summary(study, config.loss_tolerance, hardware)


def init_study(
    config: StudyConfig,
    *,
    workload: Workload | None = None,
    storage: str | None = None,
    n_trials: int | None = None,
    reporter: Reporter | None = None,
) -> StudyInfo:
    """Create (or update the budget of) the study ``config`` describes, and run nothing.

    For a team: one ``init`` creates the schema and the study before any worker starts
    (workers creating tables at once can race), then ``loader-search worker`` processes join.
    It needs no GPU: the study is bound to the hardware of its first trial, not of ``init``.
    """
    with _quiet_optuna():
        _, info, _, _ = _create_or_continue(
            config, workload, storage, n_trials, reporter or NullReporter(), None, False
        )
        return info


def _create_or_continue(
    config: StudyConfig,
    workload: Workload | None,
    storage: str | None,
    n_trials: int | None,
    reporter: Reporter,
    hardware: Hardware | None,
    allow_mixed_hardware: bool,
) -> tuple[optuna.Study, StudyInfo, Workload, ResolvedSpace]:
    if n_trials is not None and n_trials < 1:
        raise UserError(f"--n-trials {n_trials}: must be at least 1")
    url = resolve_storage_url(storage)
    ncpus = hardware.usable_cpus if hardware else usable_cpus()
    cuda = hardware is not None and hardware.device_type == "cuda"
    space = config.space.resolve(ncpus, cuda=cuda)
    check_budget(config.training, space)
    if workload is None:
        spec = config.workload
        reporter.preparing(f"building workload {spec} (its data and model)")
        workload = load_workload(config.workload, config.workload_options)
    else:
        spec = f"python:{workload.name}"  # built in memory by the caller
    if hardware is not None:
        space = _fit_to_machine(space, workload)
    name = config.name or DEFAULT_STUDY_NAME
    fingerprint = _fingerprint(config, workload, spec)

    shown = mask_url(url)
    reporter.preparing(f"opening storage {shown}")
    rdb = open_storage(
        url, heartbeat=config.heartbeat, on_stale=RetryStaleTrial(config.heartbeat.max_retry)
    )
    study, created = _open_study(rdb, name, config, fingerprint)
    notes = list(space.notes)
    if hardware is not None:
        notes += _check_hardware(study, hardware, allow_mixed_hardware)
    finished = count_finished(study)
    if n_trials is not None and n_trials < finished:
        raise UserError(
            f"--n-trials {n_trials} is below the {finished} trials study {name!r} already has;"
            f" give at least {finished}, or use `loader-search best {name}` to see its results"
        )
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
        if not created and study.user_attrs.get(FINGERPRINT_ATTR) is not None:
            notes.append(
                f"replaced study {name!r}'s stored config (no trial had completed under it);"
                " workers that join from now on use this one"
            )
        study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
        study.set_user_attr(CONFIG_ATTR, dict(config.document))
        study.set_user_attr("workload_description", workload.description)
        study.set_user_attr("sampler", config.sampler.name)
        for key, value in _environment().items():
            study.set_user_attr(key, value)
    study.set_user_attr(BUDGET_ATTR, budget)
    study.set_user_attr(TOLERANCE_ATTR, config.loss_tolerance)
    study.set_user_attr(
        CONFIRM_ATTR, {"top": config.confirm_top, "repeats": config.confirm_repeats}
    )
    info = StudyInfo(
        name=name,
        storage=shown,
        created=created,
        budget=budget,
        finished=finished,
        device=hardware.describe() if hardware else "",
        hardware_class=hardware.hardware_class if hardware else "",
        workload=workload.description or workload.name,
        usable_cpus=ncpus,
        notes=tuple(notes),
    )
    return study, info, workload, space


def _fit_to_machine(space: ResolvedSpace, workload: Workload) -> ResolvedSpace:
    """Drop loader settings whose batches cannot fit in this machine's /dev/shm (the
    messages land in ``space.notes``), as `loader-search doctor` reports them."""
    fitted, _ = fit_space(space, sample_bytes(workload), shm_bytes())
    return fitted


def _summary(study: optuna.Study, loss_tolerance: float, hardware: Hardware) -> StudySummary:
    """The whole study's results; only this machine's class when classes are mixed."""
    mixed = len(hardware_classes(study)) > 1
    return summarize(study, loss_tolerance, hardware.hardware_class if mixed else None)


def stored_config(study: optuna.Study) -> StudyConfig:
    """The config a study was created with, as `run` stored it for workers."""
    document = study.user_attrs.get(CONFIG_ATTR)
    if not document:
        raise UserError(
            f"study {study.study_name!r} has no stored config (it was not created by"
            " `loader-search run`, or was created from Python): start it with `loader-search"
            " run CONFIG --storage URL`, or call run_worker(..., config=...) from Python"
        )
    return parse_config(document, source=f"study {study.study_name!r}'s stored config")


def run_worker(
    study_name: str,
    *,
    storage: str | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
    workload: Workload | None = None,
    config: StudyConfig | None = None,
    reporter: Reporter | None = None,
    cpus: Sequence[int] | None = None,
    gpu: int | None = None,
    allow_mixed_hardware: bool = False,
    allow_plugins: Sequence[str] = (),
) -> StudySummary:
    """Join an existing study and run its trials until its budget (shared by every worker)
    is used, ``n_trials`` ran here, or ``timeout_s`` passed.

    The study's config comes from the study itself (``run`` stored it), so every worker
    trains the same workload with the same settings; ``config`` and ``workload`` override
    that for the Python API. By default a trial holds the whole host (one at a time per
    machine); ``cpus`` and ``gpu`` pin this worker's trials so that workers with disjoint
    sets can train side by side. A worker on hardware of another class than the study's
    first trial is refused unless ``allow_mixed_hardware``.

    The database is a team resource, and this machine may not trust everyone who can write
    to it: a workload taken from the study must be a built-in one or a plug-in this machine
    allows (``allow_plugins``, or ``$LOADER_SEARCH_ALLOW_PLUGINS``), checked before anything
    is imported. A ``config`` or ``workload`` passed here is this caller's own and trusted.
    """
    if n_trials is not None and n_trials < 1:
        raise UserError(f"--n-trials {n_trials}: must be at least 1")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(f"--timeout {timeout_s}: must be a positive number of seconds")
    reporter = reporter or NullReporter()
    with _quiet_optuna():
        url = resolve_storage_url(storage)
        shown = mask_url(url)
        reporter.preparing(f"opening storage {shown}")
        existing = open_existing_study(study_name, url)
        study = existing.study
        if config is None:
            config = stored_config(study)
            if workload is None:
                check_allowed(config.workload, allow_plugins)
        existing.rdb.engine.dispose()  # opened again below, with the study's heartbeat settings
        device, hardware = _this_machine(config, cpus, gpu)
        ncpus = hardware.usable_cpus
        space = config.space.resolve(ncpus, cuda=device.type == "cuda")
        mixed_notes = _check_hardware(study, hardware, allow_mixed_hardware)
        if workload is None:
            reporter.preparing(f"building workload {config.workload} (its data and model)")
            workload = load_workload(config.workload, config.workload_options)
        space = _fit_to_machine(space, workload)
        notes = list(space.notes) + mixed_notes
        # Again, now with heartbeats on (their settings are the study's).
        rdb = open_storage(
            url,
            must_exist=True,
            heartbeat=config.heartbeat,
            on_stale=RetryStaleTrial(config.heartbeat.max_retry),
        )
        study = optuna.load_study(study_name=study_name, storage=rdb)
        study.sampler = make_sampler(config, seed_offset=_seed_offset(study))
        budget = int(study.user_attrs.get(BUDGET_ATTR, config.trials))
        reporter.study_started(
            StudyInfo(
                name=study_name,
                storage=shown,
                created=False,
                budget=budget,
                finished=count_finished(study),
                device=hardware.describe(),
                hardware_class=hardware.hardware_class,
                workload=workload.description or workload.name,
                usable_cpus=ncpus,
                notes=tuple(notes),
            )
        )
        session = Session(
            study,
            config,
            workload,
            space,
            device,
            hardware,
            budget,
            cpus,
            gpu,
            allow_mixed_hardware,
        )
        work(session, reporter, max_trials=n_trials, timeout_s=timeout_s)
        tolerance = float(study.user_attrs.get(TOLERANCE_ATTR, config.loss_tolerance))
        return _summary(study, tolerance, hardware)


@dataclass(frozen=True)
class ExistingStudy:
    """A loader-search study opened for reading (``best``, ``report``) or joining (``worker``)."""

    study: optuna.Study
    rdb: optuna.storages.RDBStorage  # the storage it was opened with (no heartbeat)
    storage: str  # its URL with any password masked
    loss_tolerance: float  # the one asked for, else the study's stored one
    hardware_classes: tuple[str, ...]  # of its trials, in the order they first ran


def open_existing_study(
    name: str, storage: str | None = None, *, loss_tolerance: float | None = None
) -> ExistingStudy:
    """Open the existing loader-search study ``name`` at the URL ``storage`` (``None``: the
    default, see `resolve_storage_url`); `UserError` (one line) when there is no such study
    (naming the ones there are) or the study is not a loader-search one."""
    if loss_tolerance is not None and not (math.isfinite(loss_tolerance) and loss_tolerance >= 0):
        raise UserError(f"--loss-tolerance {loss_tolerance}: must be 0 or more, e.g. 0.05")
    url = resolve_storage_url(storage)
    opened, shown = open_storage(url, must_exist=True), mask_url(url)
    names = optuna.study.get_all_study_names(opened)
    if name not in names:
        known = ", ".join(names) if names else "none"
        raise UserError(
            f"no study named {name!r} in {shown} (studies there: {known});"
            " check the name or --storage, or create it with `loader-search run CONFIG`"
        )
    study = optuna.load_study(study_name=name, storage=opened)
    directions = [d.name.lower() for d in study.directions]
    if directions != list(DIRECTIONS) or FINGERPRINT_ATTR not in study.user_attrs:
        raise UserError(
            f"study {name!r} was not created by loader-search (it needs its two objectives,"
            " throughput and val_loss): pick one from `loader-search studies`"
        )
    if loss_tolerance is None:
        loss_tolerance = float(study.user_attrs.get(TOLERANCE_ATTR, StudyConfig().loss_tolerance))
    return ExistingStudy(study, opened, shown, loss_tolerance, tuple(hardware_classes(study)))
