"""Many worker processes on one study: the real `loader-search worker` command against real
PostgreSQL, MariaDB and SQLite databases (each test creates and drops its own database; the
tests that take PostgreSQL down take down a server of their own, `tests._own_postgres`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from loader_search.study import CONFIRMATION_ATTR, FAILURE_REASON, WORKER_ATTR
from loader_search.study.work import count_finished
from loader_search.workloads import Workload
from tests._own_postgres import OwnPostgres, own_postgres, unavailable
from tests.conftest import (
    CONFIRMED_CONFIG,
    MARIADB_URL,
    POSTGRES_URL,
    ROOT,
    TINY_CONFIG,
    run_cli,
    scratch_database,
)

# Short heartbeats, so that a dead worker's trial is found within seconds.
WORKERS = """
[workers]
heartbeat_interval_s = 1
grace_period_s = 4
max_retry = 2
"""


@pytest.fixture(params=["postgresql", "mariadb"])
def team_db(request: pytest.FixtureRequest) -> Iterator[str]:
    with scratch_database(POSTGRES_URL if request.param == "postgresql" else MARIADB_URL) as url:
        yield url


@pytest.fixture
def postgres_db() -> Iterator[str]:
    with scratch_database(POSTGRES_URL) as url:
        yield url


@pytest.fixture(scope="module")
def own_server() -> Iterator[OwnPostgres]:
    """A PostgreSQL server these tests may stop (the module's tests share it, each with its own
    study names)."""
    why = unavailable()
    if why is not None:
        if os.environ.get("LOADER_SEARCH_REQUIRE_DBS"):
            pytest.fail(f"a private PostgreSQL server is required but cannot be made: {why}")
        pytest.skip(why)
    with own_postgres() as server:
        yield server


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A lock folder of the test's own: other tests' trials on this machine don't wait."""
    return {"LOADER_SEARCH_LOCK_DIR": str(tmp_path / "locks")}


@pytest.fixture
def config(tmp_path: Path) -> Callable[..., Path]:
    def write(trials: int, train_samples: int = 512) -> Path:
        path = tmp_path / "tiny.toml"
        text = TINY_CONFIG.format(trials=trials).replace(
            "train_samples = 512", f"train_samples = {train_samples}"
        )
        path.write_text(text + WORKERS)
        return path

    return write


class Worker:
    """A `loader-search worker` process, its output kept in files."""

    def __init__(self, tmp_path: Path, index: int, args: list[str], env: dict[str, str]) -> None:
        self.log = tmp_path / f"worker-{index}.log"
        self._file = self.log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "loader_search", "worker", *args],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self._file,
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout: float = 300) -> int:
        code = self.process.wait(timeout)
        self._file.close()
        return code

    @property
    def output(self) -> str:
        return self.log.read_text()


def _study(url: str) -> optuna.Study:
    return optuna.load_study(study_name="tiny", storage=url)


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - start


def _assert_budget_honoured(url: str, budget: int) -> optuna.Study:
    study = _study(url)
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    assert count_finished(study) == budget
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    return study


def _run_workers(
    url: str, tmp_path: Path, env: dict[str, str], n: int, extra: list[list[str]] | None = None
) -> list[Worker]:
    workers = [
        Worker(tmp_path, i, ["tiny", "--storage", url, *(extra[i] if extra else [])], env)
        for i in range(n)
    ]
    for worker in workers:
        assert worker.wait() == 0, worker.output
    return workers


@pytest.mark.slow
def test_four_workers_share_one_budget(
    team_db: str, config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    created = run_cli("init", str(config(6)), "--storage", team_db, env=env)
    assert created.returncode == 0, created.stderr
    assert "Created study tiny" in created.stdout
    # Pinned two to a CPU: two trials train at a time, the other two workers wait their turn.
    pins = [["--cpus", str(i % 2)] for i in range(4)]
    started = time.monotonic()
    workers = _run_workers(team_db, tmp_path, env, 4, pins)
    study = _assert_budget_honoured(team_db, 6)
    per_worker = [w.output.count("samples/s  val_loss") for w in workers]
    print(
        f"{team_db.split('+')[0]}: 4 workers, 6 trials in {time.monotonic() - started:.1f} s,"
        f" per worker {per_worker}"
    )
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 6
    assert sum(1 for t in complete if t.user_attrs.get("baseline")) == 1
    for worker in workers:
        assert "error" not in worker.output.lower(), worker.output
        assert "Traceback" not in worker.output
    # More than one worker did the work.
    assert sum("samples/s" in w.output for w in workers) >= 2


@pytest.mark.slow
def test_workers_on_sqlite_share_one_budget(
    config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    url = f"sqlite:///{tmp_path / 'team.db'}"
    assert run_cli("init", str(config(4)), "--storage", url, env=env).returncode == 0
    _run_workers(url, tmp_path, env, 3)
    _assert_budget_honoured(url, 4)


@pytest.mark.slow
def test_a_killed_worker_s_trial_is_retried(
    postgres_db: str, config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    budget = 3
    assert run_cli("init", str(config(budget)), "--storage", postgres_db, env=env).returncode == 0
    victim = Worker(tmp_path, 0, ["tiny", "--storage", postgres_db], env)

    def training() -> bool:
        return bool(_study(postgres_db).get_trials(states=(TrialState.RUNNING,)))

    _wait_for(training, 120, "the first trial to start")
    (running,) = _study(postgres_db).get_trials(states=(TrialState.RUNNING,))
    victim.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait()

    survivor = Worker(tmp_path, 1, ["tiny", "--storage", postgres_db], env)

    def failed() -> bool:
        return _study(postgres_db).trials[running.number].state == TrialState.FAIL

    _wait_for(failed, 60, "the dead worker's trial to be failed")
    recovery_s = time.monotonic() - killed_at
    assert survivor.wait() == 0, survivor.output
    study = _assert_budget_honoured(postgres_db, budget)
    dead = study.trials[running.number]
    assert FAILURE_REASON not in dead.user_attrs  # no result: it does not use the budget
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.state == TrialState.COMPLETE
    assert retry.params == dead.params
    # grace period 4 s, plus a sweep every heartbeat: well under a minute.
    print(f"stale trial failed {recovery_s:.1f} s after SIGKILL")


@pytest.mark.slow
def test_a_database_restart_loses_no_result(
    own_server: OwnPostgres, config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    # Trials of a few seconds, so that the server goes down while both workers train: the
    # GPU stand-in's wait (0.5 ms a sample) makes their length independent of this CPU's
    # speed and of how the search picks their settings.
    budget = 6
    path = config(budget, train_samples=8192)
    stand_in = "val_size = 64\ndevice_us_per_sample = 500"
    path.write_text(path.read_text().replace("val_size = 64", stand_in))
    study_config = str(path)
    postgres_db = own_server.url
    assert run_cli("init", study_config, "--storage", postgres_db, env=env).returncode == 0
    workers = [
        Worker(tmp_path, i, ["tiny", "--storage", postgres_db, "--cpus", str(i)], env)
        for i in range(2)
    ]
    _wait_for(lambda: count_finished(_study(postgres_db)) >= 1, 120, "a first result")

    def just_started() -> bool:  # a trial that will train through the whole restart
        running = _study(postgres_db).get_trials(states=(TrialState.RUNNING,))
        now = datetime.now()
        starts = [t.datetime_start for t in running if t.datetime_start is not None]
        return any((now - start).total_seconds() < 1 for start in starts)

    _wait_for(just_started, 60, "a trial to start")
    restarted_at, restarted_wall = time.monotonic(), datetime.now()
    own_server.restart()
    returned_wall = datetime.now()  # the server was down in between, and is up again
    _wait_for(lambda: _postgres_answers(postgres_db), 60, "PostgreSQL to answer again")
    back_at, back_wall = time.monotonic(), datetime.now()
    for worker in workers:
        assert worker.wait() == 0, worker.output
    study = _assert_budget_honoured(postgres_db, budget)
    # No result was lost: no trial was failed as stale and retried, none failed at all.
    outputs = "\n".join(worker.output for worker in workers)
    assert not [t for t in study.trials if "failed_trial" in t.system_attrs], outputs
    assert not study.get_trials(states=(TrialState.FAIL,)), outputs
    done_after = [
        (t.datetime_complete - back_wall).total_seconds()
        for t in study.trials
        if t.datetime_complete is not None and t.datetime_complete > back_wall
    ]
    assert done_after, "the study ended before the restart: nothing was tested"
    # Trials that were training when the server went down (reported, not asserted: whether
    # one spans the whole restart depends on timing; test_a_result_written_during_an_outage_
    # is_kept checks that case deterministically).
    crossed = [
        t
        for t in study.trials
        if t.datetime_start is not None
        and t.datetime_start < restarted_wall
        and t.datetime_complete is not None
        and t.datetime_complete > returned_wall
    ]
    print(
        f"PostgreSQL restart: answering again {back_at - restarted_at:.1f} s after the"
        f" restart began; next trial finished {min(done_after):.1f} s after that;"
        f" {len(crossed)} trial(s) trained across the outage and kept their results"
    )


@contextlib.contextmanager
def _postgres_down(server: OwnPostgres, seconds: float) -> Iterator[None]:
    """``server`` stopped now and started again ``seconds`` later, while the block runs; on
    leaving it, the server answers again."""
    server.stop()
    restart = threading.Timer(seconds, server.start)
    restart.start()
    try:
        yield
    finally:
        restart.join()
        _wait_for(lambda: _postgres_answers(server.url), 60, "PostgreSQL to answer again")


def _postgres_answers(url: str) -> bool:
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": 5})
        with engine.connect():
            pass
        engine.dispose()
        return True
    except sqlalchemy.exc.OperationalError:
        return False


@pytest.mark.slow
def test_other_hardware_is_refused_unless_allowed(
    postgres_db: str, config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    secret = "Sup3rSecretPw"
    url = postgres_db.replace("postgres@", f"postgres:{secret}@")  # trust auth ignores it
    init = run_cli("init", str(config(3)), "--storage", url, env=env)
    assert init.returncode == 0, init.stderr
    first = run_cli("worker", "tiny", "--storage", url, "--n-trials", "1", env=env)
    assert first.returncode == 0, first.stderr
    # Pinned to one CPU, this machine is another hardware class than the whole of it.
    refused = run_cli("worker", "tiny", "--storage", url, "--cpus", "0", env=env)
    assert refused.returncode == 2
    assert "hardware class" in refused.stderr and "--allow-mixed-hardware" in refused.stderr
    warning, error = refused.stderr.strip().splitlines()  # the password's warning first
    assert warning.startswith("warning: --storage holds a password") and "error:" in error
    mixed = run_cli(
        "worker", "tiny", "--storage", url, "--cpus", "0", "--allow-mixed-hardware", env=env
    )
    assert mixed.returncode == 0, mixed.stderr
    study = _study(postgres_db)
    classes = {t.user_attrs["hardware_class"] for t in study.trials}
    assert len(classes) == 2
    hardware = study.trials[0].user_attrs["hardware"]
    for key in ("cpu_model", "usable_cpus", "ram_bytes", "shm_bytes", "torch_version"):
        assert key in hardware
    # The password shows nowhere: not in any output, not in the study's attributes.
    for result in (init, first, refused, mixed):
        assert secret not in result.stdout + result.stderr
    stored = json.dumps([study.user_attrs, [t.user_attrs for t in study.trials]], default=str)
    assert secret not in stored


def test_ctrl_c_on_a_worker_interrupts_its_trial(
    config: Callable[..., Path], tmp_path: Path, env: dict[str, str]
) -> None:
    url = f"sqlite:///{tmp_path / 'team.db'}"
    # Trials of a few seconds: the signal lands while one trains.
    study_config = str(config(3, train_samples=8192))
    assert run_cli("init", study_config, "--storage", url, env=env).returncode == 0
    worker = Worker(tmp_path, 0, ["tiny", "--storage", url], env)

    def training() -> bool:
        return bool(_study(url).get_trials(states=(TrialState.RUNNING,)))

    _wait_for(training, 120, "a trial to start")
    worker.process.send_signal(signal.SIGINT)
    assert worker.wait(60) == 130
    study = _study(url)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    interrupted = [t for t in study.trials if t.user_attrs.get(FAILURE_REASON) == "interrupted"]
    assert len(interrupted) == 1
    assert "Traceback" not in worker.output


def test_worker_errors_are_one_line(tmp_path: Path, env: dict[str, str]) -> None:
    url = f"sqlite:///{tmp_path / 'none.db'}"
    missing_file = run_cli("worker", "tiny", "--storage", url, env=env)
    assert missing_file.returncode == 2
    assert "no database file" in missing_file.stderr
    assert not (tmp_path / "none.db").exists()
    unreachable = run_cli(
        "worker", "tiny", "--storage", "postgresql+psycopg://u:Hidden123@127.0.0.1:1/db", env=env
    )
    assert unreachable.returncode == 2
    assert "Hidden123" not in unreachable.stderr
    warning, error = unreachable.stderr.strip().splitlines()  # the password's warning first
    assert warning.startswith("warning: --storage holds a password") and "error:" in error


def test_a_result_written_during_an_outage_is_kept(
    own_server: OwnPostgres, tiny_workload: Workload
) -> None:
    """The database stops just as a trial finishes; its result is written once it is back."""
    from loader_search.params import LoaderParams, TrainingSettings
    from loader_search.study import DIRECTIONS
    from loader_search.study.work import record
    from loader_search.team import open_storage
    from loader_search.trial import TrialOutcome, run_trial

    postgres_db = own_server.url
    study = optuna.create_study(
        study_name="outage", storage=open_storage(postgres_db), directions=list(DIRECTIONS)
    )
    trial = study.ask()
    params = LoaderParams(batch_size=16, num_workers=0, torch_threads=1)
    result = run_trial(tiny_workload, params, TrainingSettings(train_samples=256))
    outcome = TrialOutcome(result=result, failure=None, wall_s=1.0, startup_s=0.0)
    with _postgres_down(own_server, 3.0):
        started = time.monotonic()
        record(study, trial, outcome, retry_s=120)
        waited = time.monotonic() - started
    stored = optuna.load_study(study_name="outage", storage=postgres_db).trials[0]
    assert stored.state == TrialState.COMPLETE
    assert stored.values == [result.throughput_samples_per_s, result.val_loss]
    assert stored.constraints == {"feasible": 0.0}
    assert waited >= 2.5  # it really waited for the server


def test_a_taken_trial_waits_out_an_outage_with_its_heartbeat(own_server: OwnPostgres) -> None:
    """The database stops just after a worker took a trial, before its settings are stored
    (no heartbeat thread runs yet): the worker keeps the trial, writing its heartbeat on
    every try and trying no less often than the heartbeat thread would, so that a team's sweep
    after a short outage does not fail it as stale and run it again."""
    from loader_search.params import WorkersSettings
    from loader_search.study import DIRECTIONS
    from loader_search.study._optuna_compat import trial_id
    from loader_search.study.work._heartbeats import beating
    from loader_search.team import open_storage

    postgres_db = own_server.url
    workers = WorkersSettings(heartbeat_interval_s=1, grace_period_s=4)
    storage = open_storage(postgres_db, workers=workers)
    study = optuna.create_study(study_name="taken", storage=storage, directions=list(DIRECTIONS))
    trial = study.ask()
    storage.record_heartbeat(trial_id(trial))
    pauses: list[float] = []
    with _postgres_down(own_server, 3.0):
        started = time.monotonic()
        beating(
            storage,
            trial_id(trial),
            lambda: trial.set_user_attr("stored", True),
            workers.heartbeat_interval_s,
            lambda _, pause: pauses.append(pause),
        )
        waited = time.monotonic() - started
    assert waited >= 2.5  # it really waited for the server
    # Never silent for longer than the heartbeat thread (retrying's own backoff reaches 10 s).
    assert pauses and max(pauses) <= workers.heartbeat_interval_s
    optuna.storages.fail_stale_trials(study)  # a sweep right after: the trial is alive
    (stored,) = optuna.load_study(study_name="taken", storage=postgres_db).trials
    assert stored.state == TrialState.RUNNING
    assert stored.user_attrs == {"stored": True}


@pytest.mark.slow
def test_the_confirmation_rounds_run_on_one_worker(tmp_path: Path, env: dict[str, str]) -> None:
    """Three workers share a study; once its budget is used, its paired rounds all run on
    one of them (drift and neighbours' load then hit every setting of a round alike), while
    the others wait for them to end."""
    url = f"sqlite:///{tmp_path / 'team.db'}"
    path = tmp_path / "confirmed.toml"
    team = WORKERS.replace("grace_period_s = 4", "grace_period_s = 60")
    path.write_text(CONFIRMED_CONFIG.replace('name = "confirmed"', 'name = "tiny"') + team)
    assert run_cli("init", str(path), "--storage", url, env=env).returncode == 0
    _run_workers(url, tmp_path, env, 3)
    trials = _study(url).trials
    rounds = [t for t in trials if t.user_attrs.get(CONFIRMATION_ATTR)]
    assert len(rounds) >= 4, "the rounds ran (the baseline and at least one candidate, twice)"
    assert len({t.user_attrs[WORKER_ATTR] for t in rounds}) == 1
    assert len({t.user_attrs[WORKER_ATTR] for t in trials}) > 1, "the search was shared"
