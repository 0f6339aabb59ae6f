"""``python -m benchmarks scale``: how many workers one study's database serves.

For each backend (the local PostgreSQL and MariaDB) and team size, a fresh database gets a
study of a plug-in that trains in milliseconds (`benchmarks/fast_workload.py`), and that many
real ``loader-search worker`` processes share its budget. Each worker has a host-lock folder
of its own, so their trials overlap as on many machines, and writes its per-trial times
(`loader_search.study.work._timings`). Measured per run:

* coordination per trial: everything a worker does for a trial besides training it (look
  ahead, the study lock's wait and hold, taking, recording, reporting), p50 / p95 / max;
* the study lock's hold, and the coordination capacity it allows: 1 / its mean hold (the
  trials per second a team could take if training cost nothing);
* study throughput: finished trials per second, first start to last end (database clock);
* connections per worker: the server's own count for the database, sampled while they work;
* errors (workers that did not exit 0, warnings they printed), lost trials (left running or
  queued), duplicates (a trial taken by two workers), trials over the budget.

On a 2-core machine, 32 Python processes share the CPUs with the database server, so their
coordination waits for a CPU as much as for the database. To show how much, every team size
runs twice: with trials of milliseconds (``wait_ms`` 0: the CPUs are saturated by the trials'
own work, a stress test) and with trials whose forward passes wait 100 ms without using a CPU
(trials of seconds, as on GPU servers: the CPUs stay free for the coordination). And one
worker beside idle connections (``idle``) times the same statements with the server as
crowded as for 32 workers, but the CPUs free.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loader_search.team import create_engine

HERE = Path(__file__).resolve().parent
PLUGIN = f"{HERE / 'fast_workload.py'}:build"
SERVERS = {
    "postgresql": os.environ.get(
        "LOADER_SEARCH_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get(
        "LOADER_SEARCH_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test"
    ),
}
WORKERS = (1, 8, 16, 32, 64)
RUN_TIMEOUT_S = 900.0

CONFIG = """
[study]
name = "scale"
trials = {trials}
seed = 0
confirm_top = 0  # the confirmation rounds run on one worker: nothing to coordinate

[sampler]
name = "random"  # sampling costs next to nothing: what is timed is the team's coordination

[workload]
name = "{plugin}"

[workload.options]
wait_ms = {wait_ms}  # each forward pass waits this long, using no CPU

[training]
device = "cpu"
train_samples = 192
batch_size = 8
eval_batch_size = 32
warmup_batches = 1

[space]
batch_size = {{ min = 8, max = 16 }}
num_workers = {{ min = 0, max = 1 }}
prefetch_factor = {{ min = 1, max = 2 }}
torch_threads = 1
"""


def trials_for(workers: int, quick: bool, wait_ms: float = 0.0) -> int:
    """A few hundred trials for a team, fewer for one worker (each runs them in turn; with
    waiting trials, fewer still)."""
    if quick:
        return 6 * max(1, workers)
    if workers == 1:
        return 30 if wait_ms else 100
    return max(200, 6 * workers)


@contextlib.contextmanager
def fresh_database(server_url: str, prefix: str = "ls_scale") -> Iterator[str]:
    """A new, empty database on the server of ``server_url`` (named ``prefix`` and a random
    suffix), dropped afterwards, so that runs sharing a server never meet. The tests' scratch
    databases are made here too (tests/conftest.py)."""
    import sqlalchemy
    from sqlalchemy.engine import make_url

    url = make_url(server_url)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    # Pre-ping: the server may restart in between (some tests restart it).
    admin = create_engine(
        url.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT", pool_pre_ping=True
    )
    postgres = url.get_backend_name() == "postgresql"
    with admin.connect() as connection:
        connection.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        drop = f"DROP DATABASE IF EXISTS {name}" + (" WITH (FORCE)" if postgres else "")
        with admin.connect() as connection:
            connection.execute(sqlalchemy.text(drop))
        admin.dispose()


class ConnectionCounter(threading.Thread):
    """Samples the server's count of connections to one database (its own left out)."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        import sqlalchemy

        # Autocommit: PostgreSQL reads pg_stat_activity once per transaction.
        self.engine = create_engine(
            url, poolclass=sqlalchemy.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        postgres = self.engine.url.get_backend_name() == "postgresql"
        self.query = sqlalchemy.text(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            if postgres
            else "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
            " WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
        )
        self.interval_s = interval_s
        self.samples: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with self.engine.connect() as connection:
            while not self.stopped.wait(self.interval_s):
                self.samples.append(int(connection.execute(self.query).scalar() or 0))

    def stop(self) -> list[int]:
        self.stopped.set()
        self.join()
        self.engine.dispose()
        return self.samples


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_run(
    backend: str,
    workers: int,
    trials: int,
    folder: Path,
    *,
    idle: int = 0,
    wait_ms: float = 0.0,
    server_url: str | None = None,
) -> dict[str, Any]:
    """``workers`` real worker processes (and ``idle`` idle connections beside them) share
    one study of ``trials`` on a fresh database of ``backend``'s server; every forward pass
    of their trials waits ``wait_ms`` (see `benchmarks/fast_workload.py`)."""
    import sqlalchemy

    folder.mkdir(parents=True, exist_ok=True)
    tag = (
        f"{backend}-{workers}"
        + (f"-idle{idle}" if idle else "")
        + (f"-wait{wait_ms:g}" if wait_ms else "")
    )
    config = folder / f"scale-{tag}.toml"
    config.write_text(CONFIG.format(trials=trials, plugin=PLUGIN, wait_ms=wait_ms))
    timings = folder / f"timings-{tag}.jsonl"
    timings.unlink(missing_ok=True)
    with fresh_database(server_url or SERVERS[backend]) as url:
        cli = [sys.executable, "-m", "loader_search"]
        subprocess.run(
            [*cli, "init", str(config), "--storage", url],
            check=True,
            capture_output=True,
            text=True,
        )
        idler = create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        held = [idler.connect() for _ in range(idle)]
        counter = ConnectionCounter(url)
        counter.start()
        started = time.monotonic()
        procs = []
        logs = []
        for i in range(workers):
            log = (folder / f"worker-{tag}-{i}.log").open("w")
            logs.append(log)
            env = {
                **os.environ,
                "LOADER_SEARCH_LOCK_DIR": str(folder / f"locks-{tag}-{i}"),
                "LOADER_SEARCH_TIMINGS": str(timings),
                "LOADER_SEARCH_ALLOW_PLUGINS": PLUGIN,
            }
            procs.append(
                subprocess.Popen(
                    [*cli, "worker", "scale", "--storage", url],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        codes = []
        for proc in procs:
            try:
                codes.append(
                    proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - started)))
                )
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        wall_s = time.monotonic() - started
        samples = counter.stop()
        for log in logs:
            log.close()
        for connection in held:
            connection.close()
        idler.dispose()
        result = _summarise(backend, workers, trials, url, timings, samples, idle)
        result["wait_ms"] = wait_ms
    warnings = 0
    for i in range(workers):
        text = (folder / f"worker-{tag}-{i}.log").read_text(errors="replace")
        warnings += sum("warning:" in line or "error:" in line for line in text.splitlines())
    result["errors"] = sum(code != 0 for code in codes) + warnings
    result["failed_workers"] = sum(code != 0 for code in codes)
    result["wall_s"] = round(wall_s, 1)
    return result


def _summarise(
    backend: str,
    workers: int,
    budget: int,
    url: str,
    timings: Path,
    samples: list[int],
    idle: int,
) -> dict[str, Any]:
    import optuna
    from optuna.trial import TrialState

    from loader_search.study.work import FINISHED_STATES, count_used

    lines = (
        [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []
    )
    study = optuna.load_study(study_name="scale", storage=url)
    stored = study.get_trials(deepcopy=False)
    finished = [t for t in stored if t.state.is_finished()]
    starts = [t.datetime_start for t in finished if t.datetime_start]
    ends = [t.datetime_complete for t in finished if t.datetime_complete]
    span_s = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    coordination = [line["coordination_ms"] for line in lines]
    holds = [line.get("lock_hold_ms", 0.0) for line in lines]
    numbers = [line["trial"] for line in lines]
    crowded = [max(0, s - idle) for s in samples]
    mean_hold = statistics.fmean(holds) if holds else None
    return {
        "backend": backend,
        "workers": workers,
        "idle_connections": idle,
        "trials": sum(t.state == TrialState.COMPLETE for t in stored),
        "budget": budget,
        "p50_ms": _round(_pct(coordination, 0.5)),
        "p95_ms": _round(_pct(coordination, 0.95)),
        "max_ms": _round(max(coordination, default=None)),
        "lock_hold_p50_ms": _round(_pct(holds, 0.5)),
        "lock_hold_p95_ms": _round(_pct(holds, 0.95)),
        "capacity_trials_per_s": _round(1000.0 / mean_hold if mean_hold else None),
        "trials_per_s": _round(len(finished) / span_s if span_s else None),
        "connections_per_worker": _round(max(crowded, default=0) / workers),
        "connections_per_worker_median": _round(
            statistics.median(crowded) / workers if crowded else None
        ),
        "failed_trials": sum(t.state == TrialState.FAIL for t in stored),
        "lost": sum(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in stored),
        "duplicates": len(numbers) - len(set(numbers)),
        "over_budget": max(0, count_used(stored, FINISHED_STATES) - budget),
        "parts_p50_ms": {
            key[: -len("_ms")]: _round(_pct([line[key] for line in lines if key in line], 0.5))
            for key in sorted({k for line in lines for k in line if k.endswith("_ms")})
        },
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def run(
    out: Path,
    *,
    backends: Sequence[str] = ("postgresql", "mariadb"),
    workers: Sequence[int] = WORKERS,
    quick: bool = False,
    idle_beside: int = 31,
    waits_ms: Sequence[float] = (0.0,),
) -> list[dict[str, Any]]:
    """Every backend at every team size, for each forward-pass wait in ``waits_ms``, then
    one worker beside ``idle_beside`` idle connections; each row as it lands is printed
    and saved to ``out`` (a JSON list)."""
    rows: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp(prefix="loader-search-scale-"))  # workers' logs and times
    print(f"workers' logs and timings: {folder}", flush=True)
    plan = [(b, n, 0, w) for w in waits_ms for b in backends for n in workers]
    if idle_beside:
        plan += [(b, 1, idle_beside, 0.0) for b in backends]
    for backend, n, idle, wait_ms in plan:
        trials = trials_for(n, quick, wait_ms)
        row = one_run(backend, n, trials, folder, idle=idle, wait_ms=wait_ms)
        rows.append(row)
        print(
            f"{backend:10} workers={n:3} idle={idle:2} wait={wait_ms:g} ms:"
            f" {row['trials']} trials,"
            f" coordination p50/p95/max {row['p50_ms']}/{row['p95_ms']}/{row['max_ms']} ms,"
            f" lock hold p50/p95 {row['lock_hold_p50_ms']}/{row['lock_hold_p95_ms']} ms,"
            f" capacity {row['capacity_trials_per_s']}/s, {row['trials_per_s']} trials/s,"
            f" {row['connections_per_worker']} connections/worker, errors {row['errors']},"
            f" lost {row['lost']}, duplicates {row['duplicates']},"
            f" over budget {row['over_budget']}",
            flush=True,
        )
        out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows
