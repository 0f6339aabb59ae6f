"""Taking the next trial, the one step a whole team of workers must take one at a time.

Under the study lock (`loader_search.team._locks.study_lock`), only what must be one step for
the whole team: sweep stale trials, read the trials, bind or check the hardware class, decide on
the budget (`loader_search.study.work._budget.decide`), queue what the decision asks for (a
baseline, a confirmation round, the pipeline model's proposals), and create (or pop) the trial,
which then counts against the budget. Sampling its settings, storing what it will run and
planning it (`loader_search.study.work._plan.plan_job`) come after the lock. A worker first
looks ahead without any lock (`look_ahead`), so that it never queues behind this machine's
other trials only to learn that the study is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from loader_search.params import Objective
from loader_search.study._events import Reporter
from loader_search.study._keys import (
    BASELINE_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    DEVICE_ATTR,
    DEVICE_NAME_ATTR,
    FAILURE_MESSAGE,
    FAILURE_REASON,
    HARDWARE_ATTR,
    HARDWARE_CLASS_ATTR,
    MIXED_HARDWARE_ATTR,
    MODEL_ROUND_ATTR,
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
from loader_search.study._optuna_compat import trial_id
from loader_search.study.search import (
    Guide,
    PipelineModel,
    PipelineSnapshot,
    Proposal,
    ResolvedSpace,
)
from loader_search.study.work._budget import (
    Confirm,
    Decision,
    Done,
    Take,
    Wait,
    confirm_settings,
    decide,
)
from loader_search.study.work._heartbeats import Health, beating, fail_stale_trials
from loader_search.study.work._machine import hardware_mismatch
from loader_search.study.work._plan import Job, plan_job
from loader_search.study.work._record import record_interrupted
from loader_search.study.work._script import baseline_batch_size
from loader_search.study.work._session_state import Session
from loader_search.study.work._timings import Clock
from loader_search.study.work._trials import write_user_attrs
from loader_search.team import outage, retrying, study_lock
from loader_search.trial import FreshHost, resolve_ranks

MIN_HOLD_LIMIT_S = 30.0  # the shortest hold limit of the study lock (see `hold_limit`)

T = TypeVar("T")


@dataclasses.dataclass
class Worker:
    """One worker process's state across its trials."""

    session: Session
    reporter: Reporter
    health: Health
    patience: Patience
    name: str = dataclasses.field(default_factory=lambda: worker_name())

    @property
    def fresh(self) -> FreshHost:
        """The fresh process the confirmation trials run in, kept between them (see
        _worker): the session's."""
        return self.session.fresh

    def retrying(self, call: Callable[[], T]) -> T:
        """``call``, tried again while the database is unreachable, each wait reported."""
        return retrying(call, on_retry=self.unreachable)

    def beating(self, trial: optuna.Trial, call: Callable[[], T]) -> T:
        """``call`` for the taken ``trial`` before its heartbeat thread runs
        (`loader_search.study.work._heartbeats.beating`)."""
        return beating(
            self.session.rdb,
            trial_id(trial),
            call,
            self.session.config.workers.heartbeat_interval_s,
            self.unreachable,
        )

    def unreachable(self, exc: BaseException, pause: float) -> None:
        self.health.failed()
        said = outage(exc, self.session.rdb.url)
        self.reporter.warning(f"database unreachable ({said}); retrying in {pause:.0f} s")


def take_trial(worker: Worker, clock: Clock) -> Job | Wait | Refused | None:
    """Take the next trial, planned as the `Job` it runs; `Wait` while the budget is used but
    other trials still run; None when the study is done.

    Under the study lock only what must be one step for the whole team: sweep stale trials,
    read the trials, check the hardware binding, decide on the budget (as stored now: `init`
    or `run --n-trials` elsewhere may have changed it; see
    `loader_search.study.work._budget.decide`),
    queue what the decision asks for, and create (or pop) the trial, which then counts
    against the budget. Its first heartbeat is written at once: a RUNNING trial with no
    heartbeat would never be found stale. Sampling its settings, storing what it will run
    and planning it on the trials read under the lock come after the lock. An unreachable
    database is waited out with the trial, its heartbeat written on every try
    (`Worker.beating`); should anything else fail between taking it and returning it, it is
    failed without a reason (no budget used) rather than left RUNNING.
    """
    session = worker.session
    study = session.study
    grid = session.config.sampler.name == "grid"
    lock = study_lock(
        session.rdb.engine,
        session.study_id,
        hold_limit_s=hold_limit(session),
        on_lost=worker.reporter.warning,
    )
    with clock.lock(lock):
        fail_stale_trials(study, worker.health, session.config.workers.grace_period_s)
        trials = study.get_trials(deepcopy=False)
        attrs = study.user_attrs
        _bind_hardware(session, attrs)
        confirm = confirm_settings(attrs, session.config, study.study_name)
        guide = _guide(session, confirm.loss_tolerance, confirm.objective)
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
            # Its first heartbeat, at once: a RUNNING trial with no heartbeat is never
            # found stale.
            worker.beating(trial, lambda: None)
        except BaseException:
            with contextlib.suppress(Exception):
                study.tell(trial, state=TrialState.FAIL)
            raise
    # From here on an outage is waited out with this trial (`Worker.beating`), not by
    # taking another.
    try:
        if guide is not None and not asks:
            model = guide.model(trials)
        snapshot = (
            guide.snapshot(trials, model) if guide is not None and model is not None else None
        )
        return worker.beating(
            trial, lambda: _prepare(worker, trial, trials, attrs, model, snapshot)
        )
    except KeyboardInterrupt:
        record_interrupted(study, trial)
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            study.tell(trial, state=TrialState.FAIL)
        raise


def _prepare(
    worker: Worker,
    trial: optuna.Trial,
    trials: Sequence[FrozenTrial],
    attrs: Mapping[str, Any],
    model: PipelineModel | None,
    snapshot: PipelineSnapshot | None,
) -> Job | Refused:
    """Sample the taken ``trial``'s settings, store what it will run and plan its `Job` on
    the study's ``trials`` (after the lock; each step may be tried again)."""
    session = worker.session
    if snapshot is not None:
        _store_pipeline(session, attrs, snapshot)
    plain = bool(trial.user_attrs.get(BASELINE_ATTR) or trial.user_attrs.get(CONFIRMATION_ATTR))
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
    return plan_job(session, trial, params, trials)


@dataclass(frozen=True)
class Refused:
    """A queued trial whose settings lie outside the study's space (anyone who can write the
    database can queue one): failed without running, no budget used."""

    number: int
    why: str


def _refuse(worker: Worker, trial: optuna.Trial, why: str) -> None:
    message = f"queued settings refused, not run: {why}; queue settings inside [space]"
    write_user_attrs(trial, {FAILURE_REASON: REFUSED, FAILURE_MESSAGE: message})
    worker.session.study.tell(trial, state=TrialState.FAIL)
    worker.reporter.warning(f"trial #{trial.number}: {message}")


def _decide(
    worker: Worker,
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
    batch_size = baseline_batch_size(session.space, session.config.training.batch_size)
    queue_decision(session.study, session.space, batch_size, decision)


def queue_decision(
    study: optuna.Study, space: ResolvedSpace, batch_size: int, decision: Take | Confirm
) -> None:
    """`_queue` on its parts (the study, its space, the training's batch size), so that the
    benchmarks' replay queues its trials with this very code."""
    if isinstance(decision, Confirm):
        # The next trial of the paired rounds against the baseline (see _confirm).
        study.enqueue_trial(
            space.trial_params(decision.remeasure.params),
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
        study.enqueue_trial(space.baseline(batch_size), user_attrs={BASELINE_ATTR: True})
    for proposal in decision.propose:
        study.enqueue_trial(
            space.trial_params(proposal.params),
            user_attrs={MODEL_ROUND_ATTR: proposal.round},
            skip_if_exists=False,
        )


def hold_limit(session: Session) -> float:
    """How long this worker may stay silent while it holds the study lock before the database
    gives the lock to the next worker (see `loader_search.team._locks`): the heartbeat grace,
    but never so short that a slow step under the lock (a sampler on a big study, a busy
    database) loses it."""
    return max(float(session.config.workers.grace_period_s), MIN_HOLD_LIMIT_S)


def _guide(session: Session, loss_tolerance: float, objective: Objective) -> Guide | None:
    """The pipeline model for this worker's machine class, unless the config turned it off;
    ``loss_tolerance`` and ``objective`` are the study's stored ones, so every worker
    proposes alike."""
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
        objective=objective,
    )


def _store_pipeline(
    session: Session, attrs: Mapping[str, Any], snapshot: PipelineSnapshot
) -> None:
    """Keep the study's pipeline model (per hardware class) in step with its trials, for
    `best` and the report; written only when it changed."""
    stored = dict(attrs.get(PIPELINE_ATTR) or {})
    written = snapshot.as_dict()
    if stored.get(session.hardware.hardware_class) != written:
        stored[session.hardware.hardware_class] = written
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


def look_ahead(worker: Worker) -> Done | Wait | None:
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


def sweep(session: Session, health: Health) -> None:
    study = session.study
    with study_lock(session.rdb.engine, session.study_id, hold_limit_s=hold_limit(session)):
        fail_stale_trials(study, health, session.config.workers.grace_period_s)
