"""The Optuna adapter: what a trial stores, and how an outcome becomes a trial state.

A trial is *complete* with ``(throughput, val_loss)`` when it trained; *complete but
infeasible* when its settings cannot work here (out of memory, diverged): it gets placeholder
values ``(0, inf)`` and a positive ``trial.set_constraint`` value, so samplers learn to avoid
that region (Optuna ignores FAIL trials and would propose it again) and ``best_trials`` drops
it; *failed* for anything else (a crash in user code, a hang, a killed loader worker).
Every failure stores its reason, a one-line message, a hint and the traceback's tail.

Constraints are set only after the trial ran: a trial that is retried after its worker died
inherits the dead trial's system attributes, constraints included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.study._keys import (
    CEILING_FROM,
    CONSTRAINT,
    FAILURE_HINT,
    FAILURE_MESSAGE,
    FAILURE_REASON,
    FAILURE_TRACEBACK,
    HARDWARE_CLASS_ATTR,
    INFERRED_FROM,
    INFERRED_OOM,
    LOADER_EFFICIENCY_ATTR,
    LOST,
    OOM_ATTEMPTS_ATTR,
    OOM_REASONS,
    PREDICTED_ATTR,
    PREDICTION_ERROR_ATTR,
    VAL_LOSS_FROM,
    stored_params,
)
from loader_search.study._optuna_compat import study_storage, trial_id
from loader_search.study.work._plan import Reuse
from loader_search.study.work._trials import write_user_attrs
from loader_search.team import retrying
from loader_search.trial import INTERRUPTED, TrialFailure, TrialOutcome

INFEASIBLE_VALUES = (0.0, math.inf)  # placeholder objective values of an infeasible trial


@dataclass(frozen=True)
class Recorded:
    """What was stored for a trial, for progress display."""

    state: TrialState
    infeasible: bool
    values: tuple[float, float] | None
    failure: TrialFailure | None
    val_loss_from: tuple[int, ...] = ()  # stopped early: whose val_loss it reports
    loader_efficiency: float | None = None


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


def record(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: TrialOutcome,
    *,
    reuse: Reuse | None = None,
    inferred_from: int | None = None,
    extra: dict[str, object] | None = None,
    retry_s: float = 300.0,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> Recorded:
    """Store ``outcome`` on ``trial`` and finish it. Every write is retried while the
    database is unreachable, so a result measured during a database restart is kept.
    ``reuse`` supplies what the trial did not measure itself (see
    `loader_search.study.work._plan`): the validation loss of a trial that stopped early, and
    the ceiling for its loader efficiency.

    Should a sweeper have failed the trial meanwhile (an outage longer than the grace
    period, so its heartbeats stopped), the result cannot be stored: the trial's retry
    measures it again, and the returned record says so. ``extra`` attributes are written
    with the result, in the same transaction."""
    try:
        return _record(study, trial, outcome, reuse, inferred_from, extra, retry_s, on_retry)
    except optuna.exceptions.UpdateFinishedTrialError:
        lost = TrialFailure(
            reason=LOST,
            message=(
                "the result could not be stored: the trial was failed as stale while the"
                " database was unreachable, and its retry will measure it again"
            ),
            hint="raise [workers] grace_period_s above the longest database outage you expect",
        )
        return Recorded(TrialState.FAIL, False, None, lost)


def _record(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: TrialOutcome,
    reuse: Reuse | None,
    inferred_from: int | None,
    extra: dict[str, object] | None,
    retry_s: float,
    on_retry: Callable[[BaseException, float], None] | None,
) -> Recorded:
    failure = outcome.failure
    result = outcome.result
    val_loss = None
    val_loss_from: tuple[int, ...] = ()
    efficiency = None
    attrs: dict[str, object] = dict(extra or {})  # written in one transaction
    if result is not None:
        attrs.update(result.user_attrs())
        val_loss = result.val_loss
        if val_loss is None:  # stopped early: the validation loss known for its batch size
            if reuse is None or reuse.val_loss is None:
                raise ValueError(f"trial #{trial.number} stopped early with no val_loss to reuse")
            val_loss, val_loss_from = reuse.val_loss, reuse.val_loss_from
            attrs[VAL_LOSS_FROM] = list(val_loss_from)
        ceiling = result.ceiling_samples_per_s
        if ceiling is None and reuse is not None and reuse.ceiling is not None:
            ceiling = reuse.ceiling
            attrs[CEILING_FROM] = list(reuse.ceiling_from)
        if ceiling:
            efficiency = result.throughput_samples_per_s / ceiling
            attrs[LOADER_EFFICIENCY_ATTR] = efficiency
        predicted = trial.user_attrs.get(PREDICTED_ATTR)
        if isinstance(predicted, float) and predicted > 0 and failure is None:
            # How far the pipeline model was off (see loader_search.study.search._guide).
            attrs[PREDICTION_ERROR_ATTR] = result.throughput_samples_per_s / predicted - 1
    attrs["trial_wall_time_s"] = outcome.wall_s
    if outcome.isolated and outcome.wall_s > 0:
        attrs["isolation_overhead_s"] = outcome.overhead_s  # fork, result transfer, teardown
    if failure is not None:
        attrs[FAILURE_REASON] = failure.reason
        attrs[FAILURE_MESSAGE] = failure.message[:2000]
        attrs[FAILURE_HINT] = failure.hint
        if failure.traceback:
            attrs[FAILURE_TRACEBACK] = failure.traceback[-4000:]
        if inferred_from is not None:
            attrs[INFERRED_FROM] = inferred_from
    retrying(lambda: write_user_attrs(trial, attrs), deadline_s=retry_s, on_retry=on_retry)
    if failure is None or failure.infeasible:
        infeasible = failure is not None
        _set_constraint(trial, 1.0 if infeasible else 0.0, retry_s, on_retry)
        if result is not None and val_loss is not None and not infeasible:
            values = (result.throughput_samples_per_s, val_loss)
        else:
            values = INFEASIBLE_VALUES
        tell(study, trial, TrialState.COMPLETE, values, retry_s, on_retry)
        return Recorded(
            TrialState.COMPLETE, infeasible, values, failure, val_loss_from, efficiency
        )
    tell(study, trial, TrialState.FAIL, None, retry_s, on_retry)
    return Recorded(TrialState.FAIL, False, None, failure)


def record_interrupted(study: optuna.Study, trial: optuna.Trial) -> None:
    """Ctrl-C: the trial gave no result and is not left RUNNING. Best effort (10 s): with
    the database down, the user's Ctrl-C still ends the process, and a sweeper fails the
    trial later."""
    with contextlib.suppress(Exception):
        retrying(lambda: trial.set_user_attr(FAILURE_REASON, INTERRUPTED), deadline_s=10)
        tell(study, trial, TrialState.FAIL, None, 10)


def _set_constraint(
    trial: optuna.Trial,
    value: float,
    retry_s: float,
    on_retry: Callable[[BaseException, float], None] | None,
) -> None:
    def write() -> None:
        # First write wins in Optuna; a retry after a lost acknowledgement must not warn.
        if CONSTRAINT not in trial.storage.get_trial(trial_id(trial)).constraints:
            trial.set_constraint(CONSTRAINT, value)

    retrying(write, deadline_s=retry_s, on_retry=on_retry)


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    state: TrialState,
    values: tuple[float, float] | None,
    retry_s: float,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> None:
    """``study.tell``, retried; a retry that finds the trial already finished (the first
    try committed, its answer was lost) is success."""

    def once() -> None:
        try:
            study.tell(trial, values=list(values) if values else None, state=state)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            stored = study_storage(study).get_trial(trial_id(trial))
            if stored.state == state:
                return
            if stored.state.is_finished():  # finished by someone else: a sweeper
                raise optuna.exceptions.UpdateFinishedTrialError(
                    f"trial #{trial.number} is already {stored.state.name}"
                ) from None
            raise

    retrying(once, deadline_s=retry_s, on_retry=on_retry)
