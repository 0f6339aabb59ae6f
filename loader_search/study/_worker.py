"""The loop every process that runs trials goes through, `run` and `worker` alike.

Many workers on many machines share one study and one trial budget. What keeps them honest:

* **One step to count and take.** Counting the trials that used the budget and taking the
  next one (a queued retry first, else a new suggestion) happen under the study lock
  (`loader_search.team._locks.study_lock`), so N workers never run more than the budget, and on
  SQLite two processes never take the same queued trial.
* **Heartbeats.** While a trial trains, a thread writes its heartbeat. A trial whose worker
  died (SIGKILL, lost machine) stops beating; after the grace period a sweeper thread, which
  every worker runs even while its own trial trains, marks it FAIL and Optuna's
  `RetryHeartbeatStaleTrialCallback` queues it again with the same settings (a bounded
  number of times). Our own threads are used instead of ``study.optimize``'s so that a
  database restart does not kill the heartbeat, and so that results can be written with
  retries (`loader_search.study._record.record`).
* **One trial per host at a time** (`loader_search.team._locks.host_lock`), unless each worker is
  pinned to its own CPUs and GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from loader_search import interrupts
from loader_search.errors import StudyAborted, UserError
from loader_search.params import LoaderParams
from loader_search.study._config import StudyConfig
from loader_search.study._plan import plan_trial
from loader_search.study._recommend import (
    BASELINE_ATTR,
    BUDGET_ATTR,
    CONFIRM_ATTR,
    CONFIRMATION_ATTR,
    HARDWARE_ATTR,
    HARDWARE_CLASS_ATTR,
    PARAMS_ATTR,
    TOLERANCE_ATTR,
    confirmation_queue,
    is_feasible,
)
from loader_search.study._record import (
    FAILURE_REASON,
    Recorded,
    known_failure,
    record,
    record_interrupted,
)
from loader_search.study._space import ResolvedSpace
from loader_search.team._hardware import Hardware
from loader_search.team._locks import host_lock, study_lock
from loader_search.team._storage import retrying
from loader_search.trial._supervisor import INTERRUPTED, TrialOutcome, run_isolated
from loader_search.workloads import Workload

FINISHED_STATES = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
RETRY_HISTORY = "retry_history"  # system attribute of a retried trial (as Optuna names it)
# What a retry copies of the dead trial's attrs: what it is, not what it half-measured.
_KEPT_ON_RETRY = frozenset({BASELINE_ATTR, CONFIRMATION_ATTR})

# Warnings about what this module does on purpose; set once, as `warnings.catch_warnings`
# is not thread-safe and the sweeper and heartbeat threads run beside the main one.
warnings.filterwarnings("ignore", ".*fail_stale_trials is experimental", Warning)
warnings.filterwarnings("ignore", "Heartbeat of storage is supposed", UserWarning)
STUDY_HARDWARE_ATTR = "hardware_class"  # study attribute: the class of its first trial
MIXED_HARDWARE_ATTR = "mixed_hardware"  # study attribute: classes other than the first ran


@dataclass(frozen=True)
class TrialEvent:
    number: int
    params: LoaderParams | None
    state: str  # "complete", "infeasible" or "failed"
    throughput: float | None
    val_loss: float | None
    failure: str | None  # "reason: message"
    hint: str | None
    duration_s: float
    finished: int
    budget: int
    pareto_size: int
    best_throughput: float | None
    best_val_loss: float | None
    confirmation: bool = False  # a re-measurement of a candidate, after the budget
    val_loss_from: tuple[int, ...] = ()  # stopped early: the val_loss is theirs
    loader_efficiency: float | None = None  # throughput / ceiling

    @property
    def complete(self) -> bool:
        return self.state == "complete"


class Reporter(Protocol):
    """Receives progress; the CLI draws it, the Python API ignores it (`NullReporter`)."""

    def preparing(self, what: str) -> None:
        """A step before the trials start (or a wait between them)."""

    def study_started(self, info: StudyInfo) -> None:
        """The study is open; ``info`` says what will run."""

    def trial_started(self, number: int, params: LoaderParams) -> None:
        """A trial begins training."""

    def trial_finished(self, event: TrialEvent) -> None:
        """A trial's outcome was stored."""

    def warning(self, what: str) -> None:
        """Something went wrong that the work survives (a database outage, a retry)."""


class NullReporter:
    def preparing(self, what: str) -> None:
        pass

    def study_started(self, info: StudyInfo) -> None:
        pass

    def trial_started(self, number: int, params: LoaderParams) -> None:
        pass

    def trial_finished(self, event: TrialEvent) -> None:
        pass

    def warning(self, what: str) -> None:
        pass


@dataclass(frozen=True)
class StudyInfo:
    name: str
    storage: str  # masked
    created: bool
    budget: int
    finished: int
    device: str
    hardware_class: str
    workload: str
    usable_cpus: int
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Session:
    """Everything one worker process needs to run trials of one study."""

    study: optuna.Study
    config: StudyConfig
    workload: Workload
    space: ResolvedSpace
    device: torch.device
    hardware: Hardware
    budget: int  # as the study stored it when this worker started; re-read before each trial
    cpus: Sequence[int] | None = None
    gpu: int | None = None
    allow_mixed_hardware: bool = False


def uses_budget(trial: FrozenTrial) -> bool:
    """Whether a trial counts against the study's budget.

    Queued, running and completed trials count, except re-measurements of the candidates,
    which are queued once the budget is used. A failed trial counts when it failed on its
    own (a crash, a hang): that is a result. Not counted: an interrupted trial, a failed
    baseline (the study stops and queues it again), and a trial whose worker died (no
    failure reason: it is queued again as a retry, which counts instead).
    """
    if trial.user_attrs.get(CONFIRMATION_ATTR):
        return False  # re-measurements come after the budget (see `queue_confirmations`)
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


def count_finished(study: optuna.Study) -> int:
    """Finished trials that used the study's budget."""
    return count_used(study.get_trials(deepcopy=False), FINISHED_STATES)


def _combinations_left(trials: Sequence[FrozenTrial], space: ResolvedSpace) -> int:
    """For the grid sampler: valid combinations not yet taken (it would repeat them)."""
    taken = {tuple(sorted(t.params.items())) for t in trials if uses_budget(t) and t.params}
    return max(0, space.size() - len(taken))


def ensure_baseline(study: optuna.Study, space: ResolvedSpace, batch_size: int) -> None:
    """Queue the baseline unless one completed, is queued or is running (call under the
    study lock). It runs first in a new study, and again in a continued study whose
    baseline was interrupted or failed. The worker that takes the first trial queues it,
    as the baseline's thread count depends on the machine that runs it."""
    present = (TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING)
    if not any(t.user_attrs.get(BASELINE_ATTR) for t in study.get_trials(states=present)):
        study.enqueue_trial(space.baseline(batch_size), user_attrs={BASELINE_ATTR: True})


class _Health:
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


def fail_stale_trials(study: optuna.Study, health: _Health, grace_period_s: float) -> None:
    """Fail (and queue again) trials whose worker died; call under the study lock."""
    if health.quiet_for() >= grace_period_s:
        optuna.storages.fail_stale_trials(study)


class _Every(threading.Thread):
    """Calls ``action`` every ``interval_s`` until stopped; errors are reported, never fatal
    (a heartbeat thread that died with a database outage would get its trial retried while
    it still trains)."""

    def __init__(
        self,
        interval_s: float,
        action: Callable[[], None],
        on_error: Callable[[str], None],
        health: _Health,
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


def _engine(study: optuna.Study) -> Any:
    """The SQLAlchemy engine under the study's (cached) RDB storage."""
    storage: Any = study._storage
    return getattr(storage, "_backend", storage).engine


@dataclass(frozen=True)
class _Wait:
    """`_take_trial`'s answer when the budget is used but trials still run elsewhere: their
    worker may have died (then the sweeper queues a retry), or they may turn out to be the
    best candidates (then they are re-measured), so the study is not done yet."""

    running: int


def _take_trial(
    session: Session, health: _Health
) -> tuple[optuna.Trial, LoaderParams] | _Wait | None:
    """Under the study lock: sweep stale trials, check the budget (as stored now: `init`
    or `run --n-trials` elsewhere may have changed it) and the hardware binding, and take
    the next trial with its settings. `_Wait` while the budget is used but other trials
    still run; None when the study is done.

    The trial gets its first heartbeat at once: a RUNNING trial with no heartbeat would
    never be found stale. Should anything fail between taking it and returning it, it is
    failed without a reason (no budget used) rather than left RUNNING.
    """
    study = session.study
    grace = session.config.heartbeat.grace_period_s
    with study_lock(_engine(study), study._study_id):
        fail_stale_trials(study, health, grace)
        attrs = study.user_attrs
        _bind_hardware(session, attrs)
        budget = int(attrs.get(BUDGET_ATTR, session.budget))
        trials = study.get_trials(deepcopy=False)
        queued = any(t.state == TrialState.WAITING for t in trials)
        if not queued:
            used = count_used(trials, (*FINISHED_STATES, TrialState.RUNNING))
            exhausted = used >= budget or (
                session.config.sampler.name == "grid"
                and not _combinations_left(trials, session.space)
            )
            if exhausted:
                running = sum(t.state == TrialState.RUNNING for t in trials)
                if running:
                    return _Wait(running)
                if not queue_confirmations(session, trials, attrs):
                    return None
            else:
                ensure_baseline(study, session.space, session.config.training.base_batch_size)
        trial = study.ask()
        try:
            study._storage.record_heartbeat(trial._trial_id)  # type: ignore[attr-defined]
            with warnings.catch_warnings():  # main thread only
                if trial.user_attrs.get(BASELINE_ATTR) or trial.user_attrs.get(CONFIRMATION_ATTR):
                    # The baseline (num_workers=0) may sit outside a searched range.
                    warnings.filterwarnings("ignore", "Fixed parameter", UserWarning)
                params = session.space.suggest(trial)
            trial.set_user_attr(PARAMS_ATTR, params.as_dict())
            trial.set_user_attr(HARDWARE_CLASS_ATTR, session.hardware.hardware_class)
            trial.set_user_attr(HARDWARE_ATTR, session.hardware.as_dict())
        except KeyboardInterrupt:
            record_interrupted(study, trial)
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                study.tell(trial, state=TrialState.FAIL)
            raise
    return trial, params


def queue_confirmations(
    session: Session, trials: Sequence[FrozenTrial], attrs: Mapping[str, Any]
) -> bool:
    """Once the budget is used: queue re-measurements of the candidates the recommendation
    chooses from, so that it rests on medians (call under the study lock). Returns whether
    any were queued.

    The candidates are the ``confirm_top`` fastest points of the Pareto front within the
    loss tolerance, and the baseline: each runs until it has ``confirm_repeats``
    measurements. Called again whenever the queue runs dry, as a point that falls back to its
    median can let another one in; that one is re-measured too. A setting gets at most
    ``2 * confirm_repeats`` re-measurements (some may fail), so this ends. Called only when
    no trial runs (they may be candidates). Settings are taken from the study (``run`` and
    ``init`` store them), so every worker applies the same ones.
    """
    top, repeats = confirm_settings(attrs, session.config)
    if top == 0:
        return False
    tolerance = float(attrs.get(TOLERANCE_ATTR, session.config.loss_tolerance))
    queue = confirmation_queue(
        list(trials), tolerance, top, repeats, session.hardware.hardware_class
    )
    for params in queue:
        session.study.enqueue_trial(
            params, user_attrs={CONFIRMATION_ATTR: True}, skip_if_exists=False
        )
    return bool(queue)


def confirm_settings(attrs: Mapping[str, Any], config: StudyConfig) -> tuple[int, int]:
    """``(confirm_top, confirm_repeats)`` as the study stores them (else the config's)."""
    stored = attrs.get(CONFIRM_ATTR) or {}
    return (
        int(stored.get("top", config.confirm_top)),
        int(stored.get("repeats", config.confirm_repeats)),
    )


def hardware_mismatch(study_name: str, bound: str, hardware: Hardware) -> UserError:
    return UserError(
        f"study {study_name!r} measures hardware class {bound}, but this machine is"
        f" {hardware.hardware_class} ({hardware.describe()}): its throughputs would not"
        " compare. Run on matching hardware, or pass --allow-mixed-hardware (results are then"
        " reported per hardware class)"
    )


def _bind_hardware(session: Session, attrs: Mapping[str, Any]) -> None:
    """Bind a new study to this worker's hardware class, or check this worker against it
    (under the study lock: two workers of different classes may start on a fresh study)."""
    mine = session.hardware.hardware_class
    bound = attrs.get(STUDY_HARDWARE_ATTR)
    if bound is None:
        session.study.set_user_attr(STUDY_HARDWARE_ATTR, mine)
    elif bound != mine:
        if not session.allow_mixed_hardware:
            raise hardware_mismatch(session.study.study_name, bound, session.hardware)
        if not attrs.get(MIXED_HARDWARE_ATTR):
            session.study.set_user_attr(MIXED_HARDWARE_ATTR, True)


def work(
    session: Session,
    reporter: Reporter,
    *,
    max_trials: int | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run trials until the study's budget is used, ``max_trials`` ran here, or
    ``timeout_s`` passed (no new trial starts after it). Returns the trials run here.

    Raises `StudyAborted` when the baseline fails, and KeyboardInterrupt (after recording
    the running trial as interrupted) on Ctrl-C.
    """
    interval = session.config.heartbeat.interval_s
    health = _Health()
    sweeper = _Every(
        interval,
        lambda: _sweep(session, health),
        lambda error: reporter.warning(f"cannot sweep stale trials: {error}"),
        health,
    )
    sweeper.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ran = 0
    # Ctrl-C is acted on at safe points from here on (see loader_search.interrupts).
    with contextlib.ExitStack() as stack:
        stack.callback(sweeper.stop)
        stack.enter_context(interrupts.deferred())
        while max_trials is None or ran < max_trials:
            interrupts.check()
            if deadline is not None and time.monotonic() >= deadline:
                break
            with host_lock(
                session.cpus,
                session.gpu,
                on_wait=lambda holder: reporter.preparing(
                    f"waiting for the host lock held by {holder}"
                ),
                study=session.study.study_name,
            ):
                taken = retrying(
                    lambda: _take_trial(session, health),
                    on_retry=lambda exc, pause: _unreachable(health, reporter, exc, pause),
                )
                if taken is None:
                    break
                if not isinstance(taken, _Wait):
                    trial, params = taken
                    recorded = _run_one(session, health, reporter, trial, params)
            if isinstance(taken, _Wait):
                # Outside the host lock: the trials we wait for may need this host.
                reporter.preparing(
                    f"budget used; waiting for {taken.running} trial(s) running elsewhere"
                    " (a dead worker's trial is retried after the grace period)"
                )
                interrupts.sleep(interval)
                continue
            ran += 1
            if recorded.state == TrialState.FAIL and trial.user_attrs.get(BASELINE_ATTR):
                message = recorded.failure.message if recorded.failure else "failed"
                raise StudyAborted(
                    f"the baseline trial (#{trial.number}) failed: {message}. The workload"
                    " does not train with the plainest loader; fix it before searching"
                )
    return ran


def _unreachable(health: _Health, reporter: Reporter, exc: BaseException, pause: float) -> None:
    health.failed()
    reporter.warning(f"database unreachable ({type(exc).__name__}); retrying in {pause:.0f} s")


def _sweep(session: Session, health: _Health) -> None:
    study = session.study
    with study_lock(_engine(study), study._study_id):
        fail_stale_trials(study, health, session.config.heartbeat.grace_period_s)


def _run_one(
    session: Session,
    health: _Health,
    reporter: Reporter,
    trial: optuna.Trial,
    params: LoaderParams,
) -> Recorded:
    study = session.study
    storage = study._storage
    heartbeat = _Every(
        session.config.heartbeat.interval_s,
        lambda: storage.record_heartbeat(trial._trial_id),  # type: ignore[attr-defined]
        lambda error: reporter.warning(f"cannot write trial #{trial.number}'s heartbeat: {error}"),
        health,
    )
    started = time.perf_counter()
    try:
        heartbeat.start()
        interrupts.check()  # a Ctrl-C while the trial was being taken
        reporter.trial_started(trial.number, params)
        ended = (TrialState.COMPLETE, TrialState.FAIL)
        trials = retrying(
            lambda: study.get_trials(deepcopy=False, states=ended),
            on_retry=lambda exc, pause: _unreachable(health, reporter, exc, pause),
        )
        inferred = known_failure(trials, params, session.hardware.hardware_class)
        reuse = plan_trial(
            trials,
            params,
            session.config.training,
            session.hardware.hardware_class,
            len(session.workload.train_dataset),  # type: ignore[arg-type]
            reuse_val_loss=session.config.training.reuse_val_loss,
        )
        if inferred is not None:
            outcome = TrialOutcome(result=None, failure=inferred[0], wall_s=0.0, startup_s=0.0)
        else:
            outcome = run_isolated(
                session.workload,
                params,
                session.config.training,
                session.device,
                limits=session.config.limits,
                plan=reuse.plan,
            )
        if outcome.failure and outcome.failure.infeasible and trial.user_attrs.get(BASELINE_ATTR):
            # The plainest loader does not train (it diverged or ran out of memory): that is
            # no region for the sampler to avoid but a broken workload; the study stops.
            outcome = dataclasses.replace(
                outcome, failure=dataclasses.replace(outcome.failure, infeasible=False)
            )
        recorded = record(
            study,
            trial,
            outcome,
            reuse=reuse,
            inferred_from=inferred[1] if inferred else None,
            on_retry=lambda exc, pause: _unreachable(health, reporter, exc, pause),
        )
    except KeyboardInterrupt:
        # Whenever Ctrl-C lands (before, during or after the training), the trial ends
        # interrupted; if its outcome was already stored, this changes nothing.
        record_interrupted(study, trial)
        raise
    finally:
        heartbeat.stop()
    event = retrying(
        lambda: _event(session, trial, params, recorded, started),
        on_retry=lambda exc, pause: _unreachable(health, reporter, exc, pause),
    )
    reporter.trial_finished(event)
    return recorded


def _event(
    session: Session,
    trial: optuna.Trial,
    params: LoaderParams,
    recorded: Recorded,
    started: float,
) -> TrialEvent:
    study = session.study
    feasible = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if is_feasible(t)
    ]
    failure = recorded.failure
    state = "failed" if recorded.state == TrialState.FAIL else "complete"
    if recorded.infeasible:
        state = "infeasible"
    values = recorded.values if state == "complete" else None
    return TrialEvent(
        number=trial.number,
        params=params,
        state=state,
        throughput=values[0] if values else None,
        val_loss=values[1] if values else None,
        failure=f"{failure.reason}: {failure.message}" if failure else None,
        hint=failure.hint if failure else None,
        duration_s=time.perf_counter() - started,
        finished=count_finished(study),
        budget=session.budget,
        pareto_size=len(study.best_trials),
        best_throughput=max((t.values[0] for t in feasible), default=None),
        best_val_loss=min((t.values[1] for t in feasible), default=None),
        confirmation=bool(trial.user_attrs.get(CONFIRMATION_ATTR)),
        val_loss_from=recorded.val_loss_from,
        loader_efficiency=recorded.loader_efficiency,
    )
