"""Bad input keeps its contract: one line on stderr naming the value and the fix, exit code 2,
and nothing written (no database file, no tables, no study). The real CLI in a subprocess,
against SQLite files and the real PostgreSQL and MariaDB servers; configs fuzzed in-process."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader_search._rules import RANGES
from loader_search.errors import UserError
from loader_search.study.config import parse_config
from loader_search.team import DB_TIMEOUT_ENV, mask_url, open_storage
from tests.conftest import (
    MARIADB_URL,
    POSTGRES_URL,
    TINY_CONFIG,
    invoke,
    run_cli,
    scratch_database,
)


def _assert_refused(result: object, *words: str) -> str:
    """Exit 2 and one line that contains every one of ``words``; returns the line."""
    code, stderr = result.returncode, result.stderr  # type: ignore[attr-defined]
    assert code == 2, f"exit {code}: {stderr}"
    # A password in --storage adds its warning (tests/test_storage.py) before the error line.
    warned = "warning: --storage holds a password"
    lines = [x for x in stderr.strip().splitlines() if not x.startswith(warned)]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _tables(url: str) -> set[str]:
    engine = sqlalchemy.create_engine(url)
    try:
        return set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


# -- plug-ins that fail while being imported ----------------------------------------------

PLUGINS = {
    "raises": ("raise RuntimeError('the plug-in is broken')\n", "RuntimeError"),
    "syntax": ("def build(:\n", "SyntaxError"),
    "dependency": ("import no_such_dependency_xyz\n", "ModuleNotFoundError"),
    "exits": ("import sys\nsys.exit(3)\n", "sys.exit(3)"),
}


@pytest.mark.parametrize("case", sorted(PLUGINS))
def test_a_plugin_that_fails_on_import_is_one_line(tmp_path: Path, case: str) -> None:
    source, named = PLUGINS[case]
    (tmp_path / "plug.py").write_text(source)
    config = tmp_path / "study.toml"
    text = TINY_CONFIG.format(trials=2).replace('name = "synthetic-images"', 'name = "X"')
    config.write_text(text.replace('"X"', f'"{tmp_path / "plug.py"}:build"'))
    database = tmp_path / "study.db"
    result = run_cli("run", str(config), "--storage", f"sqlite:///{database}")
    _assert_refused(result, "plug.py", named, "fix the plug-in")
    assert not database.exists()


def test_a_file_plugin_imports_the_modules_beside_it(tmp_path: Path) -> None:
    (tmp_path / "mydata.py").write_text("SIZE = 96\n")
    (tmp_path / "plug.py").write_text(
        "from mydata import SIZE\n"
        "from loader_search.workloads.synthetic_images import synthetic_images\n"
        "def build():\n"
        "    return synthetic_images(image_size=16, train_size=SIZE, val_size=32)\n"
    )
    from loader_search.workloads import load_workload

    workload = load_workload(f"{tmp_path / 'plug.py'}:build")
    assert len(workload.train_dataset) == 96  # type: ignore[arg-type]


# A factory that fails as it builds its workload: whatever it raises names the plug-in.
FACTORIES = {
    "KeyError": "raise KeyError('images')",
    "AttributeError": "raise AttributeError('no attribute shape')",
    "RuntimeError": "raise RuntimeError('no GPU here')",
    "FileNotFoundError": "open('/nonexistent-ls/data.bin')",
    "sys.exit(3)": "import sys; sys.exit(3)",
}


@pytest.mark.parametrize("named", sorted(FACTORIES))
def test_a_plugin_factory_that_fails_is_one_line(tmp_path: Path, named: str) -> None:
    (tmp_path / "plug.py").write_text(f"def build(**options):\n    {FACTORIES[named]}\n")
    config = tmp_path / "study.toml"
    text = TINY_CONFIG.format(trials=2).replace('name = "synthetic-images"', 'name = "X"')
    config.write_text(text.replace('"X"', f'"{tmp_path / "plug.py"}:build"'))
    database = tmp_path / "study.db"
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}")
    _assert_refused(result, "plug.py:build", "building it failed", named, "fix the plug-in")
    assert not database.exists()


def test_a_plugin_factory_may_not_end_the_process_but_ctrl_c_interrupts(tmp_path: Path) -> None:
    from loader_search.workloads import load_workload

    (tmp_path / "plug.py").write_text(
        "import sys\n"
        "def leave():\n    sys.exit(0)\n"
        "def interrupted():\n    raise KeyboardInterrupt\n"
    )
    with pytest.raises(UserError, match=r"plug\.py:leave.*sys\.exit\(0\)"):
        load_workload(f"{tmp_path / 'plug.py'}:leave")
    with pytest.raises(KeyboardInterrupt):
        load_workload(f"{tmp_path / 'plug.py'}:interrupted")


# -- values far outside any sane range ------------------------------------------------------


def test_absurd_values_are_refused_before_anything_is_stored(tmp_path: Path) -> None:
    base = TINY_CONFIG.format(trials=2)
    cases = [
        (
            base + "[limits]\nmemory_limit_gb = 1e308\n",
            "limits.memory_limit_gb = 1e+308: must be at most",
        ),
        (
            base + "[workers]\nheartbeat_interval_s = 9223372036854775806\n",
            "workers.heartbeat_interval_s = 9223372036854775806: must be at most 3600",
        ),
        (
            base.replace("max = 32 }", "max = 9223372036854775807 }", 1),
            "space.batch_size.max = 9223372036854775807: must be at most 1048576",
        ),
        (
            base.replace("confirm_top = 0", "confirm_top = 9223372036854775807"),
            "study.confirm_top = 9223372036854775807: must be at most 20",
        ),
        (
            base.replace("torch_threads = 1", "torch_threads = 1000000000"),
            "space.torch_threads = 1000000000: must be at most 1024",
        ),
        (base.replace('device = "cpu"', 'device = "tpu:0"'), 'training.device = "tpu:0"'),
        (base.replace('name = "tiny"', 'name = "   "'), "study.name"),
        (
            base.replace('name = "tiny"', 'name = "tiny"\nconfirm_process = "spawn"'),
            'study.confirm_process = "spawn": use one of fork, fresh',
        ),
    ]
    for index, (text, message) in enumerate(cases):
        config = tmp_path / f"bad{index}.toml"
        config.write_text(text)
        database = tmp_path / f"bad{index}.db"
        result = run_cli("init", str(config), "--storage", f"sqlite:///{database}")
        _assert_refused(result, message)
        assert not database.exists(), message


@pytest.mark.parametrize("kind", ["arrays", "tables"])
def test_options_nested_hundreds_deep_are_one_line_naming_the_limit(
    tmp_path: Path, kind: str
) -> None:
    text = TINY_CONFIG.format(trials=2)
    if kind == "arrays":
        text = text.replace("val_size = 64", "val_size = 64\nnested = " + "[" * 400 + "]" * 400)
    else:  # as dotted headers: tomllib itself refuses inline tables nested that deep
        text += "[workload.options.nested" + ".a" * 399 + "]\nb = 1\n"
    config = tmp_path / "study.toml"
    config.write_text(text)
    database = tmp_path / "study.db"
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}")
    _assert_refused(result, "workload.options.nested", "400 levels deep", "at most 32")
    assert not database.exists()


@pytest.mark.parametrize("cpus", ["0-8191", ",".join(map(str, range(0, 8192, 2)))])
def test_a_huge_cpu_list_is_quoted_short(tmp_path: Path, cpus: str) -> None:
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    database = tmp_path / "study.db"
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}", "--cpus", cpus)
    line = _assert_refused(result, "--cpus", "are not available to this process")
    assert len(line) < 1_000, f"{len(line):,} characters"
    assert not database.exists()


@pytest.fixture(params=["postgresql", "mariadb"])
def server_db(request: pytest.FixtureRequest) -> Iterator[str]:
    with scratch_database(POSTGRES_URL if request.param == "postgresql" else MARIADB_URL) as url:
        yield url


def test_names_and_options_a_database_cannot_store_create_nothing(
    server_db: str, tmp_path: Path
) -> None:
    base = TINY_CONFIG.format(trials=2)
    cases = [
        (base.replace('name = "tiny"', f'name = "{"n" * 1000}"'), "is 1000 characters"),
        (base.replace('name = "tiny"', 'name = "a\\u0000b"'), "printable characters"),
        (
            base.replace("val_size = 64", f'val_size = 64\nlabel = "{"x" * 100_000}"'),
            "workload.options take 100,",
        ),
    ]
    for index, (text, message) in enumerate(cases):
        config = tmp_path / f"bad{index}.toml"
        config.write_text(text)
        _assert_refused(run_cli("init", str(config), "--storage", server_db), message)
        assert _tables(server_db) == set(), message
    # The same limits on the command line.
    config = tmp_path / "good.toml"
    config.write_text(base)
    long_name = run_cli("init", str(config), "--storage", server_db, "--study-name", "x" * 300)
    _assert_refused(long_name, "--study-name", "is 300 characters")
    assert _tables(server_db) == set()


def test_an_empty_server_database_says_so(tmp_path: Path) -> None:
    with scratch_database(POSTGRES_URL) as url:
        for args in (["studies"], ["best", "tiny"], ["worker", "tiny"], ["report", "tiny"]):
            line = _assert_refused(invoke(*args, "--storage", url), "no loader-search")
            assert "database is empty" in line, args
        assert _tables(url) == set()


# -- fuzzing ----------------------------------------------------------------------------------

# Values of every kind a TOML file can hold, at and far beyond the documented ranges.
NUMBERS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63 - 1, 1e308, 1e-308, 0.5]),
)
VALUES = st.one_of(NUMBERS, st.booleans(), st.text(max_size=20), st.lists(NUMBERS, max_size=3))


def _numeric_keys() -> list[tuple[str, str]]:
    return [tuple(key.split(".", 1)) for key in RANGES]  # type: ignore[misc]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_configs_are_valid_or_one_line_errors(data: st.DataObject) -> None:
    document: dict[str, dict[str, object]] = {}
    for table, key in data.draw(st.lists(st.sampled_from(_numeric_keys()), max_size=4)):
        value = data.draw(VALUES)
        if key == "batch_size" and table == "space" and data.draw(st.booleans()):
            value = {"min": data.draw(NUMBERS), "max": data.draw(NUMBERS)}
        document.setdefault(table, {})[key] = value
    if data.draw(st.booleans()):
        document.setdefault("study", {})["name"] = data.draw(st.text(max_size=300))
    try:
        config = parse_config(document, source="fuzz.toml")
    except UserError as exc:
        text = str(exc)
        assert text.startswith("fuzz.toml: ") and "\n" not in text, text
        assert len(text) < 1_000, text
        return
    # Accepted: every value is inside its documented range, and the config can be stored.
    for table, values in document.items():
        for key, value in values.items():
            rule = RANGES.get(f"{table}.{key}")
            if rule is not None and isinstance(value, (int, float)):
                assert rule.problem(value) is None, (table, key, value)
    json.dumps(dict(config.document))
    assert len(config.space.batch_sizes) <= 2**20


URL_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "@:/%?=&.-_ ", max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(["postgresql+psycopg", "mysql+pymysql", "sqlite", "oracle", "x"]),
    user=URL_TEXT,
    password=URL_TEXT,
    port=st.sampled_from(["1", "5432", "3306", "99999", "x"]),
    database=URL_TEXT,
)
def test_fuzzed_urls_never_leak_a_password_or_a_traceback(
    scheme: str, user: str, password: str, port: str, database: str
) -> None:
    # Only this machine's address: fuzzing must never reach out to another host.
    secret = f"Pw{password}Secret"
    url = f"{scheme}://{user}:{secret}@127.0.0.1:{port}/{database}"
    if scheme == "sqlite":
        url = f"sqlite:////nonexistent-dir-ls/{database or 'x'}.db"
    assert secret not in mask_url(url)
    # A MySQL URL at PostgreSQL's port meets a server that waits for its client to speak
    # first: each such draw waits out the connect timeout (1 s here, 10 s by default).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DB_TIMEOUT_ENV, "1")
        try:
            open_storage(url, must_exist=True).engine.dispose()
        except UserError as exc:
            text = str(exc)
            assert secret not in text and "\n" not in text, text


def test_init_refuses_an_in_memory_database(tmp_path: Path) -> None:
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    for url in ("sqlite://", "sqlite:///:memory:"):
        result = run_cli("init", str(config), "--storage", url, cwd=tmp_path)
        _assert_refused(result, "in-memory database", "sqlite:///loader_search.db")
    assert list(tmp_path.iterdir()) == [config]


IN_MEMORY = [
    "sqlite://",
    "sqlite:///:memory:",
    "sqlite:///file::memory:?uri=true",
    "sqlite:///file:scratch?mode=memory&uri=true",
]


@pytest.mark.parametrize("url", IN_MEMORY)
def test_run_refuses_an_in_memory_database(tmp_path: Path, url: str) -> None:
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    result = invoke("run", str(config), "--storage", url, cwd=tmp_path)
    _assert_refused(result, "run --storage", "in-memory database", "sqlite:///loader_search.db")
    assert list(tmp_path.iterdir()) == [config]


def test_trials_never_run_in_an_in_memory_database() -> None:
    from loader_search.params import WorkersSettings

    for url in IN_MEMORY:  # as run_study and run_worker open it, heartbeats on
        with pytest.raises(UserError, match="in-memory database: trials cannot run in it"):
            open_storage(url, workers=WorkersSettings())


def test_a_lock_folder_others_could_swap_is_refused_before_the_study(tmp_path: Path) -> None:
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(0o777)  # writable by everyone, without the sticky bit
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    database = tmp_path / "study.db"
    env = {"LOADER_SEARCH_LOCK_DIR": str(folder)}
    result = run_cli("run", str(config), "--storage", f"sqlite:///{database}", env=env)
    _assert_refused(result, str(folder), "sticky")
    assert not database.exists()
    assert list(folder.iterdir()) == []


def test_a_lock_folder_that_takes_no_files_is_one_line(tmp_path: Path) -> None:
    # /proc takes no new file, for root too (ENOENT): as a read-only folder would refuse.
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    database = tmp_path / "study.db"
    env = {"LOADER_SEARCH_LOCK_DIR": "/proc"}
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}", env=env)
    _assert_refused(result, "lock file /proc/host.lock", "LOADER_SEARCH_LOCK_DIR")
    assert not database.exists()


def _read_only_mounts() -> bool:
    """Whether this machine lets an unprivileged user namespace mount a read-only tmpfs."""
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o ro none /mnt"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.skipif(not _read_only_mounts(), reason="needs unshare(1) and user namespaces")
def test_a_lock_folder_on_a_read_only_file_system_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "locks"
    folder.mkdir()
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    database = tmp_path / "study.db"
    # The CLI in a mount namespace of its own, where the lock folder is a read-only tmpfs:
    # what a container sees of a host folder mounted read-only.
    mount_then_run = 'mount -t tmpfs -o ro none "$0" && exec "$@"'
    result = subprocess.run(
        [
            *("unshare", "-rm", "sh", "-c", mount_then_run, str(folder)),
            *(sys.executable, "-m", "loader_search", "run", str(config)),
            *("--storage", f"sqlite:///{database}"),
        ],
        env={**os.environ, "LOADER_SEARCH_LOCK_DIR": str(folder)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    _assert_refused(result, f"{folder}/host.lock", "Read-only file system", str(folder))
    assert not database.exists()


# -- missing database drivers -------------------------------------------------------------

# One process with the installed drivers hidden, as on a machine without the extra, runs every
# command against every URL through the real CLI (in that process: one interpreter start, not
# sixteen) and reports each exit code and output as JSON.
_WITHOUT_DRIVERS = """
import json, sys
sys.modules['psycopg'] = sys.modules['pymysql'] = None
from typer.testing import CliRunner
from loader_search.cli import app
answers = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    answers.append([result.exit_code, result.stdout, result.stderr])
print(json.dumps(answers))
"""

_DRIVER_URLS = {
    "postgresql+psycopg://postgres:sekrit@127.0.0.1:5432/test": "postgres",
    "postgresql+psycopg2://postgres:sekrit@127.0.0.1:5432/test": "postgres",
    "mysql+pymysql://root:sekrit@127.0.0.1:3306/test": "mysql",
    "mysql+mysqldb://root:sekrit@127.0.0.1:3306/test": "mysql",
}


@pytest.fixture(scope="module")
def without_drivers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[object]]:
    folder = tmp_path_factory.mktemp("no-drivers")
    config = folder / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    commands = [
        ["run", str(config)],
        ["init", str(config)],
        ["worker", "tiny"],
        ["report", "tiny"],
    ]
    calls = [[*args, "--storage", url] for url in _DRIVER_URLS for args in commands]
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DRIVERS, json.dumps(calls)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(folder.iterdir()) == [config]  # nothing written by any of them
    return {
        " ".join(call): answer for call, answer in zip(calls, json.loads(done.stdout), strict=True)
    }


@pytest.mark.parametrize(("url", "extra"), sorted(_DRIVER_URLS.items()))
def test_a_missing_driver_names_the_extra_on_every_command(
    without_drivers: dict[str, list[object]], url: str, extra: str
) -> None:
    answers = {
        call: a for call, a in without_drivers.items() if call.endswith(f" --storage {url}")
    }
    assert len(answers) == 4
    for call, (code, stdout, stderr) in answers.items():
        # `run` and `worker` say first that they open the storage.
        result = subprocess.CompletedProcess(call, code, stdout, str(stderr).split("...\n")[-1])
        line = _assert_refused(result, f"pip install 'loader-search[{extra}]'", "is missing")
        assert "sekrit" not in f"{stdout}{stderr}", call
        assert "Failed to import" not in line, call
