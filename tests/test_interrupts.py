"""Ctrl-C while trials run is acted on at safe points, and never lost."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader_search import interrupts
from loader_search.team import host_lock
from tests.conftest import TINY_CONFIG


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


def test_a_signal_inside_an_import_is_acted_on_once_the_import_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module whose import gets a SIGINT and goes on for 0.3 s: the stop must not land in
    # it (inside torch's native start-up one aborted the process) but right after it.
    (tmp_path / "signalled_import.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "deadline = time.monotonic() + 0.3\n"
        "while time.monotonic() < deadline:\n"
        "    pass\n"
        "finished = time.monotonic()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = signal.signal(signal.SIGINT, interrupts.on_signal)
    try:
        with pytest.raises(KeyboardInterrupt):
            import signalled_import  # noqa: F401

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                pass
        stopped = time.monotonic()
        module = sys.modules.get("signalled_import")
        assert module is not None, "the stop landed inside the import"
        assert stopped - module.finished < 1.0, "the stop came long after the import"
        assert interrupts.exit_code() == 130
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        sys.modules.pop("signalled_import", None)


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


# The console script, as a user starts it: its imports (typer, rich, torch, optuna) take the
# first second or two, and a signal may come at any moment of them.
CONSOLE_SCRIPT = Path(sys.executable).parent / "loader-search"
# A traceback frame of `main`, the console script's entry, which handles both signals.
MAIN_FRAME = re.compile(r'loader_search[/\\]cli[/\\]__init__\.py", line \d+, in main\b')


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="the console script is not installed")
@pytest.mark.parametrize(
    ("number", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_from_the_first_moment_on_is_one_line_and_its_exit_code(
    tmp_path: Path, number: signal.Signals, code: int
) -> None:
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=50))  # still running when the last one comes
    for delay in (0.05, 0.2, 0.6, 1.5):
        database = tmp_path / f"study-{delay}.db"
        returncode, stderr = _run_signalled(config, database, delay, number)
        if delay == 0.05 and returncode != code:
            _assert_before_main(number, returncode, stderr, database)
            continue
        assert returncode == code, (delay, returncode, stderr[-2000:])
        assert "Traceback" not in stderr, (delay, stderr[-2000:])
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Interrupted"), (delay, stderr)


# Python's `site` reports an exception in a .pth file's line (an editable install's finder
# runs there) and starts the program anyway: a Ctrl-C it caught never reaches the program.
SITE_CAUGHT = re.compile(r"Error processing line \d+ of .*\.pth(?s:.*)KeyboardInterrupt")


def _run_signalled(
    config: Path, database: Path, delay: float, number: signal.Signals
) -> tuple[int, str]:
    """``loader-search run`` sent ``number`` ``delay`` seconds after its start: its exit code
    and standard error. A run whose Ctrl-C `site` caught goes on as if none came: it is
    killed as soon as its standard error says so."""
    log = database.with_suffix(".stderr")
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [str(CONSOLE_SCRIPT), "run", str(config), "--storage", f"sqlite:///{database}"],
            cwd=database.parent,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            time.sleep(delay)
            process.send_signal(number)
            deadline = time.monotonic() + 120
            while process.poll() is None:
                if SITE_CAUGHT.search(log.read_text()):
                    process.kill()
                assert time.monotonic() < deadline, f"no end 120 s after {number.name}"
                time.sleep(0.05)
        finally:
            process.kill()
            process.wait(timeout=30)
    return process.returncode, log.read_text()


def _assert_before_main(
    number: signal.Signals, returncode: int, stderr: str, database: Path
) -> None:
    """On a busy machine an early signal may come before `main`'s first line, while the
    interpreter starts (its `site`, the editable install's finder) or the console script's
    first imports run (seen in parallel runs: a silent end, a Ctrl-C inside `import typing`,
    one `site` caught). No handler exists yet, so Python's defaults apply: SIGTERM ends the
    process silently; Ctrl-C prints a KeyboardInterrupt traceback and ends it by the signal
    (with 1 inside `site`'s own code or while `__main__` is set up), or `site` catches it in a
    .pth line and the program runs as if none came. Its frames must never reach `main`, and
    nothing may be stored unless the program never saw the signal."""
    if number == signal.SIGINT and SITE_CAUGHT.search(stderr):
        assert not MAIN_FRAME.search(stderr), stderr[-2000:]
        return
    assert not database.exists(), stderr[-2000:]
    if number == signal.SIGTERM:
        assert (returncode, stderr) == (-number, ""), stderr[-2000:]
        return
    assert returncode in (-number, 1), (returncode, stderr[-2000:])
    last = stderr.rstrip().splitlines()[-1] if stderr.strip() else ""
    assert stderr == "" or last.startswith("KeyboardInterrupt"), stderr[-2000:]
    assert not MAIN_FRAME.search(stderr), stderr[-2000:]
