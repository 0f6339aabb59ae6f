"""Creating, continuing and joining studies; the trials themselves run in `_worker`.

The study's trial budget (``[study] trials``, or ``--n-trials``) is a total stored with the
study and shared by every process that works on it: running the same study again continues
until the budget is used, so an interrupted run picks up where it stopped, and ``loader-search
worker`` processes on other machines join it. `run` stores its config document with the
study, so a worker needs nothing but the study's name and the database. `run`, `init` and
`worker` all open their study through `prepare_session`.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from loader_search.errors import UserError
from loader_search.params import RANGES, LoaderParams, TrainingSettings
from loader_search.study._config import StudyConfig
from loader_search.study._events import LineReporter, NullReporter, Reporter, Session, StudyInfo
from loader_search.study._heartbeats import RetryStaleTrial
from loader_search.study._keys import (
    DIRECTIONS,
    FINGERPRINT_ATTR,
    METRIC_NAMES,
    study_budget,
    study_tolerance,
)
from loader_search.study._machine import Machine, check_hardware, fit_to_machine, this_machine
from loader_search.study._note import write_note
from loader_search.study._recommend import StudySummary, hardware_classes, summarize
from loader_search.study._space import ResolvedSpace
from loader_search.study._stored import fingerprint, settle_budget, store_settings, stored_config
from loader_search.study._worker import count_finished, work
from loader_search.team._hardware import Hardware
from loader_search.team._locks import study_lock
from loader_search.team._storage import mask_url, open_storage, resolve_storage_url
from loader_search.trial._ranks import resolve_ranks
from loader_search.trial._run import MIN_MEASURED_BATCHES, batches_needed
from loader_search.trial._system import usable_cpus
from loader_search.workloads import Workload, check_allowed, load_workload

if TYPE_CHECKING:
    import torch

__all__ = ["init_study", "prepare_session", "run_study", "run_worker"]

DEFAULT_STUDY_NAME = "loader-search"


def check_budget(settings: TrainingSettings, space: ResolvedSpace, ranks: int = 1) -> None:
    """Refuse a training budget too small to measure the largest batch size's steady state
    (on each of ``ranks`` ranks, which share the budget)."""
    batch = max(space.batch_sizes)
    worst = LoaderParams(
        batch_size=batch,
        num_workers=space.num_workers.high,
        prefetch_factor=space.prefetch_factor.high if space.num_workers.high else None,
    )
    needed = batches_needed(worst, settings.warmup_batches)
    if math.ceil(settings.train_samples / ranks / batch) < needed:
        per_rank = f" on each of {ranks} ranks" if ranks > 1 else ""
        raise UserError(
            f"training.train_samples = {settings.train_samples} is too small: batch size"
            f" {batch} with {worst.num_workers} workers x prefetch {worst.prefetch_factor}"
            f" needs {needed} batches{per_rank} (warm-up + {MIN_MEASURED_BATCHES} measured);"
            f" raise it to at least {needed * batch * ranks} or lower space.batch_size /"
            " prefetch_factor max"
        )


def check_n_trials(n_trials: int | None) -> None:
    """``--n-trials`` obeys the rule of ``[study] trials`` (1 to 100,000)."""
    problem = None if n_trials is None else RANGES["study.trials"].problem(n_trials)
    if problem is not None:
        raise UserError(f"--n-trials {n_trials}: {problem}")


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


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    # The reporter speaks instead of Optuna's per-trial log lines.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _reporter(reporter: Reporter | None, quiet: bool) -> Reporter:
    """Who hears a study's progress: the caller's ``reporter``, else plain lines on standard
    error (a notebook or a script shows them), else, ``quiet``, nobody."""
    if reporter is not None:
        return reporter
    return NullReporter() if quiet else LineReporter()


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
    quiet: bool = False,
) -> StudySummary:
    """Create (or continue) the study ``config`` describes, run it, and summarise it.

    ``workload`` overrides ``config.workload``: the Python API passes one built in memory.
    ``n_trials`` sets the study's total trial budget, shared by every worker that joins;
    without it a new study takes ``config.trials`` and a continued one keeps the budget
    stored with it. ``cpus`` and ``gpu`` pin this process's trials (see `run_worker`).
    Bad input raises `UserError` before anything is stored.

    Progress (each step, each trial's start and result, warnings) is printed as plain lines
    to standard error (`LineReporter`); ``quiet=True`` prints nothing, and ``reporter``
    receives it instead (any object with `Reporter`'s methods).
    """
    reporter = _reporter(reporter, quiet)
    with _quiet_optuna():
        info, session = prepare_session(
            config,
            reporter,
            workload=workload,
            storage=storage,
            budget=n_trials,
            machine=Machine(cpus, gpu, allow_mixed_hardware),
        )
        assert session is not None  # a machine was given
        reporter.study_started(info)
        work(session, reporter, timeout_s=config.timeout_s)
        _leave_note(session, config.loss_tolerance, reporter)
        return _summary(session.study, config.loss_tolerance, session.hardware)


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
        info, _ = prepare_session(
            config, reporter or NullReporter(), workload=workload, storage=storage, budget=n_trials
        )
        return info


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
    quiet: bool = False,
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

    Progress is printed as `run_study` prints it (``quiet``, ``reporter``).
    """
    check_n_trials(n_trials)
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(f"--timeout {timeout_s}: must be a positive number of seconds")
    reporter = _reporter(reporter, quiet)
    with _quiet_optuna():
        info, session = prepare_session(
            config,
            reporter,
            join=study_name,
            workload=workload,
            storage=storage,
            machine=Machine(cpus, gpu, allow_mixed_hardware),
            allow_plugins=allow_plugins,
        )
        assert session is not None  # a machine was given
        reporter.study_started(info)
        work(session, reporter, max_trials=n_trials, timeout_s=timeout_s)
        study = session.study
        tolerance = study_tolerance(
            study.study_name, study.user_attrs, session.config.loss_tolerance
        )
        _leave_note(session, tolerance, reporter)
        return _summary(study, tolerance, session.hardware)


def prepare_session(
    config: StudyConfig | None,
    reporter: Reporter,
    *,
    join: str | None = None,
    workload: Workload | None = None,
    storage: str | None = None,
    budget: int | None = None,
    machine: Machine | None = None,
    allow_plugins: Sequence[str] = (),
) -> tuple[StudyInfo, Session | None]:
    """Open the study that trials will run in, and build what a worker needs to run them.

    Without ``join``: create or continue the study ``config`` describes (`run`, `init`);
    ``budget`` (``--n-trials``) becomes its total trial budget (without it a new study takes
    ``config.trials``, a continued one keeps the budget stored with it), and the settings are
    stored for workers. With ``join``, the name of an existing study (`worker`): its stored
    budget and settings are used and left as they are, and its config is the stored one
    unless ``config`` is given; a workload taken from the database must be one this machine
    allows (``allow_plugins``, see `check_allowed`), checked before anything imports it.
    ``workload`` (the Python API's, built in memory) is the caller's own and trusted.

    ``machine``: how this process runs trials; it is pinned, its device resolved, the space
    fitted to its /dev/shm and its hardware checked against the study's class. None when no
    trial runs here (`init`): then no device is touched and no `Session` is returned.

    Input that can be wrong is checked before the storage is written (``run``: the device
    first, as pinning must precede any question to CUDA; ``worker``: the allow-list before
    any import, the hardware class before the workload is built).
    """
    here: tuple[torch.device, Hardware] | None = None
    if join is None:
        if config is None:
            raise TypeError("prepare_session: a new or continued study needs its config")
        if machine is not None:
            # The device first, as pinning must precede any question to CUDA.
            here = this_machine(config, machine)
        check_n_trials(budget)
        url = resolve_storage_url(storage)
        existing = None
    else:
        if budget is not None:
            raise TypeError("prepare_session: a joining worker keeps the study's budget")
        url = resolve_storage_url(storage)
        reporter.preparing(f"opening storage {mask_url(url)}")
        existing = open_existing_study(join, url, on_busy=reporter.warning)
        if config is None:
            config = stored_config(existing.study)
            if workload is None:
                # Others write this database: refuse a workload spec before importing it.
                check_allowed(config.workload, allow_plugins)
        if machine is not None:
            here = this_machine(config, machine)
    hardware = here[1] if here is not None else None
    allow_mixed = machine is not None and machine.allow_mixed_hardware
    ncpus = hardware.usable_cpus if hardware else usable_cpus()
    cuda = hardware is not None and hardware.device_type == "cuda"
    # num_workers and torch threads are per rank: each rank's share of the node's CPUs.
    ranks = resolve_ranks(config.training.ranks, "cuda" if cuda else "cpu")
    space = config.space.resolve(max(1, ncpus // ranks), cuda=cuda)
    mixed: list[str] = []
    if existing is None:
        check_budget(config.training, space, ranks)
    elif hardware is not None:
        mixed = check_hardware(existing.study, hardware, allow_mixed)  # before the build
    if workload is None:
        spec = config.workload
        reporter.preparing(f"building workload {spec} (its data and model)")
        workload = load_workload(config.workload, config.workload_options)
    else:
        spec = f"python:{workload.name}"  # built in memory by the caller
    if hardware is not None:
        space = fit_to_machine(space, workload, ranks)
    notes = [*space.notes, *mixed]

    shown = mask_url(url)
    if existing is None:
        reporter.preparing(f"opening storage {shown}")
    else:
        # Opened again below with the study's heartbeat settings: its connections are closed
        # first, so that a worker never holds more than two.
        existing.rdb.engine.dispose()
    # With heartbeats on (their settings are the study's); a joining worker opened it before.
    rdb = open_storage(
        url,
        must_exist=existing is not None,
        workers=config.workers,
        on_stale=RetryStaleTrial(config.workers.max_retry),
        on_busy=reporter.warning,
    )
    if existing is None:
        name = config.name or DEFAULT_STUDY_NAME
        stamp = fingerprint(config, workload, spec)
        study, created = _open_study(rdb, name, config, stamp)
        if hardware is not None:
            notes += check_hardware(study, hardware, allow_mixed)
        finished = count_finished(study)
        budget, budget_notes = settle_budget(study, config, budget, finished, created)
        notes += budget_notes
        notes += store_settings(study, config, workload, stamp, created, budget)
    else:
        name, created = existing.study.study_name, False
        study = optuna.load_study(study_name=name, storage=rdb)
        study.sampler = make_sampler(config, seed_offset=_seed_offset(study))
        budget = study_budget(name, study.user_attrs, config.trials)
        finished = count_finished(study)
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
    if here is None or machine is None:
        return info, None  # `init`: no trial runs here
    device, hardware = here
    return info, Session(
        study=study,
        config=config,
        workload=workload,
        space=space,
        device=device,
        hardware=hardware,
        budget=budget,
        rdb=rdb,
        study_id=rdb.get_study_id_from_name(study.study_name),
        cpus=machine.cpus,
        gpu=machine.gpu,
        allow_mixed_hardware=machine.allow_mixed_hardware,
    )


def _leave_note(session: Session, loss_tolerance: float, reporter: Reporter) -> None:
    """The study's answer as its optuna-dashboard note (see `loader_search.study._note`),
    under the study lock; a failure costs the note, never the results."""
    try:
        with study_lock(session.rdb.engine, session.study_id):
            write_note(session.study, loss_tolerance)
    except Exception as exc:  # the trials are stored: say so and go on
        reporter.warning(f"cannot write the dashboard note: {type(exc).__name__}: {exc}")


def _summary(study: optuna.Study, loss_tolerance: float, hardware: Hardware) -> StudySummary:
    """The whole study's results; only this machine's class when classes are mixed."""
    mixed = len(hardware_classes(study)) > 1
    return summarize(study, loss_tolerance, hardware.hardware_class if mixed else None)


@dataclass(frozen=True)
class ExistingStudy:
    """A loader-search study opened for reading (``best``, ``report``) or joining (``worker``)."""

    study: optuna.Study
    rdb: optuna.storages.RDBStorage  # the storage it was opened with (no heartbeat)
    storage: str  # its URL with any password masked
    loss_tolerance: float  # the one asked for, else the study's stored one
    hardware_classes: tuple[str, ...]  # of its trials, in the order they first ran


def open_existing_study(
    name: str,
    storage: str | None = None,
    *,
    loss_tolerance: float | None = None,
    on_busy: Callable[[str], None] | None = None,
) -> ExistingStudy:
    """Open the existing loader-search study ``name`` at the URL ``storage`` (``None``: the
    default, see `resolve_storage_url`); `UserError` (one line) when there is no such study
    (naming the ones there are) or the study is not a loader-search one. ``on_busy`` hears
    of each wait for a server that refuses connections for now (see `open_storage`)."""
    if loss_tolerance is not None and not (math.isfinite(loss_tolerance) and loss_tolerance >= 0):
        raise UserError(f"--loss-tolerance {loss_tolerance}: must be 0 or more, e.g. 0.05")
    url = resolve_storage_url(storage)
    opened, shown = open_storage(url, must_exist=True, on_busy=on_busy), mask_url(url)
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
        default = StudyConfig().loss_tolerance
        loss_tolerance = study_tolerance(name, study.user_attrs, default)
    return ExistingStudy(study, opened, shown, loss_tolerance, tuple(hardware_classes(study)))
