"""Nothing a command starts outlives its trial, nor the worker that ran it; and nothing it
prints can freeze or fill the worker. Real scripts in real processes; "nothing left" is read
from ``/proc`` by the trial's marker variable, which every process of the trial inherits,
so a process re-parented to init is still found."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from loader_search.params import LoaderParams, RunPlan, TrainingSettings, TrialLimits
from loader_search.trial import CommandSpec, TrialJob, TrialOutcome, run_isolated
from loader_search.trial._command_output import LINE_BYTES, SLOW_MATCHES, Output
from loader_search.trial._failures import BUDGET_NOT_HONOURED, EXCEPTION, NO_VAL_LOSS
from loader_search.trial._keeper import FOLDER_PREFIX, MARKER_ENV, OWNER_FILE, remove_stale
from tests.test_command import _script

# A daemon as the books make one: fork, a session of its own, fork again, the middle process
# gone, the grandchild re-parented (to init, without a subreaper) and holding the output pipe.
DAEMON = """
import os as _os
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        open("daemon.pid", "w").write(str(_os.getpid()))
        while True:
            time.sleep(1)
    _os._exit(0)
time.sleep(0.3)
"""


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary folder of this test's own: the trial folders (and markers) made here."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def marked_under(parent: Path) -> list[int]:
    """Live processes whose trial marker names a folder in ``parent``."""
    needle = f"\0{MARKER_ENV}={parent}{os.sep}{FOLDER_PREFIX}".encode()
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as file:
                if needle in b"\0" + file.read():
                    found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


def _job(
    folder: Path, argv: list[str], *, pattern: str | None = None, train_samples: int = 1024
) -> TrialJob:
    return TrialJob(
        None,
        LoaderParams(batch_size=32),
        TrainingSettings(train_samples=train_samples, batch_size=32, lr=0.1, warmup_batches=2),
        "cpu",
        plan=RunPlan(),
        command=CommandSpec(tuple(argv), str(folder), val_loss_pattern=pattern),
    )


def _run(job: TrialJob, tmp: Path, timeout_s: float = 30.0) -> TrialOutcome:
    outcome = run_isolated(job, limits=TrialLimits(trial_timeout_s=timeout_s))
    assert marked_under(tmp) == [], "processes of the trial left running"
    assert not list(tmp.glob(f"{FOLDER_PREFIX}*")), "the trial's folder was left"
    return outcome


def test_a_double_forked_daemon_ends_with_its_trial(tmp_path: Path, private_tmp: Path) -> None:
    script = _script(tmp_path, before=textwrap.dedent(DAEMON))
    started = time.perf_counter()
    outcome = _run(_job(tmp_path, [sys.executable, str(script)]), private_tmp)
    assert outcome.failure is None, outcome.failure
    # It held the output pipe open: the trial did not wait on it.
    assert time.perf_counter() - started < 30
    pid = int((tmp_path / "daemon.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_worker_killed_outright_takes_its_command_and_folder_with_it(
    tmp_path: Path, private_tmp: Path
) -> None:
    # The script spins (100% CPU) and leaves a daemon; no DataLoader, so the first look runs
    # until the worker is killed.
    (tmp_path / "spin.py").write_text(
        "import time\n" + textwrap.dedent(DAEMON) + "while True:\n    pass\n"
    )
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    command = [sys.executable, "spin.py"]
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loader_search",
            "run",
            "--storage",
            "sqlite:///s.db",
            "--",
            *command,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while not (tmp_path / "daemon.pid").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "daemon.pid").exists(), "the command never started"
        assert len(marked_under(private_tmp)) >= 2  # the script and its daemon (and keeper)
        run.kill()
        run.wait(timeout=10)
        deadline = time.time() + 15
        while (marked_under(private_tmp) or list(private_tmp.glob(f"{FOLDER_PREFIX}*"))) and (
            time.time() < deadline
        ):
            time.sleep(0.1)
        assert marked_under(private_tmp) == []
        assert not list(private_tmp.glob(f"{FOLDER_PREFIX}*"))
    finally:
        with_marker = marked_under(private_tmp)
        for pid in with_marker:  # never leave a spinner behind a failed assertion
            os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()


def test_the_next_start_removes_a_dead_trials_folder_and_processes(private_tmp: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = private_tmp / f"{FOLDER_PREFIX}stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(f'{{"pid": {dead.pid}, "started": 1, "command": 1}}')
    left = subprocess.Popen(["sleep", "300"], env={**os.environ, MARKER_ENV: str(stale)})
    mine = private_tmp / f"{FOLDER_PREFIX}alive"  # a running keeper's: kept
    mine.mkdir()
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    started = int(stat[stat.rfind(")") + 2 :].split()[19])
    (mine / OWNER_FILE).write_text(f'{{"pid": {os.getpid()}, "started": {started}}}')
    ended = private_tmp / f"{FOLDER_PREFIX}ended"  # its keeper ended, its worker cleans it
    ended.mkdir()
    owner = {"pid": dead.pid, "started": 1, "worker": os.getpid(), "worker_started": started}
    (ended / OWNER_FILE).write_text(json.dumps(owner))
    elsewhere = private_tmp.parent / "elsewhere"  # planted: a link is never followed
    elsewhere.mkdir()
    (elsewhere / OWNER_FILE).write_text(f'{{"pid": {dead.pid}, "started": 1}}')
    (private_tmp / f"{FOLDER_PREFIX}link").symlink_to(elsewhere)
    try:
        assert remove_stale(private_tmp) == [stale]
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert not stale.exists() and mine.exists() and ended.exists()
        assert (elsewhere / OWNER_FILE).exists()
    finally:
        left.kill()


def test_a_command_that_is_no_program_fails_naming_it(tmp_path: Path, private_tmp: Path) -> None:
    (tmp_path / "folder.py").mkdir()
    cases = {
        "no-such-program-here": "was not found on PATH",
        "./missing.py": "does not exist",
        "./folder.py": "is a folder",
    }
    for program, words in cases.items():
        outcome = _run(_job(tmp_path, [program, "--x"]), private_tmp)
        assert outcome.failure is not None
        assert outcome.failure.reason == EXCEPTION
        assert words in outcome.failure.message and program in outcome.failure.message
        assert "workload's code raised" not in outcome.failure.hint


@pytest.mark.timeout(90)
def test_a_second_loader_after_the_budget_does_not_keep_the_trial_alive(
    tmp_path: Path, private_tmp: Path
) -> None:
    # Once the budget ended the training loader, the script trains on another loader for
    # ever: its batches are progress, but not past the trial's limit from the budget's end.
    forever = "\n".join(
        [
            "    if epoch == 0:",
            "        while True:",
            "            for xb, yb in val_loader:",
            "                time.sleep(0.01)",
        ]
    )
    script = _script(tmp_path, after=forever.strip())
    started = time.perf_counter()
    outcome = _run(
        _job(tmp_path, [sys.executable, str(script), "--report", "none"], train_samples=256),
        private_tmp,
        10,  # above a loaded machine's start of torch: the limit past the budget is tested
    )
    assert outcome.failure is not None and outcome.failure.reason == BUDGET_NOT_HONOURED
    assert time.perf_counter() - started < 60


# Backtracks without end in a backtracking engine on a line of a's: the worker's reader must
# not be held (nor, holding the GIL, its signal handling and heartbeats).
EVIL = r"^(?:a|aa)+$|val_loss=([0-9.]+)"


def test_a_pattern_that_backtracks_runs_out_of_time_per_line() -> None:
    output = Output(__import__("regex").compile(EVIL))
    out, into = os.pipe()
    lines = b"".join([b"a" * 40 + b"!\n"] * (SLOW_MATCHES + 5) + [b"val_loss=0.5\n"])
    writer = threading.Thread(target=lambda: (os.write(into, lines), os.close(into)))
    writer.start()
    ticks: list[float] = []
    done = threading.Event()
    reader = threading.Thread(target=output.read, args=(out, done))
    started = time.perf_counter()
    reader.start()
    while reader.is_alive():  # this thread runs on while the pattern matches
        ticks.append(time.perf_counter())
        time.sleep(0.01)
    took = time.perf_counter() - started
    writer.join()
    os.close(out)
    assert output.slow_matches == SLOW_MATCHES  # then the pattern is no longer tried
    assert took < 5
    assert len(ticks) >= took / 0.05  # never held up for long
    assert output.losses == []  # no longer matched: the trial says why (below)


def test_a_trial_whose_pattern_keeps_running_out_of_time_fails_at_once(
    tmp_path: Path, private_tmp: Path
) -> None:
    script = tmp_path / "loud.py"
    script.write_text("import time\nwhile True:\n    print('a' * 40 + '!', flush=True)\n")
    script.write_text(script.read_text() + "    time.sleep(0.05)\n")
    started = time.perf_counter()
    outcome = _run(_job(tmp_path, [sys.executable, str(script)], pattern=EVIL), private_tmp)
    assert outcome.failure is not None and outcome.failure.reason == NO_VAL_LOSS
    assert "val_loss_pattern" in outcome.failure.message
    assert "ran out of time" in outcome.failure.message
    assert time.perf_counter() - started < 20


def test_a_line_without_end_is_kept_short() -> None:
    output = Output(None)
    out, into = os.pipe()
    size = 300 * 2**20

    def write() -> None:
        block = b"x" * 2**20
        for _ in range(size // len(block)):
            os.write(into, block)
        os.write(into, b"\nlast line\n")
        os.close(into)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    writer = threading.Thread(target=write)
    writer.start()
    output.read(out, threading.Event())
    writer.join()
    os.close(out)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB kept for {size / 2**20:.0f} MiB of output"
    first, last = output.tail
    assert first.startswith("x" * LINE_BYTES) and "cut at 8,192 bytes" in first
    assert last == "last line"
