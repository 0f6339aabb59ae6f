from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loader_search.workloads import Workload
from loader_search.workloads.synthetic_images import synthetic_images

ROOT = Path(__file__).resolve().parents[1]

# A suite started in the background by a non-interactive shell (`pytest &`, `setsid ... &`)
# inherits SIGINT ignored, and so would every process it starts: then the tests of Ctrl-C
# (which send SIGINT to a CLI run or a trial) wait out their timeouts and fail. Python's own
# handler here makes exec'd children start with the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def private_lock_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A host-lock folder of the test session's own (inherited by the CLI subprocesses): the
    suite never waits for other people's studies on this machine, nor they for it. Tests of
    the locks themselves, and of several workers, give their own folders."""
    folder = tmp_path_factory.mktemp("locks")
    previous = os.environ.get("LOADER_SEARCH_LOCK_DIR")
    os.environ["LOADER_SEARCH_LOCK_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("LOADER_SEARCH_LOCK_DIR", None)
    else:
        os.environ["LOADER_SEARCH_LOCK_DIR"] = previous


# The database servers this project's machines run (docs/development.md).
POSTGRES_URL = os.environ.get(
    "LOADER_SEARCH_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get(
    "LOADER_SEARCH_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test"
)


def require_database(url: str) -> None:
    """Skip when the server is not running here; fail instead under CI's strict setting."""
    from loader_search.team import create_engine

    try:
        engine = create_engine(url)  # with the connect timeout: a silent server fails fast
        with engine.connect():
            pass
        engine.dispose()
    except Exception as exc:
        if os.environ.get("LOADER_SEARCH_REQUIRE_DBS"):
            pytest.fail(f"database {url} is required but unreachable: {exc}")
        pytest.skip(f"database {url} is not reachable here")


@contextlib.contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url``, dropped afterwards, so tests
    that share a server run repeatedly and side by side."""
    from benchmarks.scale import fresh_database

    require_database(server_url)
    with fresh_database(server_url, prefix="ls_test") as url:
        yield url


# A study config small enough that a whole CLI run takes seconds on 2 cores.
TINY_CONFIG = """
[study]
name = "tiny"
trials = {trials}
seed = 0
confirm_top = 0  # no confirmation rounds: tests count trials (tests/test_reuse.py covers them)

[sampler]
name = "random"

[workload]
name = "synthetic-images"

[workload.options]
image_size = 16
train_size = 256
val_size = 64

[training]
device = "cpu"
train_samples = 512
batch_size = 16
eval_batch_size = 64

[space]
batch_size = {{ min = 16, max = 32 }}
num_workers = {{ min = 0, max = 1 }}
prefetch_factor = {{ min = 1, max = 2 }}
torch_threads = 1
"""


# A study whose candidates are confirmed in paired rounds: the training step waits 200 us per
# sample with the GIL released (the GPU stand-in), so a persistent loader worker beats the
# baseline; every batch size is within the loss tolerance.
CONFIRMED_CONFIG = """
[study]
name = "confirmed"
trials = 4
seed = 0
loss_tolerance = 10.0
confirm_top = 2
confirm_min_rounds = 2
confirm_max_rounds = 3

[sampler]
name = "random"

[workload]
name = "synthetic-images"

[workload.options]
image_size = 16
train_size = 256
val_size = 64
device_us_per_sample = 200

[training]
device = "cpu"
train_samples = 1024
batch_size = 16
eval_batch_size = 64

[space]
batch_size = { min = 16, max = 32 }
num_workers = { min = 1, max = 1 }
prefetch_factor = { min = 1, max = 2 }
persistent_workers = true
torch_threads = 1
"""


@pytest.fixture(scope="session")
def tiny_workload() -> Workload:
    """A real, small synthetic-images workload (16x16 PNGs), built once per test session."""
    return synthetic_images(image_size=16, train_size=256, val_size=64)


@pytest.fixture
def tiny_config(tmp_path: Path) -> Callable[..., Path]:
    def write(trials: int = 3, extra: str = "", name: str = "tiny.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY_CONFIG.format(trials=trials) + extra)
        return path

    return write


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'studies.db'}"


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point in a subprocess, as a user would."""
    inherited = {k: v for k, v in os.environ.items() if k != "LOADER_SEARCH_STORAGE"}
    full_env = {**inherited, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "loader_search", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def invoke(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI in this process (Typer's runner): for tests of messages and exit codes,
    which would otherwise pay a fresh interpreter and its imports per command. The same
    commands, options and error handling as `run_cli`; a few tests keep the subprocess, as a
    user runs it."""
    from typer.testing import CliRunner

    from loader_search.cli import app
    from loader_search.cli._console import DEBUG_ENV

    overrides: dict[str, str | None] = {"LOADER_SEARCH_STORAGE": None, DEBUG_ENV: None}
    overrides.update(env or {})
    before = Path.cwd()
    os.chdir(cwd or ROOT)  # not contextlib.chdir: that is Python 3.11's, the project runs on 3.10
    try:
        result = CliRunner().invoke(app, list(args), env=overrides)
    finally:
        os.chdir(before)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a bug, not an answer: show where it came from
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


# A second, real user of the machine (nobody) through setpriv, for tests that act as another
# user would on a shared machine: plant links, files and folders.
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
needs_a_second_user = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="needs root and setpriv(1), to act as a second user (nobody)",
)


def as_nobody(*command: str) -> None:
    """Run ``command`` as nobody (no capabilities, no groups), failing on a non-zero exit."""
    assert SETPRIV is not None
    subprocess.run(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        check=True,
        timeout=60,
    )


@contextlib.contextmanager
def folder_under_tmp(mode: int) -> Iterator[Path]:
    """A new folder directly under /tmp with ``mode`` (tmp_path's parents are 0o700, so
    another user could not reach it), removed afterwards."""
    import tempfile

    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="loader-search-test-"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
