"""The budget decision every worker takes under the study lock, and the benchmarks' replay too:
given the study's trials, take the next search trial, wait for the ones running elsewhere,
queue re-measurements of the candidates, or stop.

Pure: the decision reads the trials it is given (states and attrs) and returns what to do;
the caller reads the study and acts on it (`loader_search.study._worker._take_trial`,
`benchmarks.replay`), so both follow one rule and it can be tested on hand-made trials.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from optuna.trial import FrozenTrial, TrialState

from loader_search.study._config import StudyConfig
from loader_search.study._guide import Proposal
from loader_search.study._keys import (
    BASELINE_ATTR,
    CONFIRM_ATTR,
    CONFIRMATION_ATTR,
    FAILURE_REASON,
    RETRY_HISTORY,
    TOLERANCE_ATTR,
)
from loader_search.study._recommend import confirmation_queue
from loader_search.trial._failures import INTERRUPTED

FINISHED_STATES = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
# A baseline in one of these states is done or on its way: no other is queued.
_BASELINE_PRESENT = (TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING)


def uses_budget(trial: FrozenTrial) -> bool:
    """Whether a trial counts against the study's budget.

    Queued, running and completed trials count, except re-measurements of the candidates,
    which are queued once the budget is used. A failed trial counts when it failed on its
    own (a crash, a hang): that is a result. Not counted: an interrupted trial, a failed
    baseline (the study stops and queues it again), and a trial whose worker died (no
    failure reason: it is queued again as a retry, which counts instead).
    """
    if trial.user_attrs.get(CONFIRMATION_ATTR):
        return False  # re-measurements come after the budget (see `confirmations`)
    if trial.state != TrialState.FAIL:
        return True
    reason = trial.user_attrs.get(FAILURE_REASON)
    if reason is None or reason == INTERRUPTED:
        return False
    return not trial.user_attrs.get(BASELINE_ATTR)


def count_used(trials: Sequence[FrozenTrial], states: Sequence[TrialState]) -> int:
    """Trials in ``states`` that used the budget. A failed trial that was queued again (its
    worker died) is not counted, whatever it recorded before dying: its retry is."""
    retried = {n for t in trials for n in t.system_attrs.get(RETRY_HISTORY, ())}
    return sum(
        uses_budget(t)
        for t in trials
        if t.state in states and not (t.state == TrialState.FAIL and t.number in retried)
    )


def combinations_left(trials: Sequence[FrozenTrial], grid_size: int) -> int:
    """For the grid sampler: of its ``grid_size`` valid combinations, those not yet taken
    (it would repeat them)."""
    taken = {tuple(sorted(t.params.items())) for t in trials if uses_budget(t) and t.params}
    return max(0, grid_size - len(taken))


def needs_baseline(trials: Sequence[FrozenTrial]) -> bool:
    """Whether the baseline must be queued: none completed, is queued or is running. It runs
    first in a new study, and again in a continued study whose baseline was interrupted or
    failed."""
    return not any(t.user_attrs.get(BASELINE_ATTR) for t in trials if t.state in _BASELINE_PRESENT)


@dataclass(frozen=True)
class ConfirmSettings:
    """How the candidates are re-measured once the budget is used (0 ``top``: not at all)."""

    top: int  # the fastest Pareto points within the tolerance (and the baseline)
    repeats: int  # measurements each should have in all
    loss_tolerance: float


def confirm_settings(attrs: Mapping[str, Any], config: StudyConfig) -> ConfirmSettings:
    """The re-measurement settings as the study stores them (``run`` and ``init`` do), else
    the config's, so every worker applies the same ones."""
    stored = attrs.get(CONFIRM_ATTR) or {}
    return ConfirmSettings(
        top=int(stored.get("top", config.confirm_top)),
        repeats=int(stored.get("repeats", config.confirm_repeats)),
        loss_tolerance=float(attrs.get(TOLERANCE_ATTR, config.loss_tolerance)),
    )


def confirmations(
    trials: Sequence[FrozenTrial], confirm: ConfirmSettings, hardware_class: str | None = None
) -> list[dict[str, Any]]:
    """The re-measurements to queue now (trial parameters, in order), so that the
    recommendation rests on medians.

    The candidates are the ``confirm.top`` fastest points of the Pareto front within the
    loss tolerance, and the baseline: each runs until it has ``confirm.repeats``
    measurements. Asked again whenever the queue runs dry, as a point that falls back to its
    median can let another one in; that one is re-measured too. A setting gets at most
    ``2 * repeats`` re-measurements (some may fail), so this ends (see `confirmation_queue`).
    """
    if confirm.top == 0:
        return []
    return confirmation_queue(
        list(trials), confirm.loss_tolerance, confirm.top, confirm.repeats, hardware_class
    )


@dataclass(frozen=True)
class Take:
    """Take the next trial: a queued one first, else a new suggestion. With ``baseline``,
    queue the baseline first (it is missing), so that it is the one taken; with ``propose``,
    queue the pipeline model's proposals first (see `loader_search.study._guide`)."""

    baseline: bool = False
    propose: tuple[Proposal, ...] = ()


@dataclass(frozen=True)
class Wait:
    """The budget is used but trials still run elsewhere: their worker may have died (then
    the sweeper queues a retry), or they may turn out to be the best candidates (then they
    are re-measured), so the study is not done yet."""

    running: int


@dataclass(frozen=True)
class Confirm:
    """The budget is used and nothing runs: queue these re-measurements (trial parameters,
    in order), then take the first."""

    queue: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Done:
    """The budget is used, nothing runs, and nothing is left to re-measure."""


Decision: TypeAlias = Take | Wait | Confirm | Done


def decide(
    trials: Sequence[FrozenTrial],
    budget: int,
    confirm: ConfirmSettings,
    *,
    grid_size: int | None = None,
    hardware_class: str | None = None,
    proposals: Sequence[Proposal] = (),
) -> Decision:
    """What a worker does next, given every trial of the study (read under the study lock),
    its ``budget`` as stored now, and its re-measurement settings.

    A queued trial (a retry, the baseline, a re-measurement) is taken first. Else, while
    fewer than ``budget`` trials used it (running ones included: see `uses_budget`) and,
    for the grid sampler (``grid_size``: its number of combinations), a combination is left,
    a new trial is taken, the baseline first when there is none, then the model's
    ``proposals`` (as many as the budget has room for). Once the budget is used:
    wait while trials run, then re-measure what `confirmations` finds missing (on
    ``hardware_class``'s trials), then stop.
    """
    if any(t.state == TrialState.WAITING for t in trials):
        return Take()
    used = count_used(trials, (*FINISHED_STATES, TrialState.RUNNING))
    exhausted = used >= budget or (
        grid_size is not None and not combinations_left(trials, grid_size)
    )
    if not exhausted:
        if needs_baseline(trials):
            return Take(baseline=True)
        return Take(propose=tuple(proposals[: budget - used]))
    running = sum(t.state == TrialState.RUNNING for t in trials)
    if running:
        return Wait(running)
    queue = confirmations(trials, confirm, hardware_class)
    return Confirm(tuple(queue)) if queue else Done()
