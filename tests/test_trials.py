"""A worker's writes to its trials (`loader_search.study.work._trials`) and its two connections,
on real SQLite, PostgreSQL and MariaDB studies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from loader_search.params import WorkersSettings
from loader_search.study import DIRECTIONS
from loader_search.study.work import write_user_attrs
from loader_search.team import open_storage, study_lock
from tests.conftest import MARIADB_URL, POSTGRES_URL, scratch_database


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'trials.db'}"
        return
    with scratch_database(POSTGRES_URL if request.param == "postgresql" else MARIADB_URL) as url:
        yield url


def _study(url: str) -> optuna.Study:
    storage = open_storage(url, workers=WorkersSettings(heartbeat_interval_s=1, grace_period_s=4))
    return optuna.create_study(storage=storage, directions=list(DIRECTIONS))


def test_user_attrs_are_written_in_one_transaction(storage_url: str) -> None:
    study = _study(storage_url)
    trial = study.ask()
    commits: list[int] = []
    engine = study._storage._backend.engine  # type: ignore[attr-defined]
    sqlalchemy.event.listen(engine, "commit", lambda connection: commits.append(1))
    attrs = {f"key_{i}": {"value": i, "list": [i, i + 1]} for i in range(12)}
    write_user_attrs(trial, attrs)
    assert len(commits) == 1
    assert study.trials[trial.number].user_attrs == attrs
    assert trial.user_attrs == attrs  # the Trial's own copy, as set_user_attr keeps it
    write_user_attrs(trial, {"key_0": "again"})  # an upsert, not a duplicate key
    assert study.trials[trial.number].user_attrs["key_0"] == "again"

    # A finished trial takes none of them, as Optuna's own writes refuse it.
    study.tell(trial, [1.0, 1.0])
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        write_user_attrs(trial, {"late": 1})
    assert "late" not in study.trials[trial.number].user_attrs


@pytest.mark.parametrize("url", [POSTGRES_URL, MARIADB_URL], ids=["postgresql", "mariadb"])
def test_two_threads_share_a_workers_two_connections_under_the_study_lock(url: str) -> None:
    """A worker has two pooled connections: the study lock holds one while the holder's
    statements use the other. A second thread asking for the lock meanwhile (the sweeper)
    must not take the second connection away to wait with it, or the holder starves."""
    with scratch_database(url) as db:
        study = _study(db)
        storage = study._storage
        engine = storage._backend.engine  # type: ignore[attr-defined]
        assert engine.pool.size() == 2 and engine.pool._max_overflow == 0
        holding = threading.Event()
        waited: list[float] = []

        def sweeper() -> None:
            holding.wait()
            start = time.monotonic()
            with study_lock(engine, study._study_id):
                waited.append(time.monotonic() - start)

        thread = threading.Thread(target=sweeper)
        thread.start()
        with study_lock(engine, study._study_id):
            holding.set()
            time.sleep(0.5)  # the sweeper now waits for the lock
            start = time.monotonic()
            for _ in range(3):  # statements on the holder's second connection
                storage.get_all_trials(study._study_id)
                study.ask()
            worked = time.monotonic() - start
        thread.join(timeout=30)
        assert not thread.is_alive() and waited and waited[0] >= 0.5
        # Without the turns, the holder's statements waited the pool's timeout (60 s), then
        # failed; with them, they run at once.
        assert worked < 30
