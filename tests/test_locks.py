"""The host lock (one trial per machine unless pinned) and the study lock (one worker at a
time counts the budget), on real lock files and real database servers."""

from __future__ import annotations

import multiprocessing
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy

from loader_search.locks import StudyLockTimeout, host_lock, study_lock
from tests.conftest import MARIADB_URL, POSTGRES_URL, scratch_database


def _waits(directory: Path, held: dict[str, object], wanted: dict[str, object]) -> bool:
    """Whether taking ``wanted`` waits while another thread holds ``held``."""
    taken = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with host_lock(directory=directory, **held):  # type: ignore[arg-type]
            taken.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(10)
    waited: list[bool] = []
    try:
        # on_wait runs only when the lock is busy; then release the holder so we get it.
        def on_wait() -> None:
            waited.append(True)
            release.set()

        with host_lock(directory=directory, on_wait=on_wait, **wanted):  # type: ignore[arg-type]
            pass
    finally:
        release.set()
        thread.join()
    return bool(waited)


def test_unpinned_trials_take_turns(tmp_path: Path) -> None:
    assert _waits(tmp_path, {}, {})


def test_pinned_trials_with_disjoint_sets_run_side_by_side(tmp_path: Path) -> None:
    assert not _waits(tmp_path, {"cpus": [0]}, {"cpus": [1]})
    assert not _waits(tmp_path, {"cpus": [0], "gpu": 0}, {"cpus": [1], "gpu": 1})


def test_overlapping_or_unpinned_trials_wait(tmp_path: Path) -> None:
    assert _waits(tmp_path, {"cpus": [0, 1]}, {"cpus": [1]})
    assert _waits(tmp_path, {"cpus": [0], "gpu": 0}, {"cpus": [1], "gpu": 0})
    assert _waits(tmp_path, {"cpus": [0]}, {})  # an unpinned trial needs the whole host
    assert _waits(tmp_path, {}, {"cpus": [0]})


def test_lock_files_are_usable_by_every_user(tmp_path: Path) -> None:
    with host_lock(cpus=[3], directory=tmp_path):
        pass
    for name in ("host.lock", "cpu-3.lock"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == 0o666, oct(mode)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_forked_trial_does_not_inherit_the_sqlite_study_lock(tmp_path: Path) -> None:
    """A trial forked while the sweeper thread holds the study lock must not keep holding it
    for the whole trial (it would block every local worker)."""
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'study.db'}")
    forked = threading.Event()
    child: list[multiprocessing.process.BaseProcess] = []

    def sweeper() -> None:
        with study_lock(engine, 1):
            process = multiprocessing.get_context("fork").Process(target=_sleep, args=(5,))
            process.start()  # the "trial", forked while the lock is held
            child.append(process)
            forked.set()

    thread = threading.Thread(target=sweeper)
    thread.start()
    assert forked.wait(10)
    thread.join()
    start = time.monotonic()
    with study_lock(engine, 1):
        waited = time.monotonic() - start
    assert child[0].is_alive()  # the child still runs, yet the lock was free
    child[0].terminate()
    child[0].join()
    assert waited < 3


@pytest.fixture(params=["postgresql", "mariadb"])
def server_db(request: pytest.FixtureRequest) -> Iterator[str]:
    with scratch_database(POSTGRES_URL if request.param == "postgresql" else MARIADB_URL) as url:
        yield url


def test_the_study_lock_excludes_and_times_out_with_a_clear_error(server_db: str) -> None:
    engine = sqlalchemy.create_engine(server_db)
    other = sqlalchemy.create_engine(server_db)
    try:
        with study_lock(engine, 7):
            with (
                pytest.raises(StudyLockTimeout, match="waited 1 s for study #7's lock"),
                study_lock(other, 7, timeout_s=1),
            ):
                pass
            with study_lock(other, 8, timeout_s=1):  # another study's lock is free
                pass
        with study_lock(other, 7, timeout_s=1):  # released
            pass
    finally:
        engine.dispose()
        other.dispose()
