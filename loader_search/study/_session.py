"""Creating, continuing and joining studies; the trials themselves run in `_worker`.

The study's trial budget (``[study] trials``, or ``--n-trials``) is a total stored with the
study and shared by every process that works on it: running the same study again continues
until the budget is used, so an interrupted run picks up where it stopped, and ``loader-search
worker`` processes on other machines join it. `run` stores its config document with the
study, so a worker needs nothing but the study's name and the database. `run` and `init` open
their study through `create_session`, `worker` through `join_session`; both leave opening it in
the storage to `loader_search.study._open`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import optuna

from loader_search._rules import RANGES
from loader_search._system import usable_cpus
from loader_search.errors import UserError
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study._events import LineReporter, NullReporter, Reporter, StudyInfo
from loader_search.study._keys import study_budget, study_tolerance
from loader_search.study._note import write_note
from loader_search.study._open import make_sampler, open_existing_study, open_study, seed_offset_of
from loader_search.study.config import (
    OwnCommand,
    StudyConfig,
    describe,
    fingerprint,
    settle_budget,
    store_settings,
    stored_config,
    trusted_config,
)
from loader_search.study.search import ResolvedSpace
from loader_search.study.stats import StudySummary, hardware_classes, summarize
from loader_search.study.work import (
    Machine,
    RetryStaleTrial,
    Session,
    check_hardware,
    command_space,
    count_finished,
    fit_to_machine,
    this_machine,
    work,
)
from loader_search.team import Hardware, mask_url, open_storage, resolve_storage_url, study_lock
from loader_search.trial import (
    MIN_MEASURED_BATCHES,
    FreshHost,
    WorkloadRecipe,
    batches_needed,
    can_isolate,
    resolve_ranks,
)
from loader_search.workloads import Workload, check_allowed, load_workload

if TYPE_CHECKING:
    import torch

__all__ = ["create_session", "init_study", "join_session", "run_study", "run_worker"]

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
        info, session = create_session(
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
        info, _ = create_session(
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
    allow_commands: Sequence[str] = (),
    own_command: OwnCommand | None = None,
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
    to it: a workload taken from the study must be a built-in or a plug-in this machine
    allows (``allow_plugins``, ``$LOADER_SEARCH_ALLOW_PLUGINS``), checked before any import;
    a command, one it names exactly (``allow_commands``), run as this worker says
    (``own_command``: see `trusted_command`). A ``config`` or ``workload`` passed here is
    this caller's own and trusted. Progress is printed as `run_study` prints it.
    """
    check_n_trials(n_trials)
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(f"--timeout {timeout_s}: must be a positive number of seconds")
    reporter = _reporter(reporter, quiet)
    with _quiet_optuna():
        info, session = join_session(
            study_name,
            config,
            reporter,
            Machine(cpus, gpu, allow_mixed_hardware),
            workload=workload,
            storage=storage,
            allow_plugins=allow_plugins,
            allow_commands=allow_commands,
            own_command=own_command,
        )
        reporter.study_started(info)
        work(session, reporter, max_trials=n_trials, timeout_s=timeout_s)
        study = session.study
        tolerance = study_tolerance(
            study.study_name, study.user_attrs, session.config.loss_tolerance
        )
        _leave_note(session, tolerance, reporter)
        return _summary(study, tolerance, session.hardware)


def create_session(
    config: StudyConfig,
    reporter: Reporter,
    *,
    workload: Workload | None = None,
    storage: str | None = None,
    budget: int | None = None,
    machine: Machine | None = None,
) -> tuple[StudyInfo, Session | None]:
    """Create or continue the study ``config`` describes (`run`, `init`), and build what a
    worker needs to run its trials.

    ``budget`` (``--n-trials``) becomes its total trial budget (without it a new study takes
    ``config.trials``, a continued one keeps the budget stored with it), and the settings are
    stored for workers. ``workload`` (the Python API's, built in memory) is the caller's own.

    ``machine``: how this process runs trials; it is pinned, its device resolved, the space
    fitted to its /dev/shm and its hardware checked against the study's class. None when no
    trial runs here (`init`): then no device is touched and no `Session` is returned.

    Input that can be wrong is checked before the storage is written: the device first, as
    pinning must precede any question to CUDA.
    """
    here = this_machine(config, machine) if machine is not None else None
    check_n_trials(budget)
    url = resolve_storage_url(storage)
    hardware = here[1] if here is not None else None
    space, ranks, ncpus = _resolved_space(config, hardware)
    check_budget(config.training, space, ranks)
    fresh = _fresh_host(config, workload, here)
    try:
        workload, spec, recipe = _workload(config, workload, reporter)
        if hardware is not None:
            space = fit_to_machine(space, workload, ranks)
        notes = list(space.notes)
        reporter.preparing(f"opening storage {mask_url(url)}")
        rdb = _open_rdb(url, config, reporter, must_exist=False)
        name = config.name or DEFAULT_STUDY_NAME
        stamp = fingerprint(config, workload, spec)
        study, created = open_study(rdb, name, config, stamp)
        if hardware is not None and here is not None:
            notes += check_hardware(study, hardware, _allows_mixed(machine))
            space, found = command_space(study, config, space, here[0], ranks, reporter.preparing)
            notes += found
        finished = count_finished(study)
        budget, budget_notes = settle_budget(study, config, budget, finished, created)
        notes += budget_notes
        notes += store_settings(study, config, workload, stamp, created, budget)
        what = describe(config, workload)
        info = _info(study, url, created, budget, finished, what, hardware, ncpus, notes)
        if here is None or machine is None:
            return info, None  # `init`: no trial runs here
        return info, _session(
            study, rdb, config, workload, recipe, space, here, budget, machine, fresh
        )
    except BaseException:
        fresh.close()  # the session would have owned it
        raise


def join_session(
    name: str,
    config: StudyConfig | None,
    reporter: Reporter,
    machine: Machine,
    *,
    workload: Workload | None = None,
    storage: str | None = None,
    allow_plugins: Sequence[str] = (),
    allow_commands: Sequence[str] = (),
    own_command: OwnCommand | None = None,
) -> tuple[StudyInfo, Session]:
    """Join the existing study ``name`` (`worker`), and build what this worker needs to run
    its trials on ``machine`` (pinned, its device resolved, the space fitted to its /dev/shm).

    The study's stored budget and settings are used and left as they are, and its config is
    the stored one unless ``config`` is given; a workload taken from the database must be
    one this machine allows (see `run_worker`), checked before anything imports it. The
    hardware class is checked before the workload is built.
    """
    url = resolve_storage_url(storage)
    reporter.preparing(f"opening storage {mask_url(url)}")
    existing = open_existing_study(name, url, on_busy=reporter.warning)
    if config is None:
        config = stored_config(existing.study)
        if workload is None and config.command is not None:  # others write this database
            config = trusted_config(config, allow_commands, own_command)
        elif workload is None:
            # Others write this database: refuse a workload spec before importing it.
            check_allowed(config.workload, allow_plugins)
    here = this_machine(config, machine)
    hardware = here[1]
    space, ranks, ncpus = _resolved_space(config, hardware)
    mixed = check_hardware(existing.study, hardware, _allows_mixed(machine))  # before the build
    fresh = _fresh_host(config, workload, here)
    try:
        workload, _, recipe = _workload(config, workload, reporter)
        space = fit_to_machine(space, workload, ranks)
        notes = [*space.notes, *mixed]
        # Opened again with the study's heartbeat settings: its connections are closed
        # first, so that a worker never holds more than two.
        existing.rdb.engine.dispose()
        rdb = _open_rdb(url, config, reporter, must_exist=True)
        name = existing.study.study_name
        study = optuna.load_study(study_name=name, storage=rdb)
        study.sampler = make_sampler(config, seed_offset=seed_offset_of(study))
        space, found = command_space(study, config, space, here[0], ranks, reporter.preparing)
        notes += found
        budget = study_budget(name, study.user_attrs, config.trials)
        finished = count_finished(study)
        what = describe(config, workload)
        info = _info(study, url, False, budget, finished, what, hardware, ncpus, notes)
        return info, _session(
            study, rdb, config, workload, recipe, space, here, budget, machine, fresh
        )
    except BaseException:
        fresh.close()  # the session would have owned it
        raise


def _allows_mixed(machine: Machine | None) -> bool:
    return machine is not None and machine.allow_mixed_hardware


def _resolved_space(
    config: StudyConfig, hardware: Hardware | None
) -> tuple[ResolvedSpace, int, int]:
    """The config's space on this machine (its ranks, its usable CPUs) and those two: without
    a machine (`init`), this host's CPUs."""
    ncpus = hardware.usable_cpus if hardware else usable_cpus()
    cuda = hardware is not None and hardware.device_type == "cuda"
    # num_workers and torch threads are per rank: each rank's share of the node's CPUs.
    ranks = resolve_ranks(config.training.ranks, "cuda" if cuda else "cpu")
    return config.space.resolve(max(1, ncpus // ranks), cuda=cuda), ranks, ncpus


def _workload(
    config: StudyConfig, workload: Workload | None, reporter: Reporter
) -> tuple[Workload | None, str, WorkloadRecipe | None]:
    """The study's workload, its spec, and how a fresh process rebuilds it: built from the
    config, or the caller's own (which no process can rebuild); None for a command (every
    trial of one is a process of its own)."""
    if config.command is not None and workload is None:
        return None, config.workload, None
    if workload is not None:
        return workload, f"python:{workload.name}", None  # built in memory by the caller
    reporter.preparing(f"building workload {config.workload} (its data and model)")
    built = load_workload(config.workload, config.workload_options)
    return built, config.workload, _recipe(config)


def _recipe(config: StudyConfig) -> WorkloadRecipe:
    return WorkloadRecipe(config.workload, dict(config.workload_options))


def _fresh_host(
    config: StudyConfig, workload: Workload | None, here: tuple[torch.device, Hardware] | None
) -> FreshHost:
    """The fresh process this worker's confirmation trials will train in (``study.
    confirm_process = "fresh"``, `loader_search.study.work._worker`), started now: its imports and
    its build run beside this worker's own, instead of in the first confirmation trial
    (`FreshHost.prepare`; `work` waits for it before the first trial). It only idles in a
    worker that never confirms. Not started where no trial runs here (`init`), for a
    workload built in memory (no process can rebuild it), without confirmation, or where
    trials are not isolated."""
    host = FreshHost()
    if (
        here is not None
        and workload is None
        and config.command is None
        and config.confirm_top > 0
        and config.confirm_process == "fresh"
        and can_isolate()
    ):
        host.prepare(_recipe(config), str(here[0]))
    return host


def _open_rdb(
    url: str, config: StudyConfig, reporter: Reporter, *, must_exist: bool
) -> optuna.storages.RDBStorage:
    """The storage trials run in, with heartbeats on (their settings are the study's)."""
    return open_storage(
        url,
        must_exist=must_exist,
        workers=config.workers,
        on_stale=RetryStaleTrial(config.workers.max_retry),
        on_busy=reporter.warning,
    )


def _info(
    study: optuna.Study,
    url: str,
    created: bool,
    budget: int,
    finished: int,
    workload: str,
    hardware: Hardware | None,
    ncpus: int,
    notes: Sequence[str],
) -> StudyInfo:
    return StudyInfo(
        name=study.study_name,
        storage=mask_url(url),
        created=created,
        budget=budget,
        finished=finished,
        device=hardware.describe() if hardware else "",
        hardware_class=hardware.hardware_class if hardware else "",
        workload=workload,
        usable_cpus=ncpus,
        notes=tuple(notes),
    )


def _session(
    study: optuna.Study,
    rdb: optuna.storages.RDBStorage,
    config: StudyConfig,
    workload: Workload | None,
    recipe: WorkloadRecipe | None,
    space: ResolvedSpace,
    here: tuple[torch.device, Hardware],
    budget: int,
    machine: Machine,
    fresh: FreshHost,
) -> Session:
    device, hardware = here
    return Session(
        fresh=fresh,
        study=study,
        config=config,
        workload=workload,
        recipe=recipe,
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
