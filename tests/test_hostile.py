"""The trust boundary's second pass (issue 28): what a shared database, a planted file or an
absurd value could still do. Each is refused (or contained) before anything runs, in one line
naming the value and the fix, exit 2 (a worker: a failed trial with a reason), nothing stored
is lost, and other studies in the same database keep working. The real CLI in a subprocess,
real SQLite files and servers, a second real user (nobody) through setpriv."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG, run_cli

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
needs_a_second_user = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="needs root and setpriv(1), to act as a second user (nobody)",
)


def _as_nobody(*command: str) -> None:
    assert SETPRIV is not None
    subprocess.run(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        check=True,
        timeout=60,
    )


def one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2, one line on stderr after the progress lines, no traceback; the line."""
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, line
    return line


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky, world-writable folder under /tmp, like /tmp itself."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="loader-search-test-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@needs_a_second_user
def test_a_planted_timings_symlink_is_refused_and_its_target_left_alone(
    shared_tmp: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    # In a teammate's own folder (in a sticky one the kernel may refuse the link itself).
    theirs = shared_tmp / "theirs"
    _as_nobody("mkdir", "-m", "755", str(theirs))
    planted = theirs / "timings.jsonl"
    _as_nobody("ln", "-s", str(victim), str(planted))
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    database = tmp_path / "study.db"
    result = run_cli(
        "run",
        str(config),
        "--storage",
        f"sqlite:///{database}",
        env={"LOADER_SEARCH_TIMINGS": str(planted)},
    )
    one_line(result, str(planted), "is a symlink")
    assert victim.read_text() == "secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not database.exists()
