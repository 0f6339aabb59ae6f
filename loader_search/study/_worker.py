"""The loop every process that runs trials goes through, `run` and `worker` alike.

Many workers on many machines share one study and one trial budget. What keeps them honest:

* **One step to count and take.** Counting the trials that used the budget and taking the
  next one (a queued retry first, else a new trial) happen under the study lock
  (`loader_search.team._locks.study_lock`), so N workers never run more than the budget, and on
  SQLite two processes never take the same queued trial. What to do next is decided by
  `loader_search.study._budget.decide`, on the trials read under the lock. Nothing else
  happens under it: sampling the new trial's settings and storing them come after.
* **Heartbeats.** While a trial trains, a thread writes its heartbeat; a sweeper thread
  fails and queues again the trials whose worker died (`loader_search.study._heartbeats`).
  Our own threads are used instead of ``study.optimize``'s so that a database restart does
  not kill the heartbeat, and so that results can be written with retries
  (`loader_search.study._record.record`).
* **One trial per host at a time** (`loader_search.team._locks.host_lock`), unless each worker is
  pinned to its own CPUs and GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search import interrupts
from loader_search.errors import StudyAborted
from loader_search.params import LoaderParams
from loader_search.study._budget import (
    FINISHED_STATES,
    Confirm,
    Decision,
    Done,
    Take,
    Wait,
    confirm_settings,
    count_used,
    decide,
)
from loader_search.study._events import Reporter, Session, TrialEvent
from loader_search.study._guide import Guide, Proposal
from loader_search.study._heartbeats import Every, Health, fail_stale_trials
from loader_search.study._keys import (
    ACCUMULATION_ATTR,
    ACCUMULATION_FROM,
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    DEVICE_ATTR,
    DEVICE_NAME_ATTR,
    FAILURE_MESSAGE,
    FAILURE_REASON,
    HARDWARE_ATTR,
    HARDWARE_CLASS_ATTR,
    MEASURED_OOM_REASONS,
    MICRO_BATCH_ATTR,
    MIXED_HARDWARE_ATTR,
    MODEL_ROUND_ATTR,
    OOM_ATTEMPTS_ATTR,
    PARAMS_ATTR,
    PIPELINE_ATTR,
    PREDICTED_ATTR,
    PREDICTED_BOTTLENECK_ATTR,
    REFUSED,
    STUDY_HARDWARE_ATTR,
    USABLE_CPUS_ATTR,
    WORKER_ATTR,
    study_budget,
)
from loader_search.study._machine import hardware_mismatch
from loader_search.study._optuna_compat import trial_id
from loader_search.study._plan import plan_trial
from loader_search.study._points import is_feasible, pareto_front, trial_points
from loader_search.study._record import (
    Recorded,
    fewer_samples_per_step,
    fit_in_memory,
    known_failure,
    oom_attempt,
    record,
    record_interrupted,
)
from loader_search.study._timings import Clock
from loader_search.study._trials import write_user_attrs
from loader_search.team._locks import host_lock, study_lock
from loader_search.team._storage import outage, retrying
from loader_search.trial._failures import TrialOutcome
from loader_search.trial._job import TrialJob
from loader_search.trial._ranks import resolve_ranks
from loader_search.trial._supervisor import run_isolated

MIN_HOLD_LIMIT_S = 30.0  # the shortest hold limit of the study lock (see `_hold_limit`)

T = TypeVar("T")


def count_finished(study: optuna.Study) -> int:
    """Finished trials that used the study's budget."""
    return count_used(study.get_trials(deepcopy=False), FINISHED_STATES)


@dataclasses.dataclass
class _Worker:
    """One worker process's state across its trials."""

    session: Session
    reporter: Reporter
    health: Health
    patience: Patience
    name: str = dataclasses.field(default_factory=lambda: worker_name())

    def retrying(self, call: Callable[[], T]) -> T:
        """``call``, tried again while the database is unreachable, each wait reported."""
        return retrying(call, on_retry=self.unreachable)

    def unreachable(self, exc: BaseException, pause: float) -> None:
        self.health.failed()
        said = outage(exc, self.session.rdb.url)
        self.reporter.warning(f"database unreachable ({said}); retrying in {pause:.0f} s")


def _take_trial(
    worker: _Worker, clock: Clock
) -> tuple[optuna.Trial, LoaderParams] | Wait | Refused | None:
    """Take the next trial with its settings; `Wait` while the budget is used but other trials
    still run; None when the study is done.

    Under the study lock only what must be one step for the whole team: sweep stale trials,
    read the trials, check the hardware binding, decide on the budget (as stored now: `init`
    or `run --n-trials` elsewhere may have changed it; see `loader_search.study._budget.decide`),
    queue what the decision asks for, and create (or pop) the trial, which then counts
    against the budget. Its first heartbeat is written at once: a RUNNING trial with no
    heartbeat would never be found stale. Sampling its settings and storing what it will
    run come after the lock. Should anything fail between taking it and returning it, it is
    failed without a reason (no budget used) rather than left RUNNING.
    """
    session = worker.session
    study = session.study
    grid = session.config.sampler.name == "grid"
    lock = study_lock(
        session.rdb.engine,
        session.study_id,
        hold_limit_s=_hold_limit(session),
        on_lost=worker.reporter.warning,
    )
    with clock.lock(lock):
        fail_stale_trials(study, worker.health, session.config.workers.grace_period_s)
        trials = study.get_trials(deepcopy=False)
        attrs = study.user_attrs
        _bind_hardware(session, attrs)
        confirm = confirm_settings(attrs, session.config, study.study_name)
        guide = _guide(session, confirm.loss_tolerance)
        # Fitted once per take: for the proposals, this trial's prediction and the snapshot;
        # under the lock only while the model may still propose.
        asks = guide is not None and not grid and guide.may_propose(trials)
        model = guide.model(trials) if guide is not None and asks else None
        proposals = guide.proposals(trials, model) if guide is not None and asks else ()
        decision = _decide(worker, trials, attrs, proposals)
        if isinstance(decision, Done):
            return None
        if isinstance(decision, Wait):
            return decision
        _queue(session, decision)
        trial = study.ask()
        try:
            session.rdb.record_heartbeat(trial_id(trial))
        except BaseException:
            with contextlib.suppress(Exception):
                study.tell(trial, state=TrialState.FAIL)
            raise
    try:
        if guide is not None and not asks:
            model = guide.model(trials)
        if guide is not None and model is not None:
            _store_pipeline(session, attrs, guide.snapshot(trials, model))
        plain = bool(
            trial.user_attrs.get(BASELINE_ATTR) or trial.user_attrs.get(CONFIRMATION_ATTR)
        )
        with warnings.catch_warnings():  # main thread only
            # A queued value outside the space: Optuna warns and runs it; `problem` refuses.
            warnings.filterwarnings("ignore", "Fixed parameter", UserWarning)
            try:
                params = session.space.suggest(trial)
                # The baseline (num_workers=0) may sit outside a searched range.
                refused = session.space.problem(params, baseline=plain)
            except ValueError as exc:  # a queued value that is none of a choice's options
                refused = f"{exc}"
        if refused is not None:
            _refuse(worker, trial, refused)
            return Refused(trial.number, refused)
        stored: dict[str, Any] = {
            PARAMS_ATTR: params.as_dict(),
            WORKER_ATTR: worker.name,
            HARDWARE_CLASS_ATTR: session.hardware.hardware_class,
            HARDWARE_ATTR: session.hardware.as_dict(),
        }
        if model is not None:  # what the model expects, to check it once measured
            prediction = model.predict(params)
            stored[PREDICTED_ATTR] = prediction.throughput
            stored[PREDICTED_BOTTLENECK_ATTR] = prediction.bottleneck
        write_user_attrs(trial, stored)
    except KeyboardInterrupt:
        record_interrupted(study, trial)
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            study.tell(trial, state=TrialState.FAIL)
        raise
    return trial, params


@dataclass(frozen=True)
class Refused:
    """A queued trial whose settings lie outside the study's space (anyone who can write the
    database can queue one): failed without running, no budget used."""

    number: int
    why: str


def _refuse(worker: _Worker, trial: optuna.Trial, why: str) -> None:
    message = f"queued settings refused, not run: {why}; queue settings inside [space]"
    write_user_attrs(trial, {FAILURE_REASON: REFUSED, FAILURE_MESSAGE: message})
    worker.session.study.tell(trial, state=TrialState.FAIL)
    worker.reporter.warning(f"trial #{trial.number}: {message}")


def _decide(
    worker: _Worker,
    trials: Sequence[FrozenTrial],
    attrs: Mapping[str, Any],
    proposals: Sequence[Proposal] = (),
) -> Decision:
    """`decide` on ``trials`` and the study's ``attrs`` as this worker sees them."""
    session = worker.session
    return decide(
        trials,
        study_budget(session.study.study_name, attrs, session.budget),
        confirm_settings(attrs, session.config, session.study.study_name),
        grid_size=session.space.size() if session.config.sampler.name == "grid" else None,
        hardware_class=session.hardware.hardware_class,
        proposals=proposals,
        worker=worker.name,
        owner_silent=worker.patience.owner_silent(),
    )


def _queue(session: Session, decision: Take | Confirm) -> None:
    """Queue the trials ``decision`` asks for, so that the next `ask` takes the first."""
    study = session.study
    if isinstance(decision, Confirm):
        # The next trial of the paired rounds against the baseline (see _confirm).
        study.enqueue_trial(
            session.space.trial_params(decision.remeasure.params),
            user_attrs={
                CONFIRMATION_ATTR: True,
                CONFIRM_ROUND_ATTR: decision.remeasure.round,
            },
            skip_if_exists=False,
        )
        return
    if decision.baseline:
        # Queued by the worker that takes the first trial: the baseline's thread count
        # depends on the machine that runs it.
        batch_size = session.config.training.batch_size
        study.enqueue_trial(session.space.baseline(batch_size), user_attrs={BASELINE_ATTR: True})
    for proposal in decision.propose:
        study.enqueue_trial(
            session.space.trial_params(proposal.params),
            user_attrs={MODEL_ROUND_ATTR: proposal.round},
            skip_if_exists=False,
        )


def _hold_limit(session: Session) -> float:
    """How long this worker may stay silent while it holds the study lock before the database
    gives the lock to the next worker (see `loader_search.team._locks`): the heartbeat grace,
    but never so short that a slow step under the lock (a sampler on a big study, a busy
    database) loses it."""
    return max(float(session.config.workers.grace_period_s), MIN_HOLD_LIMIT_S)


def _guide(session: Session, loss_tolerance: float) -> Guide | None:
    """The pipeline model for this worker's machine class, unless the config turned it off;
    ``loss_tolerance`` is the study's stored one, so every worker proposes alike."""
    if not session.config.sampler.model:
        return None
    hardware = session.hardware
    cuda = session.device.type == "cuda"
    ranks = resolve_ranks(session.config.training.ranks, session.device)
    return Guide(
        session.space,
        "cuda" if cuda else "cpu",
        max(1, hardware.usable_cpus // ranks),  # a rank's share, as the space's
        hardware.hardware_class,
        loss_tolerance,
        ranks=ranks,
    )


def _store_pipeline(session: Session, attrs: Mapping[str, Any], snapshot: dict[str, Any]) -> None:
    """Keep the study's pipeline model (per hardware class) in step with its trials, for
    `best` and the report; written only when it changed."""
    stored = dict(attrs.get(PIPELINE_ATTR) or {})
    if stored.get(session.hardware.hardware_class) != snapshot:
        stored[session.hardware.hardware_class] = snapshot
        session.study.set_user_attr(PIPELINE_ATTR, stored)


def _bind_hardware(session: Session, attrs: Mapping[str, Any]) -> None:
    """Bind a new study to this worker's hardware class, or check this worker against it
    (under the study lock: two workers of different classes may start on a fresh study)."""
    hardware = session.hardware
    mine = hardware.hardware_class
    bound = attrs.get(STUDY_HARDWARE_ATTR)
    if bound is None:
        # Once per study. The class in words too, as plain Optuna shows it; all three are
        # part of the class, so they hold for every worker it admits (without --allow-mixed-
        # hardware). Never `torch.cuda.get_device_name`: this process must not start CUDA.
        cuda = hardware.device_type == "cuda"
        described = {
            DEVICE_ATTR: hardware.device_type,
            DEVICE_NAME_ATTR: (hardware.gpu_model if cuda else None) or hardware.cpu_model,
            USABLE_CPUS_ATTR: hardware.usable_cpus,
        }
        for key, value in described.items():
            session.study.set_user_attr(key, value)
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
    interval = session.config.workers.heartbeat_interval_s
    worker = _Worker(
        session,
        reporter,
        Health(),
        Patience(session.config.workers.grace_period_s),
    )
    sweeper = Every(
        interval,
        lambda: _sweep(session, worker.health),
        lambda error: reporter.warning(f"cannot sweep stale trials: {error}"),
        worker.health,
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
            clock = Clock()
            # First without the host lock, so a worker never queues behind this machine's
            # other trials only to learn that the study is done or has nothing to take.
            with clock.part("look_ahead"):
                ahead = worker.retrying(functools.partial(_look_ahead, worker))
            if isinstance(ahead, Done):
                break
            if isinstance(ahead, Wait):
                worker.patience.saw(ahead)
                _wait_for_others(reporter, ahead, interval)
                continue
            host = host_lock(
                session.cpus,
                session.gpu,
                on_wait=lambda holder: reporter.preparing(
                    f"waiting for the host lock held by {holder}"
                ),
                study=session.study.study_name,
            )
            with clock.lock(host, name="host"):
                with clock.part("take"):
                    taken = worker.retrying(functools.partial(_take_trial, worker, clock))
                if taken is None:
                    break
                if isinstance(taken, tuple):
                    trial, params = taken
                    recorded = _run_one(worker, trial, params, clock)
            if isinstance(taken, Refused):
                continue  # nothing ran: take the next
            if isinstance(taken, Wait):
                # Outside the host lock: the trials we wait for may need this host.
                worker.patience.saw(taken)
                _wait_for_others(reporter, taken, interval)
                continue
            ran += 1
            clock.write(study=session.study.study_name, trial=trial.number)
            if recorded.state == TrialState.FAIL and trial.user_attrs.get(BASELINE_ATTR):
                message = recorded.failure.message if recorded.failure else "failed"
                raise StudyAborted(
                    f"the baseline trial (#{trial.number}) failed: {message}. The workload"
                    " does not train with the plainest loader; fix it before searching"
                )
    return ran


def _look_ahead(worker: _Worker) -> Done | Wait | None:
    """`decide` read without any lock: `Done` or `Wait` when the study has nothing to take
    (only more trials can change that, so it cannot be wrong in a way that loses work), else
    None: take the next trial under the host and study locks, which decide again."""
    study = worker.session.study
    decision = _decide(worker, study.get_trials(deepcopy=False), study.user_attrs)
    return decision if isinstance(decision, (Done, Wait)) else None


class Patience:
    """How long this worker has waited while the confirmation rounds ran on another: the same
    last confirmation trial seen for ``grace_s`` (by this worker's own clock; workers' clocks
    differ) means their worker fell silent, and this one takes the rounds over."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.seen: tuple[int, float] | None = None  # (last confirmation trial, first seen)

    def saw(self, wait: Wait) -> None:
        if wait.last_confirmation is None:
            return
        if self.seen is None or self.seen[0] != wait.last_confirmation:
            self.seen = (wait.last_confirmation, time.monotonic())

    def owner_silent(self) -> bool:
        return self.seen is not None and time.monotonic() - self.seen[1] >= self.grace_s


def worker_name() -> str:
    """This worker as its trials name it (`WORKER_ATTR`): host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _wait_for_others(reporter: Reporter, wait: Wait, interval: float) -> None:
    if wait.rounds_on is not None:
        reporter.preparing(
            f"the confirmation rounds run on worker {wait.rounds_on}, one worker per machine"
            " class; waiting (they are taken over if it stays silent for the grace period)"
        )
    else:
        reporter.preparing(
            f"budget used; waiting for {wait.running} trial(s) running elsewhere"
            " (a dead worker's trial is retried after the grace period)"
        )
    interrupts.sleep(interval)


def _sweep(session: Session, health: Health) -> None:
    study = session.study
    with study_lock(session.rdb.engine, session.study_id, hold_limit_s=_hold_limit(session)):
        fail_stale_trials(study, health, session.config.workers.grace_period_s)


def _run_one(worker: _Worker, trial: optuna.Trial, params: LoaderParams, clock: Clock) -> Recorded:
    session = worker.session
    study = session.study
    heartbeat = Every(
        session.config.workers.heartbeat_interval_s,
        lambda: session.rdb.record_heartbeat(trial_id(trial)),
        lambda error: worker.reporter.warning(
            f"cannot write trial #{trial.number}'s heartbeat: {error}"
        ),
        worker.health,
    )
    started = time.perf_counter()
    try:
        heartbeat.start()
        interrupts.check()  # a Ctrl-C while the trial was being taken
        worker.reporter.trial_started(trial.number, params)
        hardware_class = session.hardware.hardware_class
        accumulate = session.config.training.gradient_accumulation == "auto"
        extra: dict[str, object] = {}
        with clock.part("plan"):
            trials = worker.retrying(functools.partial(study.get_trials, deepcopy=False))
            ended = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
            if accumulate:
                params, forced_by = fit_in_memory(ended, params, hardware_class)
                if forced_by is not None:
                    extra[ACCUMULATION_FROM] = forced_by
            inferred = known_failure(ended, params, hardware_class)
        attempts: list[dict[str, object]] = []
        while True:
            reuse = plan_trial(
                ended,
                params,
                session.config.training,
                hardware_class,
                len(session.workload.train_dataset),  # type: ignore[arg-type]
                reuse_val_loss=session.config.training.reuse_val_loss,
            )
            if inferred is not None:
                outcome = TrialOutcome(result=None, failure=inferred[0], wall_s=0.0, startup_s=0.0)
                break
            job = TrialJob(
                session.workload, params, session.config.training, session.device, plan=reuse.plan
            )
            with clock.part("job"):
                outcome = run_isolated(job, limits=session.config.limits)
            smaller = fewer_samples_per_step(params) if accumulate else None
            failure = outcome.failure
            if failure is None or failure.reason not in MEASURED_OOM_REASONS or smaller is None:
                break
            # Out of memory: the same batch again, as twice as many micro-batches of half.
            attempts.append(oom_attempt(params, failure))
            worker.reporter.warning(
                f"trial #{trial.number}: {params.describe()} ran out of memory"
                f" ({failure.reason}); training it as {smaller.accumulation_steps}"
                f" micro-batches of {smaller.micro_batch_size}"
            )
            params = smaller
        extra[PARAMS_ATTR] = params.as_dict()
        extra[MICRO_BATCH_ATTR] = params.micro_batch_size
        extra[ACCUMULATION_ATTR] = params.accumulation_steps
        if attempts:
            extra[OOM_ATTEMPTS_ATTR] = attempts
        if outcome.failure and outcome.failure.infeasible and trial.user_attrs.get(BASELINE_ATTR):
            # The plainest loader does not train (it diverged or ran out of memory): that is
            # no region for the sampler to avoid but a broken workload; the study stops.
            outcome = dataclasses.replace(
                outcome, failure=dataclasses.replace(outcome.failure, infeasible=False)
            )
        with clock.part("record"):
            recorded = record(
                study,
                trial,
                outcome,
                reuse=reuse,
                inferred_from=inferred[1] if inferred else None,
                extra=extra,
                on_retry=worker.unreachable,
            )
    except KeyboardInterrupt:
        # Whenever Ctrl-C lands (before, during or after the training), the trial ends
        # interrupted; if its outcome was already stored, this changes nothing.
        record_interrupted(study, trial)
        raise
    finally:
        heartbeat.stop()
    with clock.part("event"):
        event = worker.retrying(
            functools.partial(_event, worker, trial, params, recorded, started)
        )
    worker.reporter.trial_finished(event)
    return recorded


def _event(
    worker: _Worker,
    trial: optuna.Trial,
    params: LoaderParams,
    recorded: Recorded,
    started: float,
) -> TrialEvent:
    trials = worker.session.study.get_trials(deepcopy=False)  # one read, not three
    feasible = [t for t in trials if t.state == TrialState.COMPLETE and is_feasible(t)]
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
        finished=count_used(trials, FINISHED_STATES),
        budget=worker.session.budget,
        pareto_size=len(pareto_front(trial_points(feasible))),
        best_throughput=max((t.values[0] for t in feasible), default=None),
        best_val_loss=min((t.values[1] for t in feasible), default=None),
        confirmation=bool(trial.user_attrs.get(CONFIRMATION_ATTR)),
        confirm_round=trial.user_attrs.get(CONFIRM_ROUND_ATTR),
        val_loss_from=recorded.val_loss_from,
        loader_efficiency=recorded.loader_efficiency,
    )
