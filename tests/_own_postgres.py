"""A PostgreSQL server of a test's own, for the tests that stop and start one (a database
outage, a restart): stopping the machine's shared server would break every other test, or
anybody's study, talking to it meanwhile, and tests run side by side (`pytest -n`).

The server is the machine's own PostgreSQL binaries over a fresh cluster in a temporary
folder: ``initdb`` as the ``postgres`` user (it refuses root), trust authentication, listening
on 127.0.0.1 at a free port, its socket in its own folder. About 2 s to create on this
machine; removed with its folder afterwards."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 60  # initdb, a start or a stop waits this long at most


def _binaries() -> Path | None:
    """The newest installed server's bin folder (Debian's layout), None without one."""
    root = Path("/usr/lib/postgresql")
    found = sorted(root.glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class OwnPostgres:
    """A running private server: ``url`` for SQLAlchemy, `stop` and `start` to take it down
    and bring it back (``pg_ctl`` waits until it is down or answers)."""

    bin: Path
    data: Path
    port: int
    user: str

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [
                "runuser",
                "-u",
                self.user,
                "--",
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-w",
                "-t",
                str(TIMEOUT_S),
                *args,
            ],
            check=True,
            capture_output=True,
            timeout=TIMEOUT_S + 10,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg_ctl("-l", str(self.data / "server.log"), "-o", options, "start")

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


def unavailable() -> str | None:
    """Why a private server cannot be made here (None: it can)."""
    if _binaries() is None:
        return "no PostgreSQL server binaries under /usr/lib/postgresql"
    if os.geteuid() != 0:
        return "a private cluster is created as the postgres user, which needs root here"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user on this machine"
    return None


@contextlib.contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    """A fresh private server, running; stopped and removed on leaving."""
    binaries = _binaries()
    assert binaries is not None, unavailable()
    account = pwd.getpwnam("postgres")
    folder = Path(tempfile.mkdtemp(prefix="ls-own-postgres-"))
    data = folder / "data"
    try:
        os.chown(folder, account.pw_uid, account.pw_gid)
        subprocess.run(
            [
                "runuser",
                "-u",
                "postgres",
                "--",
                str(binaries / "initdb"),
                "-D",
                str(data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
            timeout=TIMEOUT_S,
        )
        server = OwnPostgres(binaries, data, _free_port(), "postgres")
        server.start()
        try:
            yield server
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                server._pg_ctl("-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
