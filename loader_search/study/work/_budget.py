"""The budget decision every worker takes under the study lock, and the benchmarks' replay too:
given the study's trials, take the next search trial, wait for the ones running elsewhere,
queue the next confirmation trial of the candidates, or stop.

Pure: the decision reads the trials it is given (states and attrs) and returns what to do;
the caller reads the study and acts on it (`loader_search.study.work._take.take_trial`,
`benchmarks.replay`), so both follow one rule and it can be tested on hand-made trials.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from loader_search._rules import RANGES
from loader_search.study._keys import (
    BASELINE_ATTR,
    CONFIRM_ATTR,
    CONFIRMATION_ATTR,
    FAILURE_REASON,
    REFUSED,
    RETRY_HISTORY,
    stored_objective,
    stored_setting,
    stored_table,
    study_tolerance,
)
from loader_search.study.config import StudyConfig
from loader_search.study.search import Proposal
from loader_search.study.stats import ConfirmSettings, Remeasure, next_remeasure, rounds_owner
from loader_search.trial import INTERRUPTED

FINISHED_STATES = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
# A baseline in one of these states is done or on its way: no other is queued.
_BASELINE_PRESENT = (TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING)


def uses_budget(trial: FrozenTrial) -> bool:
    """Whether a trial counts against the study's budget.

    Queued, running and completed trials count, except the confirmation trials, which are
    queued once the budget is used. A failed trial counts when it failed on its
    own (a crash, a hang): that is a result. Not counted: an interrupted trial, a refused
    one (queued outside the space, never run), a failed
    baseline (the study stops and queues it again), and a trial whose worker died (no
    failure reason: it is queued again as a retry, which counts instead).
    """
    if trial.user_attrs.get(CONFIRMATION_ATTR):
        return False  # confirmation rounds come after the budget (see `_confirm`)
    if trial.state != TrialState.FAIL:
        return True
    reason = trial.user_attrs.get(FAILURE_REASON)
    if reason is None or reason in (INTERRUPTED, REFUSED):
        return False  # no result: not run (refused), or stopped by a person
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
    (it would repeat them). A trial off the grid takes none: the baseline (0 workers) when
    the space's num_workers starts at 1."""
    taken = {
        tuple(sorted(t.params.items()))
        for t in trials
        if uses_budget(t) and t.params and on_grid(t)
    }
    return max(0, grid_size - len(taken))


def on_grid(trial: FrozenTrial) -> bool:
    """Whether each of the trial's parameters lies in the range it was suggested from (a
    queued trial's fixed value may not: Optuna stores it with a warning)."""
    for name, value in trial.params.items():
        dist = trial.distributions.get(name)
        inside = True
        if isinstance(dist, CategoricalDistribution):
            inside = value in dist.choices
        elif isinstance(dist, (IntDistribution, FloatDistribution)):
            inside = dist.low <= value <= dist.high
        if not inside:
            return False
    return True


def needs_baseline(trials: Sequence[FrozenTrial]) -> bool:
    """Whether the baseline must be queued: none completed, is queued or is running. It runs
    first in a new study, and again in a continued study whose baseline was interrupted or
    failed."""
    return not any(t.user_attrs.get(BASELINE_ATTR) for t in trials if t.state in _BASELINE_PRESENT)


def confirm_settings(
    attrs: Mapping[str, Any], config: StudyConfig, study: str = "?"
) -> ConfirmSettings:
    """The confirmation settings as the study ``study`` stores them (``run`` and ``init`` do),
    else the config's, so every worker applies the same ones; each checked against its rule
    (`stored_setting`). A study stored before the paired rounds has ``repeats``: it stands
    for the minimum of rounds."""
    stored = stored_table(study, attrs, CONFIRM_ATTR)

    def setting(key: str, default: Any) -> Any:
        rule = f"study.confirm_{key}"
        return stored_setting(study, stored, key, default, rule, shown=f"{CONFIRM_ATTR}.{key}")

    # An interval needs 2 rounds; older studies allowed 1 repeat.
    older = stored.get("repeats")
    if "min_rounds" not in stored and isinstance(older, int) and not isinstance(older, bool):
        low = max(2, min(older, int(RANGES["study.confirm_min_rounds"].high)))
    else:
        low = int(setting("min_rounds", config.confirm_min_rounds))
    return ConfirmSettings(
        top=int(setting("top", config.confirm_top)),
        min_rounds=low,
        max_rounds=max(low, int(setting("max_rounds", config.confirm_max_rounds))),
        half_width=float(setting("half_width", config.confirm_half_width)),
        loss_tolerance=study_tolerance(study, attrs, config.loss_tolerance),
        objective=stored_objective(attrs, config.objective),
    )


@dataclass(frozen=True)
class Take:
    """Take the next trial: a queued one first, else a new suggestion. With ``baseline``,
    queue the baseline first (it is missing), so that it is the one taken; with ``propose``,
    queue the pipeline model's proposals first (see `loader_search.study.search._guide`)."""

    baseline: bool = False
    propose: tuple[Proposal, ...] = ()


@dataclass(frozen=True)
class Wait:
    """The budget is used but trials still run elsewhere: their worker may have died (then
    the sweeper queues a retry), or they may turn out to be the best candidates (then they
    are re-measured), so the study is not done yet. Or (``rounds_on``) the confirmation
    rounds run on another worker, whose last trial is ``last_confirmation``."""

    running: int
    rounds_on: str | None = None
    last_confirmation: int | None = None


@dataclass(frozen=True)
class Confirm:
    """The budget is used and nothing runs: queue this confirmation trial, then take it."""

    remeasure: Remeasure


@dataclass(frozen=True)
class Done:
    """The budget is used, nothing runs, and the confirmation rounds are done."""


Decision: TypeAlias = Take | Wait | Confirm | Done


def decide(
    trials: Sequence[FrozenTrial],
    budget: int,
    confirm: ConfirmSettings,
    *,
    grid_size: int | None = None,
    hardware_class: str | None = None,
    proposals: Sequence[Proposal] = (),
    worker: str | None = None,
    owner_silent: bool = False,
) -> Decision:
    """What a worker does next, given every trial of the study (read under the study lock),
    its ``budget`` as stored now, and its re-measurement settings.

    A queued trial (a retry, the baseline, a re-measurement) is taken first. Else, while
    fewer than ``budget`` trials used it (running ones included: see `uses_budget`) and,
    for the grid sampler (``grid_size``: its number of combinations), a combination is left,
    a new trial is taken, the baseline first when there is none, then the model's
    ``proposals`` (as many as the budget has room for). Once the budget is used:
    wait while trials run, then run the confirmation rounds one trial at a time (on
    ``hardware_class``'s trials; see `loader_search.study.stats._confirm`), then stop.

    The rounds run on one ``worker`` (named as trials store it, `WORKER_ATTR`), so that drift
    and neighbours' load hit every setting of a round alike: the one that ran the last
    confirmation trial (`rounds_owner`). The others wait, until the asking worker finds the
    owner silent (``owner_silent``: the same last confirmation trial for a grace period, by
    the asker's own clock, as workers' clocks differ); then it takes the rounds over.
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
    remeasure = next_remeasure(trials, confirm, hardware_class)
    if remeasure is None:
        return Done()
    owner = rounds_owner(trials, hardware_class)
    if worker is not None and owner is not None and owner[0] != worker and not owner_silent:
        return Wait(0, rounds_on=owner[0], last_confirmation=owner[1])
    return Confirm(remeasure)
