"""Ctrl-C while trials run is acted on at safe points, and never lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader_search import interrupts
from loader_search.team._locks import host_lock


@pytest.fixture(autouse=True)
def _clear() -> Iterator[None]:
    yield
    interrupts.STOP_REQUESTED.clear()


def test_outside_the_trial_loop_a_stop_raises_at_once() -> None:
    with pytest.raises(KeyboardInterrupt):
        interrupts.request_stop()


def test_inside_the_trial_loop_a_stop_waits_for_a_safe_point() -> None:
    with interrupts.deferred():
        interrupts.request_stop()  # as from a signal handler: no exception here
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    with pytest.raises(KeyboardInterrupt):
        interrupts.request_stop()  # deferral ends with the block


def test_a_wait_for_the_host_lock_ends_on_a_stop(tmp_path: Path) -> None:
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with host_lock(directory=tmp_path):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    threading.Timer(0.5, interrupts.STOP_REQUESTED.set).start()
    started = time.monotonic()
    try:
        with (
            interrupts.deferred(),
            pytest.raises(KeyboardInterrupt),
            host_lock(directory=tmp_path),
        ):
            pass
    finally:
        release.set()
        thread.join()
    assert time.monotonic() - started < 5  # not the holder's 30 s
