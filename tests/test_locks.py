"""The host lock (one trial per machine unless pinned) and the study lock (one worker at a
time counts the budget), on real lock files and real database servers."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy

from loader_search.errors import UserError
from loader_search.team import LOCK_DIR_ENV, StudyLockTimeout, host_lock, study_lock
from loader_search.team import _locks as locks
from tests.conftest import (
    MARIADB_URL,
    NOBODY,
    POSTGRES_URL,
    ROOT,
    SETPRIV,
    TINY_CONFIG,
    as_nobody,
    folder_under_tmp,
    needs_a_second_user,
    run_cli,
    scratch_database,
)


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
    waited: list[str] = []
    try:
        # on_wait runs only when the lock is busy; then release the holder so we get it.
        def on_wait(holder: str) -> None:
            waited.append(holder)
            release.set()

        with host_lock(directory=directory, on_wait=on_wait, **wanted):  # type: ignore[arg-type]
            pass
    finally:
        release.set()
        thread.join()
    for description in waited:  # the holder is a thread of this very process
        assert description.startswith(f"pid {os.getpid()} ("), description
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


# --- Another user of the machine: the lock folder is shared, like /tmp -------------------------
# These run as root and act as a second, real user (nobody) through setpriv, as an attacker on a
# shared machine would: plant links, FIFOs and folders, or hold the lock forever.


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder under /tmp that nobody can reach (tmp_path's parents are 0o700), root's and
    not writable by others."""
    with folder_under_tmp(0o755) as path:
        yield path


@pytest.fixture
def sticky(shared_tmp: Path) -> Path:
    """A good lock folder, like /tmp: root's, world-writable and sticky."""
    folder = shared_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


@pytest.fixture
def victim(shared_tmp: Path) -> Path:
    """A private file of root's that a planted link may point at."""
    path = shared_tmp / "victim"
    path.write_text("secret")
    path.chmod(0o600)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@needs_a_second_user
@pytest.mark.parametrize(("name", "cpus"), [("host.lock", None), ("cpu-0.lock", [0])])
def test_a_planted_symlink_is_refused_and_its_target_left_alone(
    sticky: Path, victim: Path, name: str, cpus: list[int] | None
) -> None:
    as_nobody("ln", "-s", str(victim), str(sticky / name))
    message = rf"the lock file {re.escape(str(sticky / name))} is a symlink.*; remove it"
    with pytest.raises(UserError, match=message), host_lock(cpus, directory=sticky):
        pass
    assert _mode(victim) == 0o600  # not made world-writable
    assert victim.read_text() == "secret"


@needs_a_second_user
def test_a_planted_dangling_symlink_does_not_create_its_target(
    sticky: Path, shared_tmp: Path
) -> None:
    target = shared_tmp / "absent"  # O_CREAT through the link would create it, as root
    as_nobody("ln", "-s", str(target), str(sticky / "gpu-0.lock"))
    with (
        pytest.raises(UserError, match=r"gpu-0\.lock is a symlink"),
        host_lock(directory=sticky, gpu=0),
    ):
        pass
    assert not target.exists()


@needs_a_second_user
def test_a_planted_hard_link_is_used_read_only_and_its_file_left_alone(sticky: Path) -> None:
    theirs = sticky / "theirs"
    as_nobody("sh", "-c", f"umask 077 && echo data > {theirs} && ln {theirs} {sticky}/host.lock")
    with host_lock(directory=sticky):
        pass
    assert _mode(theirs) == 0o600
    assert theirs.read_text() == "data\n"
    assert theirs.stat().st_uid == NOBODY


@needs_a_second_user
def test_a_planted_fifo_is_refused_at_once(sticky: Path) -> None:
    as_nobody("mkfifo", "-m", "666", str(sticky / "host.lock"))
    outcome: list[BaseException] = []

    def take() -> None:
        try:
            with host_lock(directory=sticky):
                pass
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=take, daemon=True)  # would hang in open() on the FIFO
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "opening a planted FIFO hung"
    assert isinstance(outcome[0], UserError), outcome
    assert str(outcome[0]) == (
        f"the lock file {sticky / 'host.lock'} is a FIFO, not a regular file; remove it"
    )


@needs_a_second_user
def test_another_users_lock_file_in_a_sticky_folder_is_used_as_it_is(sticky: Path) -> None:
    """The host lock is shared by every user on purpose; only its mode is its owner's."""
    as_nobody("sh", "-c", f"umask 022 && : > {sticky}/host.lock")
    assert _mode(sticky / "host.lock") == 0o644
    with host_lock(directory=sticky):
        pass
    assert _mode(sticky / "host.lock") == 0o644  # not chmod-ed to 0o666 by root
    assert (sticky / "host.lock").stat().st_uid == NOBODY


@needs_a_second_user
@pytest.mark.parametrize("mode", ["777", "755", "1777"])
def test_a_lock_folder_owned_by_another_user_is_refused(sticky: Path, mode: str) -> None:
    folder = sticky / "theirs"
    as_nobody("mkdir", "-m", mode, str(folder))
    message = (
        f"the lock folder {folder} is owned by uid {NOBODY} (nobody), who could swap its lock"
        f" files for links to your files; remove it, or set {LOCK_DIR_ENV} to a folder you own"
    )
    with pytest.raises(UserError) as raised, host_lock(directory=folder):
        pass
    assert str(raised.value) == message
    assert os.listdir(folder) == []  # root wrote nothing there
    assert _mode(folder) == int(mode, 8)  # nor chmod-ed it


@needs_a_second_user
@pytest.mark.parametrize(("mode", "who"), [("777", "others"), ("775", "its group")])
def test_a_lock_folder_writable_without_the_sticky_bit_is_refused(
    shared_tmp: Path, mode: str, who: str
) -> None:
    folder = shared_tmp / "open"
    folder.mkdir()
    folder.chmod(int(mode, 8))
    message = (
        rf"{re.escape(str(folder))} is writable by {who} without the sticky bit \(mode {mode}\)"
    )
    with pytest.raises(UserError, match=message), host_lock(directory=folder):
        pass
    assert os.listdir(folder) == []


@needs_a_second_user
def test_a_symlinked_lock_folder_is_refused(sticky: Path, shared_tmp: Path) -> None:
    target = shared_tmp / "target"
    target.mkdir()
    target.chmod(0o1777)  # a good folder, but the link to it could be swapped at any time
    as_nobody("ln", "-s", str(target), str(sticky / "link"))
    message = f"the lock folder {sticky / 'link'} is a symlink; remove it, or set {LOCK_DIR_ENV}"
    with pytest.raises(UserError, match=re.escape(message)), host_lock(directory=sticky / "link"):
        pass
    assert os.listdir(target) == []


def test_a_missing_lock_folder_is_made_sticky_and_world_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "new" / "locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(folder))
    with host_lock():
        pass
    assert _mode(folder) == 0o1777
    assert _mode(folder / "host.lock") == 0o666


@needs_a_second_user
def test_a_process_refuses_a_configured_lock_folder_another_user_owns(sticky: Path) -> None:
    folder = sticky / "theirs"
    as_nobody("mkdir", "-m", "1777", str(folder))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from loader_search.team._locks import host_lock\nwith host_lock(): pass",
        ],
        env={**os.environ, LOCK_DIR_ENV: str(folder)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert (
        f"UserError: the lock folder {folder} is owned by uid {NOBODY} (nobody)" in result.stderr
    )
    assert os.listdir(folder) == []


@needs_a_second_user
def test_the_sqlite_study_lock_never_follows_a_planted_symlink(
    sticky: Path, victim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_DIR_ENV, str(sticky))
    database = tmp_path / "study.db"
    name = locks.sqlite_lock_name(str(database))
    as_nobody("ln", "-s", str(victim), f"{sticky}/{name}")
    engine = sqlalchemy.create_engine(f"sqlite:///{database}")
    with (
        pytest.raises(UserError, match=rf"{re.escape(name)} is a symlink"),
        study_lock(engine, 1),
    ):
        pass
    assert _mode(victim) == 0o600


@needs_a_second_user
def test_another_users_sqlite_study_lock_file_is_refused_in_one_line(
    sticky: Path, shared_tmp: Path
) -> None:
    database = shared_tmp / "study.db"
    planted = sticky / locks.sqlite_lock_name(str(database))
    planted.touch()
    planted.chmod(0o644)  # root's: nobody cannot lock it
    code = (
        "import sys, sqlalchemy\n"
        "from loader_search.team._locks import study_lock\n"
        "with study_lock(sqlalchemy.create_engine(sys.argv[1]), 1): pass"
    )
    assert SETPRIV is not None
    result = subprocess.run(
        [
            *(SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"),
            *(sys.executable, "-c", code, f"sqlite:///{database}"),
        ],
        env={**os.environ, LOCK_DIR_ENV: str(sticky)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"UserError: the study lock file {planted} is not writable by you" in result.stderr


# Holds the SQLite study lock of argv[1] until its stdin closes.
_SQLITE_HOLDER = """
import sys, sqlalchemy
from loader_search.team._locks import study_lock
with study_lock(sqlalchemy.create_engine(sys.argv[1]), 1):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_the_sqlite_study_lock_excludes_processes_however_they_name_the_file(
    tmp_path: Path, private_lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # for the relative spelling
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "alias").symlink_to(data)
    holder = subprocess.Popen(
        [sys.executable, "-c", _SQLITE_HOLDER, f"sqlite:///{data / 'study.db'}"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held\n"
        # The same file through a symlinked folder, and relative to another working folder.
        for url in (f"sqlite:///{tmp_path / 'alias' / 'study.db'}", "sqlite:///data/study.db"):
            name = locks.sqlite_lock_name(sqlalchemy.make_url(url).database or "")
            assert name == locks.sqlite_lock_name(str(data / "study.db"))
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'alias' / 'study.db'}")
        got = threading.Event()

        def take() -> None:
            with study_lock(engine, 1):
                got.set()

        thread = threading.Thread(target=take)
        thread.start()
        assert not got.wait(1.0)  # the other process holds it
        holder.stdin.close()  # it lets go
        assert got.wait(10)
        thread.join()
    finally:
        holder.kill()
        holder.wait()
    # Nothing beside the database; the lock file lives in the lock folder.
    assert sorted(os.listdir(data)) == []
    assert (private_lock_dir / locks.sqlite_lock_name(str(data / "study.db"))).is_file()


# A holder that prints its pid, takes the host lock when told to, and holds it until its stdin
# closes.
_HOLDER = """
import os, sys
from pathlib import Path
from loader_search.team._locks import host_lock
print(os.getpid(), flush=True)
sys.stdin.readline()
with host_lock(directory=Path(sys.argv[1]), study=sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _start_holder(
    folder: Path, study: str, *, as_nobody: bool
) -> tuple[subprocess.Popen[str], int]:
    assert SETPRIV is not None
    user = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    holder = subprocess.Popen(
        [*(user if as_nobody else []), sys.executable, "-c", _HOLDER, str(folder), study],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    return holder, int(holder.stdout.readline())


def _wait_behind(holder: subprocess.Popen[str], folder: Path) -> list[str]:
    """Let ``holder`` take the lock, then wait for it; returns what ``on_wait`` was told."""
    assert holder.stdin is not None and holder.stdout is not None
    stdin = holder.stdin
    stdin.write("go\n")
    stdin.flush()
    assert holder.stdout.readline() == "held\n"
    told: list[str] = []

    def on_wait(description: str) -> None:
        told.append(description)
        stdin.close()  # now let it go

    try:
        with host_lock(directory=folder, on_wait=on_wait):
            pass
    finally:
        if not stdin.closed:  # the wait failed before on_wait: do not leave it holding
            holder.kill()
            stdin.close()
        holder.wait(30)
    return told


@needs_a_second_user
def test_a_waiter_is_told_who_holds_the_lock(sticky: Path) -> None:
    holder, pid = _start_holder(sticky, "held-study", as_nobody=True)
    told = _wait_behind(holder, sticky)
    assert len(told) == 1
    assert re.fullmatch(
        rf"pid {pid} \(user nobody, study held-study, since \d\d:\d\d:\d\d, \d+ s ago\)", told[0]
    ), told
    assert holder.returncode == 0
    assert not (sticky / f"holder-{pid}.json").exists()  # its note went with the lock


@needs_a_second_user
def test_a_note_written_by_another_user_is_not_trusted(sticky: Path) -> None:
    holder, pid = _start_holder(sticky, "real-study", as_nobody=False)
    spoof = {"pid": pid, "user": "root", "study": "spoofed", "since": time.time()}
    # nobody writes the note root's holder would write, before it can.
    as_nobody(
        sys.executable,
        "-c",
        "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
        str(sticky / f"holder-{pid}.json"),
        json.dumps(spoof),
    )
    told = _wait_behind(holder, sticky)
    assert len(told) == 1
    assert "spoofed" not in told[0]
    # Named from the kernel instead: its user, command and start.
    assert re.fullmatch(
        rf"pid {pid} \(user root, python[\w.]*, started \d\d:\d\d:\d\d, \d+ s ago\)", told[0]
    ), told
    assert (sticky / f"holder-{pid}.json").stat().st_uid == NOBODY  # not root's to remove


def test_a_long_wait_names_the_holder_again_and_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(locks, "_WAIT_REPORT_S", 0.2)
    taken, heard_enough = threading.Event(), threading.Event()
    told: list[str] = []

    def holder() -> None:
        with host_lock(directory=tmp_path, study="long"):
            taken.set()
            heard_enough.wait(30)  # let go only once the waiter has reported 4 times

    def on_wait(text: str) -> None:
        told.append(text)
        if len(told) == 4:
            heard_enough.set()

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(10)
    with host_lock(directory=tmp_path, on_wait=on_wait):
        pass
    thread.join()
    # At the start, then every 0.2 s. The first 4 were all taken while the holder held the
    # lock; a 5th may catch it letting go (its note gone, its lock not yet).
    assert len(told) >= 4 and heard_enough.is_set(), told
    holder_named = f"pid {os.getpid()} (user root, study long, since "
    assert all(t.startswith(holder_named) for t in told[:4]), told


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


_FROZEN_HOLDER = """
import sys, time
import sqlalchemy
from loader_search.team._locks import study_lock

engine = sqlalchemy.create_engine(sys.argv[1])
with study_lock(engine, 7, hold_limit_s=2, on_lost=lambda why: print("lost:", why)):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))  # frozen (SIGSTOP) in here by the test
print("released", flush=True)
"""


def test_a_frozen_holder_loses_the_study_lock_after_its_hold_limit(server_db: str) -> None:
    """SIGSTOP a worker that holds the study lock: its silent session is ended by the server
    after the hold limit (2 s here; a worker's heartbeat grace), and the team goes on."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_HOLDER, server_db, "4"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    other = sqlalchemy.create_engine(server_db)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        start = time.monotonic()
        with study_lock(other, 7, timeout_s=60):
            waited = time.monotonic() - start
        os.kill(holder.pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=60)
    finally:
        holder.kill()
        other.dispose()
    # It waited for the frozen holder (the lock was held), then got the lock within the
    # limit plus the server's slack, not after the 60 s timeout.
    assert 1.0 <= waited <= 8.0, waited
    assert "lost: this worker no longer held study #7's lock" in out
    assert "silent for more than 2 s" in out
    assert out.rstrip().endswith("released")


def test_a_waiter_gets_its_turn_before_a_holder_that_asks_again(tmp_path: Path) -> None:
    """A process running trials back to back releases the host lock and asks again at once;
    a waiter must get the next turn, not wait for the whole run (the turnstile)."""
    held = threading.Event()
    turns: list[float] = []

    def back_to_back() -> None:
        for _ in range(8):
            with host_lock(directory=tmp_path):
                turns.append(time.monotonic())
                held.set()
                time.sleep(0.3)

    thread = threading.Thread(target=back_to_back)
    thread.start()
    assert held.wait(10)
    start = time.monotonic()
    with host_lock(directory=tmp_path):
        waited = time.monotonic() - start
        served_before = len(turns)
    thread.join()
    assert len(turns) == 8
    assert served_before < 8, "the waiter got the lock only after the whole run"
    assert waited < 2.0, waited


def test_a_waiter_stuck_in_the_turnstile_does_not_stall_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter stopped (Ctrl-Z) while in the turnstile would block every later trial: once
    the host lock has been free for a while, the others go on without the turnstile."""
    monkeypatch.setattr(locks, "_STUCK_TURNSTILE_S", 0.5)
    with host_lock(directory=tmp_path):  # makes the lock files
        pass
    stuck = os.open(tmp_path / "queue.lock", os.O_RDONLY)
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)  # the stopped waiter
        told: list[str] = []
        start = time.monotonic()
        with host_lock(directory=tmp_path, on_wait=told.append):
            waited = time.monotonic() - start
    finally:
        os.close(stuck)
    assert 0.5 <= waited < 3.0, waited
    assert told and told[0].startswith(f"pid {os.getpid()} "), told  # the turnstile's holder


# -- the second adversarial pass (issue 28): parents, unreadable lock files ----------------


@needs_a_second_user
def test_a_lock_folder_under_another_users_symlink_is_refused(
    sticky: Path, shared_tmp: Path
) -> None:
    """``<shared>/sym/sub`` with ``sym -> /etc`` planted: root made /etc/sub, mode 1777."""
    etc = shared_tmp / "etc"  # root's, as /etc is
    etc.mkdir()
    as_nobody("ln", "-s", str(etc), str(sticky / "sym"))
    folder = sticky / "sym" / "sub" / "locks"
    message = f"lies under {sticky / 'sym'}, a symlink owned by uid {NOBODY} (nobody)"
    with pytest.raises(UserError, match=re.escape(message)), host_lock(directory=folder):
        pass
    assert os.listdir(etc) == []  # nothing made through the link


def test_a_lock_folder_under_our_own_symlinks_and_dots_is_made_where_they_lead(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "mine").symlink_to(real)  # ours: followed
    (real / "rel").symlink_to("../real2")  # relative, resolved against its own folder
    folder = tmp_path / "mine" / "a" / ".." / "rel" / "sub" / "locks"
    with host_lock(directory=folder):
        pass
    assert (tmp_path / "real2" / "sub" / "locks" / "host.lock").is_file()


@needs_a_second_user
def test_another_users_unreadable_host_lock_is_one_line_naming_its_owner(
    sticky: Path, shared_tmp: Path
) -> None:
    """A host.lock of root's, mode 0600, in the shared folder: nobody's worker cannot open it,
    so every other user's trials would wait on it; said in one line, exit 2, nothing made."""
    (sticky / "host.lock").touch(mode=0o600)
    (sticky / "host.lock").chmod(0o600)
    work = shared_tmp / "work"
    work.mkdir(mode=0o777)
    work.chmod(0o777)
    config = work / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    assert SETPRIV is not None
    result = subprocess.run(
        [
            *(SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"),
            *(sys.executable, "-m", "loader_search", "run", str(config)),
            *("--storage", f"sqlite:///{work / 'study.db'}"),
        ],
        env={**os.environ, LOCK_DIR_ENV: str(sticky), "HOME": str(work)},
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert f"the lock file {sticky / 'host.lock'} belongs to uid 0 (root)" in line, line
    assert "mode 600" in line and "Traceback" not in result.stderr
    assert not (work / "study.db").exists()


@needs_a_second_user
def test_a_planted_host_lock_symlink_is_refused_before_the_study_is_created(
    sticky: Path, victim: Path, tmp_path: Path
) -> None:
    as_nobody("ln", "-s", str(victim), str(sticky / "host.lock"))
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    database = tmp_path / "study.db"
    result = run_cli(
        "run", str(config), "--storage", f"sqlite:///{database}", env={LOCK_DIR_ENV: str(sticky)}
    )
    assert result.returncode == 2, result.stderr
    assert f"the lock file {sticky / 'host.lock'} is a symlink" in result.stderr
    assert not database.exists()  # refused before anything was stored
    assert _mode(victim) == 0o600 and victim.read_text() == "secret"
