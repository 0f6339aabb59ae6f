"""The budget decision (`loader_search.study.work._budget.decide`) on hand-made trials: what a
worker does next under the study lock, and what the benchmarks' replay follows too."""

from __future__ import annotations

import time
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import LoaderParams
from loader_search.study import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    FAILURE_REASON,
    HARDWARE_CLASS_ATTR,
    PARAMS_ATTR,
    WORKER_ATTR,
    StudyConfig,
)
from loader_search.study._keys import CONFIRM_ATTR, RETRY_HISTORY, TOLERANCE_ATTR
from loader_search.study.stats import ConfirmSettings, Remeasure
from loader_search.study.work import (
    Confirm,
    Done,
    Take,
    Wait,
    confirm_settings,
    count_used,
    decide,
    uses_budget,
)
from loader_search.study.work._take import Patience
from loader_search.trial import INTERRUPTED

NO_CONFIRM = ConfirmSettings(
    top=0, min_rounds=3, max_rounds=6, half_width=0.05, loss_tolerance=0.05
)
CONFIRM = ConfirmSettings(top=3, min_rounds=3, max_rounds=6, half_width=0.05, loss_tolerance=0.05)
DISTRIBUTIONS = {
    "batch_size": CategoricalDistribution([16, 32, 64]),
    "num_workers": IntDistribution(0, 4),
    "prefetch_factor": IntDistribution(1, 4),
}


def _trial(
    number: int,
    state: TrialState,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    values: tuple[float, float] | None = None,
    system_attrs: dict[str, Any] | None = None,
    **user_attrs: Any,
) -> FrozenTrial:
    """A trial as the worker stores it: its search params and effective settings."""
    params = {"batch_size": batch_size, "num_workers": num_workers}
    if num_workers:
        params["prefetch_factor"] = 2  # only with workers, as the search space suggests it
    loader = LoaderParams(batch_size, num_workers, params.get("prefetch_factor"))
    if state == TrialState.COMPLETE and values is None:
        values = (100.0, 1.0)
    trial = optuna.trial.create_trial(
        state=state,
        params=params,
        distributions={name: DISTRIBUTIONS[name] for name in params},
        values=list(values) if values is not None else None,
        user_attrs={PARAMS_ATTR: loader.as_dict(), **user_attrs},
        system_attrs=system_attrs or {},
    )
    trial.number = number
    return trial


def _baseline(
    number: int = 0, state: TrialState = TrialState.COMPLETE, **attrs: Any
) -> FrozenTrial:
    values = (100.0, 1.0) if state == TrialState.COMPLETE else None
    return _trial(number, state, values=values, **{BASELINE_ATTR: True}, **attrs)


# --- take ----------------------------------------------------------------------------------


def test_a_new_study_takes_the_baseline_first() -> None:
    assert decide([], 3, CONFIRM) == Take(baseline=True)


def test_below_the_budget_a_new_trial_is_taken_without_a_second_baseline() -> None:
    trials = [_baseline(), _trial(1, TrialState.COMPLETE, num_workers=2)]
    assert decide(trials, 3, CONFIRM) == Take(baseline=False)
    # A queued or running baseline is on its way: no second one either.
    for state in (TrialState.WAITING, TrialState.RUNNING):
        assert decide([_baseline(state=state)], 3, CONFIRM) == Take(baseline=False)


@pytest.mark.parametrize("reason", ["interrupted", "diverged"])
def test_a_baseline_that_did_not_complete_is_queued_again_and_uses_no_budget(
    reason: str,
) -> None:
    failed = _baseline(state=TrialState.FAIL, **{FAILURE_REASON: reason})
    assert not uses_budget(failed)
    # Budget 1: the failed baseline did not use it, so the study takes its baseline again.
    assert decide([failed], 1, CONFIRM) == Take(baseline=True)


def test_a_queued_trial_is_taken_even_past_the_budget() -> None:
    # A retry or a re-measurement waiting: taking it comes before any budget question.
    trials = [_baseline(), _trial(1, TrialState.COMPLETE), _trial(2, TrialState.WAITING)]
    assert decide(trials, 1, CONFIRM) == Take(baseline=False)


def test_re_measurements_interruptions_and_dead_workers_use_no_budget() -> None:
    trials = [
        _baseline(),
        _trial(1, TrialState.COMPLETE, num_workers=1, **{CONFIRMATION_ATTR: True}),
        _trial(2, TrialState.FAIL, num_workers=2, **{FAILURE_REASON: "interrupted"}),
        _trial(3, TrialState.FAIL, num_workers=3),  # worker died: no reason recorded
        # Died after recording a reason, then queued again: only the retry counts.
        _trial(4, TrialState.FAIL, num_workers=4, **{FAILURE_REASON: "cuda_oom"}),
        _trial(5, TrialState.COMPLETE, num_workers=4, system_attrs={RETRY_HISTORY: [4]}),
    ]
    assert count_used(trials, (TrialState.COMPLETE, TrialState.FAIL)) == 2  # 0 and 5
    assert decide(trials, 3, NO_CONFIRM) == Take(baseline=False)
    assert decide(trials, 2, NO_CONFIRM) == Done()


def test_a_trial_that_failed_on_its_own_uses_the_budget() -> None:
    crashed = _trial(1, TrialState.FAIL, num_workers=2, **{FAILURE_REASON: "exception"})
    assert uses_budget(crashed)
    assert decide([_baseline(), crashed], 2, NO_CONFIRM) == Done()


def test_the_grid_stops_when_every_combination_was_taken() -> None:
    trials = [_baseline(), _trial(1, TrialState.COMPLETE, num_workers=1)]
    assert decide(trials, 10, NO_CONFIRM, grid_size=3) == Take(baseline=False)
    assert decide(trials, 10, NO_CONFIRM, grid_size=2) == Done()
    # The same combination twice (a retry) takes only one of the grid's places.
    again = [*trials, _trial(2, TrialState.COMPLETE, num_workers=1)]
    assert decide(again, 10, NO_CONFIRM, grid_size=3) == Take(baseline=False)


# --- wait ----------------------------------------------------------------------------------


def test_running_trials_use_the_budget_and_are_waited_for() -> None:
    trials = [
        _baseline(),
        _trial(1, TrialState.RUNNING, num_workers=1),
        _trial(2, TrialState.RUNNING, num_workers=2),
    ]
    assert decide(trials, 4, CONFIRM) == Take(baseline=False)
    # Budget used while two still run: they may die (retried) or be candidates (re-measured).
    assert decide(trials, 3, CONFIRM) == Wait(running=2)
    assert decide(trials, 3, NO_CONFIRM) == Wait(running=2)


# --- confirm and done ----------------------------------------------------------------------


def _searched(**attrs: Any) -> list[FrozenTrial]:
    """A used-up budget of 3: the baseline, a fast point within the tolerance, and a faster
    one past it."""
    return [
        _baseline(**attrs),
        _trial(1, TrialState.COMPLETE, num_workers=2, values=(300.0, 1.02), **attrs),
        _trial(2, TrialState.COMPLETE, num_workers=4, values=(400.0, 1.5), **attrs),
    ]


def test_once_the_budget_is_used_the_candidates_are_confirmed_one_trial_at_a_time() -> None:
    trials = _searched()
    fast = LoaderParams(32, 2, 2)
    baseline = LoaderParams(32, 0)
    # The point past the loss tolerance (num_workers=4) is no candidate. Round 0 measures the
    # baseline, then the candidate; round 1 in the rotated order; one trial per decision.
    asked = []
    for number in range(3, 7):
        decision = decide(trials, 3, CONFIRM)
        assert isinstance(decision, Confirm)
        asked.append(decision.remeasure)
        done = decision.remeasure
        trials.append(
            _trial(
                number,
                TrialState.COMPLETE,
                num_workers=done.params.num_workers,
                values=(300.0, 1.02) if done.params.num_workers else (100.0, 1.0),
                **{CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: done.round},
            )
        )
    assert asked == [
        Remeasure(baseline, 0),
        Remeasure(fast, 0),
        Remeasure(fast, 1),
        Remeasure(baseline, 1),
    ]


def test_done_when_the_rounds_are_sure_of_the_speedup() -> None:
    trials = _searched()
    for number, (workers, round_) in enumerate(
        [(0, 0), (2, 0), (2, 1), (0, 1), (0, 2), (2, 2)], start=3
    ):
        trials.append(
            _trial(
                number,
                TrialState.COMPLETE,
                num_workers=workers,
                values=(300.0, 1.02) if workers else (100.0, 1.0),
                **{CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: round_},
            )
        )
    # Three rounds of the very same ratio: the interval has no width.
    assert decide(trials, 3, CONFIRM) == Done()
    # Were the third round missing its last trial, that would come next.
    assert decide(trials[:-1], 3, CONFIRM) == Confirm(Remeasure(LoaderParams(32, 2, 2), 2))


def test_no_re_measurement_when_it_is_off() -> None:
    assert decide(_searched(), 3, NO_CONFIRM) == Done()


def test_only_this_hardware_class_s_candidates_are_re_measured() -> None:
    trials = _searched(**{HARDWARE_CLASS_ATTR: "cpu-8c-a"})
    assert isinstance(decide(trials, 3, CONFIRM, hardware_class="cpu-8c-a"), Confirm)
    assert decide(trials, 3, CONFIRM, hardware_class="cpu-16c-b") == Done()


def test_confirm_settings_are_the_study_s_else_the_config_s() -> None:
    config = StudyConfig(
        confirm_top=2,
        confirm_min_rounds=4,
        confirm_max_rounds=9,
        confirm_half_width=0.03,
        loss_tolerance=0.1,
    )
    assert confirm_settings({}, config) == ConfirmSettings(2, 4, 9, 0.03, 0.1)
    stored = {
        CONFIRM_ATTR: {"top": 0, "min_rounds": 5, "max_rounds": 7, "half_width": 0.1},
        TOLERANCE_ATTR: 0.2,
    }
    assert confirm_settings(stored, config) == ConfirmSettings(0, 5, 7, 0.1, 0.2)
    # A study stored before the paired rounds: its repeats stand for the minimum of rounds.
    older = {CONFIRM_ATTR: {"top": 3, "repeats": 2}, TOLERANCE_ATTR: 0.05}
    assert confirm_settings(older, config) == ConfirmSettings(3, 2, 9, 0.03, 0.05)


def test_the_rounds_stay_on_the_worker_that_runs_them_until_it_falls_silent() -> None:
    """In a team, one worker runs the confirmation rounds (drift and neighbours' load then hit
    every setting of a round alike); the others wait, and take over once they found it silent
    (by their own clocks) or its last trial was interrupted."""

    def confirmation(state: TrialState, **attrs: Any) -> FrozenTrial:
        return _trial(
            3,
            state,
            values=(100.0, 1.0) if state == TrialState.COMPLETE else None,
            **{CONFIRMATION_ATTR: True, CONFIRM_ROUND_ATTR: 0, WORKER_ATTR: "host-a:41"},
            **attrs,
        )

    trials = [*_searched(), confirmation(TrialState.COMPLETE)]
    next_trial = Confirm(Remeasure(LoaderParams(32, 2, 2), 0))
    assert decide(trials, 3, CONFIRM, worker="host-a:41") == next_trial
    waiting = decide(trials, 3, CONFIRM, worker="host-b:7")
    assert waiting == Wait(0, rounds_on="host-a:41", last_confirmation=3)
    assert decide(trials, 3, CONFIRM, worker="host-b:7", owner_silent=True) == next_trial
    # Its last trial was interrupted: it left, and the next worker goes on at once.
    left = [*_searched(), confirmation(TrialState.FAIL, **{FAILURE_REASON: INTERRUPTED})]
    assert isinstance(decide(left, 3, CONFIRM, worker="host-b:7"), Confirm)
    # Without a worker name (the benchmarks' replay, one process) nothing waits.
    assert decide(trials, 3, CONFIRM) == next_trial


def test_a_waiting_worker_finds_the_rounds_owner_silent_by_its_own_clock() -> None:
    patience = Patience(0.2)
    assert not patience.owner_silent()
    patience.saw(Wait(0, rounds_on="host-a:41", last_confirmation=3))
    assert not patience.owner_silent()
    time.sleep(0.25)
    assert patience.owner_silent()  # the same last trial for the whole grace period
    patience.saw(Wait(0, rounds_on="host-a:41", last_confirmation=4))
    assert not patience.owner_silent()  # the owner ran another trial: it is alive
    patience.saw(Wait(2))  # trials running elsewhere say nothing about the owner
    assert not patience.owner_silent()
