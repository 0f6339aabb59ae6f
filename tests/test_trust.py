"""Who chooses the code a worker runs: the study's stored config lives in a database the whole
team can write, so a worker runs a built-in workload, or a plug-in that the operator of *its own
machine* allowed. Real `loader-search worker` processes, a real PostgreSQL row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from loader_search.errors import UserError
from loader_search.workloads import ALLOW_PLUGINS_ENV, check_allowed
from tests.conftest import POSTGRES_URL, ROOT, TINY_CONFIG, run_cli, scratch_database

PLUGIN = "tests/plugins/my_workload.py:build"


@pytest.fixture
def team_db() -> Iterator[str]:
    with scratch_database(POSTGRES_URL) as url:
        yield url


def _store_workload(url: str, workload: dict[str, object]) -> None:
    """What anyone with write access to the database can do: rewrite the stored config."""
    study = optuna.load_study(study_name="tiny", storage=url)
    document = dict(study.user_attrs["config"])
    document["workload"] = workload
    study.set_user_attr("config", document)


def _init(url: str, tmp_path: Path, env: dict[str, str]) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    created = run_cli("init", str(config), "--storage", url, env=env)
    assert created.returncode == 0, created.stderr


def test_a_planted_workload_spec_runs_no_code(team_db: str, tmp_path: Path) -> None:
    env = {"LOADER_SEARCH_LOCK_DIR": str(tmp_path / "locks")}
    _init(team_db, tmp_path, env)
    marker = tmp_path / "pwned"
    _store_workload(team_db, {"name": "os:system", "options": {"command": f"touch {marker}"}})
    result = run_cli("worker", "tiny", "--storage", team_db, env=env)
    assert result.returncode == 2
    assert not marker.exists()  # the command never ran
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "'os:system'" in lines[0] and "--allow-plugin" in lines[0]
    assert "Traceback" not in result.stderr
    study = optuna.load_study(study_name="tiny", storage=team_db)
    assert study.trials == []  # nothing was asked or written


@pytest.mark.slow
def test_a_plugin_runs_only_where_its_machine_allows_it(team_db: str, tmp_path: Path) -> None:
    env = {"LOADER_SEARCH_LOCK_DIR": str(tmp_path / "locks")}
    _init(team_db, tmp_path, env)
    _store_workload(team_db, {"name": PLUGIN, "options": {"n": 128}})
    refused = run_cli("worker", "tiny", "--storage", team_db, "--n-trials", "1", env=env)
    assert refused.returncode == 2
    assert PLUGIN in refused.stderr and "--allow-plugin" in refused.stderr
    # Allowed by flag (the same file named another way), then by the environment.
    absolute = f"{ROOT / 'tests/plugins/my_workload.py'}:build"
    flag = ["--n-trials", "1", "--allow-plugin", absolute]
    allowed = run_cli("worker", "tiny", "--storage", team_db, *flag, env=env)
    assert allowed.returncode == 0, allowed.stderr
    by_env = run_cli(
        "worker", "tiny", "--storage", team_db, "--n-trials", "1",
        env={**env, ALLOW_PLUGINS_ENV: f"other.module:f,{PLUGIN}"},
    )  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr
    study = optuna.load_study(study_name="tiny", storage=team_db)
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 2


def test_builtins_pass_and_other_specs_need_an_exact_allowance() -> None:
    check_allowed("synthetic-images")
    check_allowed("digits")
    check_allowed("pkg.mod:make", ["pkg.mod:make"])
    for spec, allowed in [
        ("pkg.mod:make", ["pkg.mod:other"]),
        ("pkg.mod:make", ["pkg:make"]),
        ("os:system", []),
        ("evil.py:make", ["other.py:make"]),
    ]:
        with pytest.raises(UserError, match="--allow-plugin"):
            check_allowed(spec, allowed)
