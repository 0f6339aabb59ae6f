"""The loop every process that runs trials goes through, `run` and `worker` alike.

Many workers on many machines share one study and one trial budget. What keeps them honest:

* **One step to count and take.** Counting the trials that used the budget and taking the
  next one (a queued retry first, else a new trial) happen under the study lock
  (`loader_search.team._locks.study_lock`), so N workers never run more than the budget, and on
  SQLite two processes never take the same queued trial. What to do next is decided by
  `loader_search.study.work._budget.decide`, on the trials read under the lock. Nothing else
  happens under it: sampling the new trial's settings and storing them come after
  (`loader_search.study.work._take`).
* **Heartbeats.** While a trial trains, a thread writes its heartbeat; a sweeper thread
  fails and queues again the trials whose worker died (`loader_search.study.work._heartbeats`).
  Our own threads are used instead of ``study.optimize``'s so that a database restart does
  not kill the heartbeat, and so that results can be written with retries
  (`loader_search.study.work._record.record`).
* **One trial per host at a time** (`loader_search.team._locks.host_lock`), unless each worker is
  pinned to its own CPUs and GPU.
* **Where a trial trains.** A search trial is a child forked from this worker (no imports,
  no build: cheap). A confirmation trial (``study.confirm_process = "fresh"``, the default)
  is forked instead from a fresh Python process that built its own workload, as a user's
  script does, and shares no memory with the worker
  (`loader_search.study.work._plan.fresh_recipe`, `loader_search.trial.FreshHost`): the
  session starts it beside the worker's own start-up, and it is kept for this worker's
  confirmation trials. Forked from the worker (``"fork"``), the baseline read low more often
  and the claims erred more (benchmarks/RESULTS.md, "The printed speedup against a plain
  loop").
* **One job per trial.** The taken trial comes planned (`loader_search.study.work._plan.Job`):
  the loop trains that job and records its outcome, replanning it only after an
  out-of-memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import optuna
from optuna.trial import TrialState

from loader_search import interrupts
from loader_search.errors import StudyAborted
from loader_search.params import LoaderParams
from loader_search.study._events import EventState, Reporter, TrialEvent
from loader_search.study._keys import (
    ACCUMULATION_ATTR,
    ACCUMULATION_FROM,
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    MICRO_BATCH_ATTR,
    OOM_ATTEMPTS_ATTR,
    PARAMS_ATTR,
    TRIAL_PROCESS_ATTR,
)
from loader_search.study._optuna_compat import trial_id
from loader_search.study._points import is_feasible, pareto_front, trial_points
from loader_search.study.work._budget import FINISHED_STATES, Done, Wait, count_used
from loader_search.study.work._heartbeats import Every, Health
from loader_search.study.work._plan import Job, smaller_job
from loader_search.study.work._record import Recorded, record, record_interrupted
from loader_search.study.work._session_state import Session
from loader_search.study.work._take import Patience, Refused, Worker, look_ahead, sweep, take_trial
from loader_search.study.work._timings import Clock
from loader_search.team import host_lock
from loader_search.trial import TrialOutcome, run_isolated


def count_finished(study: optuna.Study) -> int:
    """Finished trials that used the study's budget."""
    return count_used(study.get_trials(deepcopy=False), FINISHED_STATES)


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
    worker = Worker(
        session,
        reporter,
        Health(),
        Patience(session.config.workers.grace_period_s),
    )
    sweeper = Every(
        interval,
        lambda: sweep(session, worker.health),
        lambda error: reporter.warning(f"cannot sweep stale trials: {error}"),
        worker.health,
    )
    sweeper.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ran = 0
    # Ctrl-C is acted on at safe points from here on (see loader_search.interrupts).
    with contextlib.ExitStack() as stack:
        stack.callback(sweeper.stop)
        stack.callback(worker.fresh.close)
        stack.enter_context(interrupts.deferred())
        # The fresh process built beside this worker's start-up: done before any trial, so
        # that no trial is measured beside its build.
        why = worker.fresh.settle()
        if why is not None:
            reporter.warning(
                f"the fresh process for the confirmation trials: {why}; a new one starts"
                " with the first of them"
            )
        while max_trials is None or ran < max_trials:
            interrupts.check()
            if deadline is not None and time.monotonic() >= deadline:
                break
            clock = Clock()
            # First without the host lock, so a worker never queues behind this machine's
            # other trials only to learn that the study is done or has nothing to take.
            with clock.part("look_ahead"):
                ahead = worker.retrying(functools.partial(look_ahead, worker))
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
                    taken = worker.retrying(functools.partial(take_trial, worker, clock))
                if taken is None:
                    break
                if isinstance(taken, Job):
                    trial = taken.trial
                    recorded = _run_one(worker, taken, clock)
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


def _run_one(worker: Worker, job: Job, clock: Clock) -> Recorded:
    """Run the taken trial's ``job`` and record its outcome, its heartbeat written meanwhile."""
    session, trial = worker.session, job.trial
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
        worker.reporter.trial_started(trial.number, job.params)
        job, outcome = _train(worker, job, clock)
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
                reuse=job.reuse,
                inferred_from=job.inferred[1] if job.inferred else None,
                extra=_stored(job, outcome),
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
            functools.partial(_event, worker, trial, job.params, recorded, started)
        )
    worker.reporter.trial_finished(event)
    return recorded


def _train(worker: Worker, job: Job, clock: Clock) -> tuple[Job, TrialOutcome]:
    """Train ``job`` in its own process (see `TrialJob`); after a measured out-of-memory,
    the next job `smaller_job` plans, until one fits or none is left. Returns the last job
    and its outcome. A job whose failure is already known trains nothing."""
    while True:
        if job.run is None:
            assert job.inferred is not None  # plan_job plans a run for every other job
            known = job.inferred[0]
            return job, TrialOutcome(result=None, failure=known, wall_s=0.0, startup_s=0.0)
        with clock.part("job"):
            outcome = run_isolated(job.run, limits=worker.session.config.limits, host=worker.fresh)
        failure = outcome.failure
        smaller = smaller_job(worker.session, job, failure) if failure is not None else None
        if failure is None or smaller is None:
            return job, outcome
        params = smaller.params
        worker.reporter.warning(
            f"trial #{job.trial.number}: {job.params.describe()} ran out of memory"
            f" ({failure.reason}); training it as {params.accumulation_steps}"
            f" micro-batches of {params.micro_batch_size}"
        )
        job = smaller


def _stored(job: Job, outcome: TrialOutcome) -> dict[str, object]:
    """What the trial stores besides its outcome: the settings it trained with, how, and
    the out-of-memory attempts before them."""
    stored: dict[str, object] = {
        PARAMS_ATTR: job.params.as_dict(),
        MICRO_BATCH_ATTR: job.params.micro_batch_size,
        ACCUMULATION_ATTR: job.params.accumulation_steps,
    }
    if job.forced_by is not None:
        stored[ACCUMULATION_FROM] = job.forced_by
    if job.inferred is None:
        where = "fresh" if job.fresh else "fork"
        stored[TRIAL_PROCESS_ATTR] = where if outcome.isolated else "in-process"
    if job.attempts:
        stored[OOM_ATTEMPTS_ATTR] = list(job.attempts)
    return stored


def _event(
    worker: Worker,
    trial: optuna.Trial,
    params: LoaderParams,
    recorded: Recorded,
    started: float,
) -> TrialEvent:
    trials = worker.session.study.get_trials(deepcopy=False)  # one read, not three
    feasible = [t for t in trials if t.state == TrialState.COMPLETE and is_feasible(t)]
    failure = recorded.failure
    state: EventState = "failed" if recorded.state == TrialState.FAIL else "complete"
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
