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
import math
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from loader_search import interrupts
from loader_search.study._keys import (
    CEILING_FROM,
    CONSTRAINT,
    FAILURE_HINT,
    FAILURE_MESSAGE,
    FAILURE_REASON,
    FAILURE_TRACEBACK,
    INFERRED_FROM,
    LOADER_EFFICIENCY_ATTR,
    LOST,
    PREDICTED_ATTR,
    PREDICTION_ERROR_ATTR,
    VAL_LOSS_FROM,
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
    trial later. Once recorded, the command's last line says so
    (`loader_search.interrupts.interrupted_trials`)."""
    with contextlib.suppress(Exception):
        retrying(lambda: trial.set_user_attr(FAILURE_REASON, INTERRUPTED), deadline_s=10)
        tell(study, trial, TrialState.FAIL, None, 10)
        interrupts.trial_interrupted(trial.number)


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
