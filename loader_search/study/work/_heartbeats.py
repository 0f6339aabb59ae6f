"""The threads that keep a study's trials honest while a worker trains, and what they do.

While a trial trains, a thread writes its heartbeat (`Every`). A trial whose worker died
(SIGKILL, lost machine) stops beating; after the grace period a sweeper thread, which every
worker runs even while its own trial trains, fails it (`fail_stale_trials`) and
`RetryStaleTrial` queues it again with the same settings (a bounded number of times). `Health`
keeps a sweep from failing live trials right after a database outage, and `beating` keeps a
trial taken but not yet training alive through one.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.study._keys import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    MODEL_ROUND_ATTR,
    RETRY_HISTORY,
)
from loader_search.team import retrying

T = TypeVar("T")

# What a retry copies of the dead trial's attrs: what it is, not what it half-measured.
# A retried model trial keeps its round, so the next round waits for it.
_KEPT_ON_RETRY = frozenset(
    {BASELINE_ATTR, CONFIRMATION_ATTR, CONFIRM_ROUND_ATTR, MODEL_ROUND_ATTR}
)

# Warnings about what these threads do on purpose; set once, as `warnings.catch_warnings` is
# not thread-safe and the sweeper and heartbeat threads run beside the main one.
warnings.filterwarnings("ignore", ".*fail_stale_trials is experimental", Warning)
warnings.filterwarnings("ignore", "Heartbeat of storage is supposed", UserWarning)


class RetryStaleTrial:
    """Queue a stale trial (its worker died) again with the same settings, at most
    ``max_retry`` times: Optuna's `RetryHeartbeatStaleTrialCallback`, except that the copy
    does not inherit what the dead trial may have half-recorded (measurements, a failure
    reason, its ``constraints:*``), which would make a successful retry look infeasible."""

    def __init__(self, max_retry: int) -> None:
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        history = [*trial.system_attrs.get(RETRY_HISTORY, ()), trial.number]
        if len(history) > self.max_retry:
            return
        system_attrs = {
            key: value
            for key, value in trial.system_attrs.items()
            if not key.startswith("constraints")
        }
        system_attrs.setdefault("failed_trial", trial.number)  # the first one, as Optuna's
        system_attrs[RETRY_HISTORY] = history
        user_attrs = {k: v for k, v in trial.user_attrs.items() if k in _KEPT_ON_RETRY}
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                params=trial.params,
                distributions=trial.distributions,
                user_attrs=user_attrs,
                system_attrs=system_attrs,
            )
        )


class Health:
    """When this process last failed to reach the database, shared by its threads.

    After an outage every live trial's heartbeat is old; a sweeper that ran at once would
    fail trials that are still training. So a sweep waits until the database has answered
    for a whole grace period, and the heartbeat threads have beaten again meanwhile.
    """

    def __init__(self) -> None:
        self._last_error = -math.inf

    def failed(self) -> None:
        self._last_error = time.monotonic()  # one float assignment: atomic under the GIL

    def quiet_for(self) -> float:
        return time.monotonic() - self._last_error


def beating(
    storage: optuna.storages.RDBStorage,
    trial_id: int,
    call: Callable[[], T],
    interval_s: float,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> T:
    """``call`` for a RUNNING trial that no heartbeat thread (`Every`) keeps alive: the
    trial's heartbeat written before each try, and both tried again while the database is
    unreachable, no less often than the thread would write (every ``interval_s``). So an
    outage costs the trial no more than it costs one whose thread runs: a team's sweep after
    it does not fail the trial as stale (which would run it again) so long as the outage was
    shorter than the grace period. A worker that gave up on the trial instead would leave it
    RUNNING, to be failed as stale and run again, or, without a heartbeat, never found stale
    at all."""

    def once() -> T:
        storage.record_heartbeat(trial_id)
        return call()

    return retrying(once, on_retry=on_retry, max_pause_s=interval_s)


def fail_stale_trials(study: optuna.Study, health: Health, grace_period_s: float) -> None:
    """Fail (and queue again) trials whose worker died; call under the study lock."""
    if health.quiet_for() >= grace_period_s:
        optuna.storages.fail_stale_trials(study)


class Every(threading.Thread):
    """Calls ``action`` every ``interval_s`` until stopped; errors are reported, never fatal
    (a heartbeat thread that died with a database outage would get its trial retried while
    it still trains)."""

    def __init__(
        self,
        interval_s: float,
        action: Callable[[], None],
        on_error: Callable[[str], None],
        health: Health,
    ) -> None:
        super().__init__(daemon=True)
        self._interval_s = interval_s
        self._action = action
        self._on_error = on_error
        self._health = health
        self._stop_event = threading.Event()
        self._failing = False

    def run(self) -> None:
        while True:
            try:
                self._action()
            except Exception as exc:
                self._health.failed()
                if not self._failing:  # once per outage, not every beat
                    self._on_error(f"{type(exc).__name__}: {_first_line(exc)}")
                self._failing = True
            else:
                self._failing = False
            if self._stop_event.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stop_event.set()
        # Bounded: a thread stuck in a database call must not hang Ctrl-C (it is a daemon).
        self.join(timeout=10)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
