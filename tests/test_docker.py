"""The Docker setup (docker-compose.yml, docker/Dockerfile, .env.example), without a Docker engine.

The compose file is read as Docker Compose reads it (YAML, then ``${VAR}`` interpolation from
``.env``) and its structure checked: services and their order, healthchecks, GPU reservation
(and the CPU override), ``/dev/shm``, the shared host-lock folder, published ports, the
password as a secret's file. Then the containers' own commands run here, in their order,
against a real PostgreSQL: ``init``, two ``worker``s side by side, then the ``dashboard`` and
its healthcheck, so that the orchestration itself is exercised, not only its description.
The images and the stack themselves run in scripts/compose_check.sh (a Docker engine).
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from tests.conftest import POSTGRES_URL, ROOT, TINY_CONFIG, scratch_database
from tests.test_dashboard import _get, _read_line

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
APP_SERVICES = ("init", "dashboard", "worker", "worker-cpu")  # they run loader-search


# --- Compose's interpolation (compose-spec: ${VAR}, ${VAR:-default}, ${VAR:?error}, $$) --------


class MissingVariable(Exception):
    pass


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with its variables substituted as Docker Compose does (defaults may nest)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 0, i
            while True:  # the matching brace: nested ${...} in a default count
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                if text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            out.append(_substitute(text[i + 2 : j], env))
            i = j + 1
        else:
            name = _NAME.match(text, i + 1)
            assert name, f"invalid template {text!r}"
            out.append(env.get(name.group(), ""))
            i = name.end()
    return "".join(out)


def _substitute(body: str, env: Mapping[str, str]) -> str:
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", body, re.S)
    assert match, f"invalid template ${{{body}}}"
    name, op, arg = match.groups()
    value = env.get(name)
    if op is None:
        return value or ""
    arg = interpolate(arg, env)
    if op in (":-", "-"):
        return value if (value if op == ":-" else value is not None) else arg
    if op in (":?", "?"):
        if value is None or (op == ":?" and not value):
            raise MissingVariable(f"{name}: {arg}")
        return value
    return arg if (value if op == ":+" else value is not None) else ""


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            values[key.strip()] = value.strip()
    return values


def raw_compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<) as compose does
    assert isinstance(document, dict)
    return document


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Docker Compose sees it with ``env`` (default: .env.example's)."""
    resolved = resolve(raw_compose(), read_env_file(ENV_EXAMPLE) if env is None else env)
    assert isinstance(resolved, dict)
    return resolved


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def compose_variables() -> set[str]:
    text = re.sub(r"\$\$", "", COMPOSE.read_text())
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


def _bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", size.lower())
    assert match, f"not a size: {size!r}"
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


# --- Structure ----------------------------------------------------------------------------------


def test_services_start_in_order() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", *APP_SERVICES}
    depends = {name: service.get("depends_on", {}) for name, service in services.items()}
    # The schema and the study are made once, after the database is healthy, before anyone
    # uses them (workers creating tables at once race).
    assert depends["init"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "dashboard"):
        assert depends[name] == {"init": {"condition": "service_completed_successfully"}}
    assert services["init"]["restart"] == "no"  # one-shot: a restart would never "complete"
    assert services["worker"]["restart"].startswith("on-failure")
    assert services["dashboard"]["restart"] in ("unless-stopped", "always")
    assert services["postgres"]["restart"] in ("unless-stopped", "always")
    # Scalable: no fixed container name, no published port.
    assert "container_name" not in services["worker"]
    assert "ports" not in services["worker"]
    for name in APP_SERVICES:
        assert services[name]["init"] is True  # reaps what a killed trial orphans


def test_healthchecks() -> None:
    services = compose()["services"]
    postgres = services["postgres"]["healthcheck"]
    command = " ".join(postgres["test"])
    # Over TCP, or it passes against the entrypoint's socket-only first-start server.
    assert "pg_isready" in command and "-h 127.0.0.1" in command
    assert postgres["retries"] >= 3
    dashboard = " ".join(services["dashboard"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8080/api/studies" in dashboard
    assert services["dashboard"]["command"][-2:] == ["--port", "8080"]
    # (Both run for real in test_containers_commands_in_order.)
    assert services["dashboard"]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")


def test_workers_get_gpus_shared_memory_and_the_host_lock() -> None:
    document = compose()
    worker = document["services"]["worker"]
    assert _bytes(worker["shm_size"]) >= 1024**3  # Docker's 64 MB breaks num_workers > 0
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device["count"] == "all" or int(device["count"]) >= 1

    # One trial per host: every worker container mounts the same folder at the lock dir.
    lock_dir = worker["environment"]["LOADER_SEARCH_LOCK_DIR"]
    mounts = dict(reversed(v.split(":")[:2]) for v in worker["volumes"])
    source = mounts[lock_dir]
    assert document["volumes"][source]["name"] == "loader-search-locks"  # not per project
    host = compose({**read_env_file(ENV_EXAMPLE), "LOCKS_VOLUME": "/tmp/loader-search-locks"})
    assert (
        "/tmp/loader-search-locks:/tmp/loader-search-locks"
        in host["services"]["worker"]["volumes"]
    )
    # The study configs (and plug-in workloads) from studies/, where the command runs.
    assert mounts[worker["working_dir"]] == "./studies"
    init = document["services"]["init"]
    assert init["working_dir"] == worker["working_dir"]
    assert init["command"][1].startswith(init["working_dir"] + "/")
    assert "./studies:/studies:ro" in init["volumes"]

    postgres = document["services"]["postgres"]
    assert "postgres-data:/var/lib/postgresql/data" in postgres["volumes"]
    assert "postgres-data" in document["volumes"]
    assert re.fullmatch(r"postgres:\d+[\w.-]*", postgres["image"])  # pinned major version


def test_no_default_nests_a_variable() -> None:
    """Compose v1 (Debian 12's docker-compose 1.29) reads ``${A:-x${B}y}`` as ``${A:-x${B}``
    then ``y}``: the bundled database's URL, which nested its user and database name, came
    out as ``...//${POSTGRES_USER:...`` (found by scripts/compose_check.sh). Compose v2
    nests; a file both read nests nothing."""
    for default in re.findall(r"\$\{[A-Za-z_]+:?[-?+]([^}]*)\}", COMPOSE.read_text()):
        assert "${" not in default, default


def test_published_ports_are_local_by_default() -> None:
    for env in (read_env_file(ENV_EXAMPLE), {}):  # .env, or nothing
        services = compose(env)["services"]
        published = [p for s in services.values() for p in s.get("ports", [])]
        assert len(published) == 2  # postgres and the dashboard
        for port in published:
            assert port.startswith("127.0.0.1:"), port
    team = compose({"POSTGRES_BIND": "10.0.0.5"})
    assert team["services"]["postgres"]["ports"] == ["10.0.0.5:5432:5432"]


def test_the_cpu_worker_is_the_worker_without_its_gpu_reservation() -> None:
    """On a machine without NVIDIA GPUs Docker cannot start `worker`: `worker-cpu` (profile
    cpu) is the same service without the reservation (scripts/compose_check.sh runs it)."""
    services = compose()["services"]
    gpu, cpu = dict(services["worker"]), dict(services["worker-cpu"])
    assert "deploy" in gpu and "deploy" not in cpu
    assert cpu.pop("profiles") == ["cpu"] and "profiles" not in gpu
    gpu.pop("deploy")
    assert cpu == gpu


SECRET_PATH = "/run/secrets/postgres_password"


def test_the_password_is_a_secrets_file_never_a_variable() -> None:
    """``docker inspect`` shows a container's environment: the password must not be in it.
    It is a Docker secret (a file) that PostgreSQL and loader-search read by path."""
    text = COMPOSE.read_text()
    document = compose({})
    services = document["services"]
    for name, service in services.items():
        for key, value in service.get("environment", {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN", key):
                assert key.endswith("_FILE") and value == SECRET_PATH, (name, key, value)
        assert "postgres_password" in service.get("secrets", []), name
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == SECRET_PATH
    for name in APP_SERVICES:
        environment = services[name]["environment"]
        assert environment["LOADER_SEARCH_STORAGE_PASSWORD_FILE"] == SECRET_PATH
        url = environment["LOADER_SEARCH_STORAGE"]
        assert url == "postgresql+psycopg://loader@postgres:5432/loader_search"
    assert services["postgres"]["environment"]["POSTGRES_USER"] == "loader"
    assert services["postgres"]["environment"]["POSTGRES_DB"] == "loader_search"
    # No URL anywhere carries a password; the secret's file defaults under ./secrets/.
    assert not re.findall(r"://[^:/@\s'\"]+:[^@\s'\"]+@", yaml.safe_dump(document))
    assert document["secrets"]["postgres_password"] == {"file": "./secrets/postgres_password"}
    other = compose({"POSTGRES_PASSWORD_FILE": "/etc/team/pw"})
    assert other["secrets"]["postgres_password"] == {"file": "/etc/team/pw"}
    assert "change-me" not in text
    team = compose({"LOADER_SEARCH_STORAGE": "postgresql+psycopg://t@db/x"})
    assert team["services"]["worker"]["environment"]["LOADER_SEARCH_STORAGE"].endswith("@db/x")
    # The secret's folder is never committed nor sent into an image.
    assert "/secrets/" in (ROOT / ".gitignore").read_text().split()
    assert "secrets" in dockerignore()


def test_env_example_has_no_secret_and_env_is_never_shipped() -> None:
    example = read_env_file(ENV_EXAMPLE)
    for key in example:
        if re.search(r"PASSWORD|SECRET|TOKEN", key):
            assert key.endswith("_FILE"), key
    assert not re.findall(r"://[^:/@\s]+:([^@\s]+)@", ENV_EXAMPLE.read_text())
    # Every variable it sets is one the compose file reads.
    assert set(example) <= compose_variables()
    gitignored = (ROOT / ".gitignore").read_text().split()
    assert ".env" in gitignored
    dockerignored = dockerignore()
    for pattern in (".env", ".git", ".venv", "*.db", "**/__pycache__", "*.whl"):
        assert pattern in dockerignored, pattern


def test_the_dashboard_in_its_container_answers_only_local_names() -> None:
    """It listens on 0.0.0.0 inside its container (its port is published on the host's
    127.0.0.1): without --allow-host it would serve any Host (DNS rebinding)."""
    command = compose({})["services"]["dashboard"]["command"]
    allowed = [command[i + 1] for i, arg in enumerate(command) if arg == "--allow-host"]
    assert set(allowed) == {"localhost", "127.0.0.1"}
    named = compose({"DASHBOARD_HOST_NAME": "dash.example"})["services"]["dashboard"]
    assert "dash.example" in named["command"]


def test_dockerfile() -> None:
    lines = [
        line.strip()
        for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(lines), re.M))
    (base,) = [line.split()[1] for line in lines if line.startswith("FROM ")]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    # A CUDA-enabled PyTorch runtime, pinned by version (never `latest`).
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    assert 'ENTRYPOINT ["loader-search"]' in lines
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^loader-search = "loader_search\.cli:main"$', pyproject, re.M)
    installs = [line for line in lines if "pip install" in line]
    assert all("--no-cache-dir" in line for line in installs)
    # The base image's CUDA torch is kept: pip may not replace it.
    assert "-c /tmp/keep-torch.txt" in installs[0] and 'm.version("torch")' in installs[0]
    for extra in ("postgres", "dashboard"):  # what the compose services need
        assert extra in args["EXTRAS"].split(",")
    # What it copies exists and is not excluded from the build context.
    dockerignored = dockerignore()
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists() and source not in dockerignored, source


def test_every_variable_is_documented_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## .*$", readme, re.M)
    docker = headings.index("## Run it with Docker")
    assert headings[docker - 1] == "## Share a study with your team"
    section = readme.split("## Run it with Docker", 1)[1].split("\n## ", 1)[0]
    for variable in sorted(compose_variables()):
        assert f"`{variable}`" in section, variable
    for command in (
        "cp .env.example .env",
        "docker compose up -d --build --scale worker=",
        "--scale postgres=0",
        "docker compose logs",
        "127.0.0.1:8080/dashboard/",
    ):
        assert command in section, command


def test_the_commands_the_containers_run_exist() -> None:
    services = compose()["services"]
    for name in APP_SERVICES:
        command = services[name]["command"]
        # --help after the real arguments: click rejects an unknown option or subcommand
        # before it prints the help.
        for argv in ([command[0], "--help"], [*command, "--help"]):
            result = subprocess.run(
                [sys.executable, "-m", "loader_search", *argv],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert result.returncode == 0, (name, argv, result.stderr)
            assert "Usage: " in result.stdout
    assert services["init"]["command"][0] == "init"
    assert services["worker"]["command"][0] == "worker"
    assert services["dashboard"]["command"][0] == "dashboard"


# --- The orchestration, run for real ---------------------------------------------------------


class Container:
    """What a compose service runs, run here: the same argv (``loader-search`` is the image's
    entry point), environment and working directory, with its mounts mapped to folders."""

    def __init__(self, service: Mapping[str, Any], mounts: Mapping[str, Path]) -> None:
        self.mounts = {
            target: mounts[source]
            for source, target, *_ in (v.split(":") for v in service.get("volumes", []))
        }
        if service.get("secrets"):  # Docker mounts each secret's file at /run/secrets/NAME
            self.mounts.update({SECRET_PATH: mounts[SECRET_PATH]})
        self.argv = [sys.executable, "-m", "loader_search", *map(self.path, service["command"])]
        environment = {k: self.path(str(v)) for k, v in service["environment"].items()}
        self.env = {**os.environ, **environment}
        self.cwd = self.path(service.get("working_dir", str(ROOT)))

    def path(self, value: str) -> str:
        for target, folder in self.mounts.items():
            if value == target or value.startswith(target + "/"):
                return str(folder) + value[len(target) :]
        return value

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300
        )

    def start(self, log: Path) -> subprocess.Popen[str]:
        with log.open("w") as out:
            return subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )


@pytest.fixture
def team_db() -> Iterator[str]:
    with scratch_database(POSTGRES_URL) as url:
        yield url


def _intervals(study: optuna.Study) -> list[tuple[datetime.datetime, datetime.datetime]]:
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL))
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    return [(s, e) for s, e in spans if s is not None and e is not None]


@pytest.mark.slow
def test_containers_commands_in_order(team_db: str, tmp_path: Path) -> None:
    """init, then two workers at once, then the dashboard: compose's sequence, run here."""
    started = time.monotonic()
    studies = tmp_path / "studies"
    studies.mkdir()
    (studies / "tiny.toml").write_text(TINY_CONFIG.format(trials=4))
    # .env for this run: the study, and the team database instead of the bundled one.
    env = {
        **read_env_file(ENV_EXAMPLE),
        "STUDY_CONFIG": "tiny.toml",
        "STUDY_NAME": "tiny",
        "LOADER_SEARCH_STORAGE": team_db,
    }
    services = compose(env)["services"]
    # The volume: one folder; the secret: a file (PostgreSQL here trusts local logins, so its
    # content is not checked, but it is read: a missing file would fail every command).
    secret = tmp_path / "postgres_password"
    secret.write_text("not-checked-here\n")
    mounts = {"./studies": studies, "locks": tmp_path / "locks", SECRET_PATH: secret}

    pg_isready = shutil.which("pg_isready")
    if pg_isready or os.environ.get("LOADER_SEARCH_REQUIRE_DBS"):
        # postgres's healthcheck, as its container's shell runs it.
        check = services["postgres"]["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        database = team_db.rsplit("/", 1)[1]
        healthy = subprocess.run(
            ["sh", "-c", check[1]],
            env={**os.environ, "POSTGRES_USER": "postgres", "POSTGRES_DB": database},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr

    # 1. init: the schema and the study, once.
    init = Container(services["init"], mounts)
    created = init.run()
    assert created.returncode == 0, created.stdout + created.stderr
    assert "Created study tiny" in created.stdout
    assert team_db.split("@")[1] in created.stdout  # it used the environment's storage
    again = init.run()  # `docker compose up` again: the study is kept
    assert again.returncode == 0 and "Updated study tiny" in again.stdout, again.stderr

    # 2. Two workers (--scale worker=2), sharing the host-lock volume.
    worker = Container(services["worker"], mounts)
    processes = [worker.start(tmp_path / f"worker-{i}.log") for i in range(2)]
    codes = [p.wait(timeout=300) for p in processes]
    logs = [(tmp_path / f"worker-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    assert (tmp_path / "locks" / "host.lock").exists()
    study = optuna.load_study(study_name="tiny", storage=team_db)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) >= 4 and sum(bool(t.user_attrs.get("baseline")) for t in complete) == 1
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    # One trial at a time on this host: no two trials' lifetimes overlap.
    spans = _intervals(study)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans

    # 3. The dashboard on the same database, and its healthcheck.
    dashboard = Container(services["dashboard"], mounts)
    port_at = dashboard.argv.index("--port") + 1
    dashboard.argv[port_at] = "0"  # a free port here; in its container it has 8080 to itself
    dashboard.argv[dashboard.argv.index("--host") + 1] = "127.0.0.1"  # not this machine's LAN
    process = subprocess.Popen(
        dashboard.argv,
        cwd=dashboard.cwd,
        env=dashboard.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/dashboard/", _read_line(process, 60))
        assert found
        base = f"http://127.0.0.1:{found.group(1)}"
        (summary,) = _get(f"{base}/api/studies")["study_summaries"]
        assert summary["study_name"] == "tiny"
        detail = _get(f"{base}/api/studies/{summary['study_id']}")
        shown = {t["number"] for t in detail["trials"] if t["state"] == "Complete"}
        assert shown == {t.number for t in complete}

        healthcheck = services["dashboard"]["healthcheck"]["test"]
        assert healthcheck[:2] == ["CMD", "python"]
        probe = [
            sys.executable,
            *(a.replace("127.0.0.1:8080", f"127.0.0.1:{found.group(1)}") for a in healthcheck[2:]),
        ]
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
        with urllib.request.urlopen(f"{base}/dashboard/", timeout=30) as page:
            assert page.status == 200
    finally:
        process.kill()
        process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    # A dashboard that is down is reported unhealthy.
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode != 0
    print(f"init, 2 workers, dashboard: {time.monotonic() - started:.1f} s")
