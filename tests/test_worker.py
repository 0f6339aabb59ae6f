"""The worker loop's bookkeeping on a real SQLite study: stale trials, retries, the budget."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from loader_search.params import WorkersSettings
from loader_search.study import BASELINE_ATTR, CONFIRMATION_ATTR, DIRECTIONS, FAILURE_REASON
from loader_search.study._keys import CONSTRAINT
from loader_search.study.work import RetryStaleTrial, count_used, uses_budget
from loader_search.study.work._heartbeats import Health, fail_stale_trials
from loader_search.team import open_storage

GRACE_S = 2


def _study(tmp_path: Path) -> optuna.Study:
    storage = open_storage(
        f"sqlite:///{tmp_path / 'study.db'}",
        workers=WorkersSettings(heartbeat_interval_s=1, grace_period_s=GRACE_S, max_retry=1),
        on_stale=RetryStaleTrial(max_retry=1),
    )
    return optuna.create_study(storage=storage, directions=list(DIRECTIONS))


def _dying_trial(study: optuna.Study) -> optuna.Trial:
    """A trial whose worker recorded some of its outcome, then died (no more heartbeats)."""
    trial = study.ask()
    study._storage.record_heartbeat(trial._trial_id)  # type: ignore[attr-defined]
    trial.suggest_int("batch_size", 16, 64)
    trial.set_user_attr(BASELINE_ATTR, True)
    trial.set_user_attr(FAILURE_REASON, "cuda_oom")  # half of `record`, then SIGKILL
    trial.set_user_attr("throughput_samples_per_s", 123.0)
    trial.set_constraint(CONSTRAINT, 1.0)
    return trial


def test_no_sweep_right_after_a_database_outage(tmp_path: Path) -> None:
    study = _study(tmp_path)
    trial = _dying_trial(study)
    time.sleep(GRACE_S + 1)
    outage = Health()
    outage.failed()  # this process could not reach the database a moment ago
    fail_stale_trials(study, outage, GRACE_S)
    assert study.trials[trial.number].state == TrialState.RUNNING  # its owner may be alive
    fail_stale_trials(study, Health(), GRACE_S)
    assert study.trials[trial.number].state == TrialState.FAIL


def test_a_retry_keeps_the_settings_but_not_the_dead_trial_s_outcome(tmp_path: Path) -> None:
    study = _study(tmp_path)
    dead = _dying_trial(study)
    time.sleep(GRACE_S + 1)
    fail_stale_trials(study, Health(), GRACE_S)
    (retry,) = study.get_trials(states=(TrialState.WAITING,))
    assert retry.params == study.trials[dead.number].params
    assert retry.user_attrs == {BASELINE_ATTR: True}  # not the half-recorded outcome
    assert retry.constraints == {}  # a successful retry must not stay infeasible
    assert retry.system_attrs["failed_trial"] == dead.number
    # The dead trial recorded a failure reason before dying, yet only its retry uses budget.
    trials = study.get_trials()
    assert count_used(trials, (TrialState.FAIL, TrialState.WAITING)) == 1
    # max_retry=1: when the retry dies too, it is not queued a second time.
    again = study.ask()
    assert again.number == retry.number
    study._storage.record_heartbeat(again._trial_id)  # type: ignore[attr-defined]
    time.sleep(GRACE_S + 1)
    fail_stale_trials(study, Health(), GRACE_S)
    assert not study.get_trials(states=(TrialState.WAITING,))


def test_a_retried_re_measurement_stays_beyond_the_budget(tmp_path: Path) -> None:
    study = _study(tmp_path)
    trial = study.ask()
    study._storage.record_heartbeat(trial._trial_id)  # type: ignore[attr-defined]
    trial.suggest_int("batch_size", 16, 64)
    trial.set_user_attr(CONFIRMATION_ATTR, True)  # a re-measurement whose worker then died
    time.sleep(GRACE_S + 1)
    fail_stale_trials(study, Health(), GRACE_S)
    (retry,) = study.get_trials(states=(TrialState.WAITING,))
    assert retry.user_attrs == {CONFIRMATION_ATTR: True}
    assert not uses_budget(retry)  # it stays a re-measurement, not a search trial
    assert count_used(study.get_trials(), (TrialState.FAIL, TrialState.WAITING)) == 0
