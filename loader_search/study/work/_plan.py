"""Planning a taken trial: what it runs, decided in one place and handed down as one `Job`.

A trial's settings are sampled when it is taken (`loader_search.study.work._take`); `plan_job`
then decides, from the study's finished trials, everything the trial runs with, and the
worker runs the job as it is (`loader_search.study.work._worker`).

**Memory.** On the same hardware, settings that need at least the memory of ones that already
ran out (`known_failure`) are not trained: the trial fails as infeasible at once. With
``gradient_accumulation = "auto"`` a batch that a known out-of-memory rules out trains instead
as accumulated micro-batches (`fit_in_memory`), and one that runs out while it trains is run
again at once as twice as many micro-batches of half (`smaller_job`): the same effective batch.

**Validation loss.** Loader settings do not change what the model learns: every trial trains
the same model from the same weights on the same samples in the same order (see
`loader_search.trial._loader.build_loader`) with the learning rate of its batch size. Batch size
(and the training settings, which a study fixes) decides the validation loss; ``num_workers``,
``prefetch_factor``, ``pin_memory``, ``persistent_workers`` and the thread count only decide
how fast the batches arrive. So once a trial of a batch size has trained its whole budget and
been evaluated, a later trial of that batch size trains only long enough to read its
throughput (`loader_search.trial._run.short_run_samples`), skips the evaluation, and reports the
median validation loss of the evaluated trials of its batch size, naming them in
``val_loss_from``. Multi-objective studies cannot be pruned in Optuna, and this is the early
stop that fits the problem: what is saved is the convergence part, which the loader does not
affect. `benchmarks/` measures both the saving and the search quality with and without it.

**Ceiling.** The throughput of the model on pre-decoded batches already on the device depends
on batch size and thread count only: measured once per pair, then reused, unless the reading
cannot be trusted: it was taken while other processes kept more than `BUSY_LIMIT` of the
machine's CPUs busy, or a trial of the pair has since trained faster than it (by more than
`BEATEN_BY`: no loader beats the model fed from memory, so that reading was low). Then the
next trial of the pair reads the ceiling again; the readings left are combined by their
median. After `MAX_CEILING_READINGS` readings of a pair none of which is trusted, the highest
stands, and a trial above it shows an efficiency over 100%, flagged where it is shown.

Only trials of the same hardware class are reused (a GPU's numerics differ from a CPU's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams, RunPlan, TrainingSettings
from loader_search.study._keys import (
    CEILING_ATTR,
    CEILING_LOAD_ATTR,
    CONFIRMATION_ATTR,
    FAILURE_REASON,
    HARDWARE_CLASS_ATTR,
    INFERRED_FROM,
    INFERRED_OOM,
    MEASURED_OOM_REASONS,
    OOM_ATTEMPTS_ATTR,
    OOM_REASONS,
    VAL_LOSS_ATTR,
    number,
    stored_params,
)
from loader_search.study._points import is_feasible
from loader_search.study.work._session_state import Session
from loader_search.trial import TrialFailure, TrialJob, WorkloadRecipe, short_run_samples

# Trial user attributes (the measurements themselves are `TrialResult` fields).
BUSY_LIMIT = 0.25  # of the machine's CPUs, used by other processes during a ceiling reading
BEATEN_BY = 0.02  # a trial this much faster than a ceiling reading shows the reading was low
MAX_CEILING_READINGS = 3  # per batch size and thread count: then the highest one is used


@dataclass(frozen=True)
class Reuse:
    """What one trial measures itself (``plan``) and what it takes from earlier trials."""

    plan: RunPlan
    val_loss: float | None = None  # known for this batch size: the trial stops early
    val_loss_from: tuple[int, ...] = ()
    ceiling: float | None = None  # known for this batch size and thread count
    ceiling_from: tuple[int, ...] = ()


def trusted_ceiling(trial: FrozenTrial, fastest: float) -> bool:
    """Whether ``trial``'s ceiling reading may be reused, ``fastest`` being the best
    throughput a trial of its batch size and thread count has reached (see the module
    docstring)."""
    reading = number(trial.user_attrs, CEILING_ATTR)
    if reading is None or reading <= 0:
        return False
    load = number(trial.user_attrs, CEILING_LOAD_ATTR)
    if load is not None and load > BUSY_LIMIT:
        return False
    return fastest <= reading * (1 + BEATEN_BY)


def plan_trial(
    trials: Sequence[FrozenTrial],
    params: LoaderParams,
    settings: TrainingSettings,
    hardware_class: str | None,
    train_size: int | None,
    *,
    reuse_val_loss: bool = True,
) -> Reuse:
    """Decide how ``params``'s trial runs, given the study's finished ``trials``."""
    same_batch = []  # completed feasible trials of this batch size on this hardware class
    for t in trials:
        if t.state != TrialState.COMPLETE or not is_feasible(t):
            continue
        if t.user_attrs.get(HARDWARE_CLASS_ATTR) != hardware_class:
            continue
        other = stored_params(t)
        # Accumulated micro-batches see other BatchNorm statistics than the whole batch.
        if other is not None and (other.batch_size, other.accumulation_steps) == (
            params.batch_size,
            params.accumulation_steps,
        ):
            same_batch.append((t, other))
    evaluated = [t for t, _ in same_batch if VAL_LOSS_ATTR in t.user_attrs]
    pair = [(t, other) for t, other in same_batch if other.torch_threads == params.torch_threads]
    fastest = max((t.values[0] for t, _ in pair if t.values), default=0.0)
    with_ceiling = [t for t, _ in pair if trusted_ceiling(t, fastest)]
    readings = [t for t, _ in pair if number(t.user_attrs, CEILING_ATTR)]
    if not with_ceiling and len(readings) >= MAX_CEILING_READINGS:
        # Read often enough: the highest reading stands (a loader beating it is flagged).
        with_ceiling = [max(readings, key=lambda t: float(t.user_attrs[CEILING_ATTR]))]
    short = short_run_samples(params, settings, train_size)
    val_loss = None
    if reuse_val_loss and evaluated:
        val_loss = statistics.median(float(t.user_attrs[VAL_LOSS_ATTR]) for t in evaluated)
    ceiling = None
    if with_ceiling:
        ceiling = statistics.median(float(t.user_attrs[CEILING_ATTR]) for t in with_ceiling)
    return Reuse(
        plan=RunPlan(
            short_samples=short,
            stop_early=val_loss is not None,
            measure_ceiling=ceiling is None,
        ),
        val_loss=val_loss,
        val_loss_from=tuple(t.number for t in evaluated) if val_loss is not None else (),
        ceiling=ceiling,
        ceiling_from=tuple(t.number for t in with_ceiling),
    )


# Micro-batches smaller than this are not tried: BatchNorm cannot train on one sample.
MIN_MICRO_BATCH = 2


def footprint(params: LoaderParams) -> tuple[int, int]:
    """What memory grows with: the micro-batch (the DataLoader's batch size) and the number of
    micro-batches in flight in the loader."""
    return params.micro_batch_size, params.batches_in_flight


def oom_attempt(params: LoaderParams, failure: TrialFailure) -> dict[str, object]:
    """One entry of a trial's ``oom_attempts``: a micro-batch that ran out of memory before
    the trial trained with more accumulation steps."""
    micro, in_flight = footprint(params)
    return {"micro_batch_size": micro, "in_flight": in_flight, "reason": failure.reason}


def _known_ooms(
    trials: Sequence[FrozenTrial], hardware_class: str | None
) -> list[tuple[int, int, int]]:
    """Every footprint that ran out of memory on this hardware, with the trial that shows it:
    trials that failed so, and the attempts that trials trained past by accumulating."""
    known = []
    for trial in trials:
        if trial.user_attrs.get(HARDWARE_CLASS_ATTR) != hardware_class:
            continue
        source = int(trial.user_attrs.get(INFERRED_FROM, trial.number))
        if trial.user_attrs.get(FAILURE_REASON) in OOM_REASONS:
            other = stored_params(trial)
            if other is not None:
                known.append((*footprint(other), source))
        attempts = trial.user_attrs.get(OOM_ATTEMPTS_ATTR)
        for attempt in attempts if isinstance(attempts, list) else ():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                known.append((int(attempt["micro_batch_size"]), int(attempt["in_flight"]), source))
    return known


def known_failure(
    trials: Sequence[FrozenTrial], params: LoaderParams, hardware_class: str | None
) -> tuple[TrialFailure, int] | None:
    """An out-of-memory verdict inferred without training, with the number of the trial that
    really ran out of memory; or None.

    On the same hardware, settings that need at least as much memory as ones that already ran
    out (same or larger micro-batch, and same or more ``num_workers * prefetch_factor``
    micro-batches in flight) would run out again: training them would only cost time.
    """
    batch, in_flight = footprint(params)
    for other_batch, other_in_flight, source in _known_ooms(trials, hardware_class):
        if batch >= other_batch and in_flight >= other_in_flight:
            failure = TrialFailure(
                reason=INFERRED_OOM,
                message=(
                    f"not trained: needs at least the memory of trial #{source}"
                    f" (batch {other_batch}, {other_in_flight} batches in flight), which ran"
                    " out of memory on this hardware"
                ),
                hint="smaller batch sizes or fewer workers x prefetch fit",
                traceback="",
                infeasible=True,
            )
            return failure, source
    return None


def fewer_samples_per_step(params: LoaderParams) -> LoaderParams | None:
    """``params`` with twice the accumulation steps (half the micro-batch), or None when the
    micro-batch cannot be halved any more."""
    steps = params.accumulation_steps * 2
    if params.batch_size % steps or params.batch_size // steps < MIN_MICRO_BATCH:
        return None
    return dataclasses.replace(params, accumulation_steps=steps)


def fit_in_memory(
    trials: Sequence[FrozenTrial], params: LoaderParams, hardware_class: str | None
) -> tuple[LoaderParams, int | None]:
    """``params`` with the fewest accumulation steps whose footprint no known out-of-memory
    failure rules out, with the trial whose failure made it accumulate (None when nothing
    did); ``params`` unchanged when no micro-batch fits (`known_failure` then says why)."""
    fitted, source = params, None
    while (known := known_failure(trials, fitted, hardware_class)) is not None:
        smaller = fewer_samples_per_step(fitted)
        if smaller is None:
            return params, None
        fitted, source = smaller, known[1]
    return fitted, source


@dataclass(frozen=True)
class Job:
    """A taken trial and everything it runs with, planned in one place (`plan_job`) and
    handed down whole: its settings as they train, what it takes from the trials before it
    (``reuse``), and the job its process trains (``run``); or, instead of a run, the
    out-of-memory already known for those settings (``inferred``: the failure, and the trial
    that really ran out)."""

    trial: optuna.Trial
    params: LoaderParams
    reuse: Reuse
    run: TrialJob | None  # None: ``inferred`` says why nothing trains
    inferred: tuple[TrialFailure, int] | None = None
    # A confirmation trial's recipe: it trains in a fresh process that builds the workload
    # (`fresh_recipe`); None: forked from this worker.
    fresh: WorkloadRecipe | None = None
    forced_by: int | None = None  # the trial whose out-of-memory made it accumulate
    # The micro-batches of this trial that ran out of memory before (`OOM_ATTEMPTS_ATTR`).
    attempts: tuple[dict[str, object], ...] = ()
    ended: tuple[FrozenTrial, ...] = dataclasses.field(default=(), repr=False)  # planned on


def plan_job(
    session: Session, trial: optuna.Trial, params: LoaderParams, trials: Sequence[FrozenTrial]
) -> Job:
    """The `Job` of the taken ``trial`` with its sampled ``params``, planned on the study's
    ``trials`` as read when it was taken: fitted in memory, its failure inferred when a
    known out-of-memory rules it out, its reuse planned."""
    ended = tuple(t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL))
    hardware_class = session.hardware.hardware_class
    forced_by = None
    if accumulates(session):
        params, forced_by = fit_in_memory(ended, params, hardware_class)
    fresh = None
    if trial.user_attrs.get(CONFIRMATION_ATTR):
        fresh = fresh_recipe(session.recipe, session.config.confirm_process)
    inferred = known_failure(ended, params, hardware_class)
    reuse = _reuse(session, ended, params)
    job = Job(trial, params, reuse, None, inferred, fresh, forced_by, ended=ended)
    return job if inferred is not None else _with_run(session, job)


def smaller_job(session: Session, job: Job, failure: TrialFailure) -> Job | None:
    """After ``job`` ran out of memory (``failure``), the same batch as twice as many
    micro-batches of half, replanned; None where it is not retried (another failure, no
    accumulation, or a micro-batch that cannot halve)."""
    if failure.reason not in MEASURED_OOM_REASONS or not accumulates(session):
        return None
    smaller = fewer_samples_per_step(job.params)
    if smaller is None:
        return None
    again = dataclasses.replace(
        job,
        params=smaller,
        reuse=_reuse(session, job.ended, smaller),
        attempts=(*job.attempts, oom_attempt(job.params, failure)),
    )
    return _with_run(session, again)


def _reuse(session: Session, ended: Sequence[FrozenTrial], params: LoaderParams) -> Reuse:
    training = session.config.training
    return plan_trial(
        ended,
        params,
        training,
        session.hardware.hardware_class,
        _train_size(session),
        reuse_val_loss=training.reuse_val_loss,
    )


def _with_run(session: Session, job: Job) -> Job:
    """``job`` with the `TrialJob` its process trains (a command's study runs the command)."""
    command = session.config.command
    run = TrialJob(
        session.workload,
        job.params,
        session.config.training,
        session.device,
        plan=job.reuse.plan,
        fresh=job.fresh if command is None else None,
        command=command.spec() if command is not None else None,
    )
    return dataclasses.replace(job, run=run)


def fresh_recipe(recipe: WorkloadRecipe | None, choice: str) -> WorkloadRecipe | None:
    """How a confirmation trial's fresh process builds the workload (``study.confirm_process
    = choice``); None where it forks from this worker instead: ``"fork"``, or a workload the
    caller built in memory (no ``recipe``: no process can rebuild it)."""
    return recipe if choice == "fresh" else None


def accumulates(session: Session) -> bool:
    """Whether a batch that does not fit in memory is trained as accumulated micro-batches:
    never for a command, whose step is the script's own (the batch is infeasible)."""
    config = session.config
    return config.training.gradient_accumulation == "auto" and config.command is None


def _train_size(session: Session) -> int | None:
    """The training samples an epoch has; None where the study cannot see them (a
    command's data set lives in the script)."""
    if session.workload is None:
        return None
    return len(session.workload.train_dataset)  # type: ignore[arg-type]
