"""A command taken from the team database runs only as the worker's own operator configured
it: the words named with --allow-command, and everything else that decides what runs (the
folder, the pattern matched against its output, the training loader, the ranks) the worker's
own. Tried as an attacker with write access to a real PostgreSQL: real `worker` processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from loader_search.errors import UserError
from loader_search.study.config import CommandConfig, OwnCommand, trusted_command
from tests.conftest import POSTGRES_URL, run_cli, scratch_database

CONFIG = """
[study]
name = "team"
trials = 2
confirm_top = 0
[workload]
command = ["python", "ok.py", "--batch-size", "{batch_size}"]
[training]
train_samples = 1024
batch_size = 64
[space]
batch_size = [32, 64]
num_workers = { min = 0, max = 1 }
prefetch_factor = { min = 1, max = 2 }
"""
# What the operator allowed, and what the attacker's file of the same name does instead.
ALLOWED = "python ok.py --batch-size {batch_size}"
PLANTED = "open({marker!r}, 'w').write('ran')\n"


@pytest.fixture
def team_db() -> Iterator[str]:
    with scratch_database(POSTGRES_URL) as url:
        yield url


@pytest.fixture
def folders(tmp_path: Path, team_db: str) -> tuple[Path, Path]:
    """The worker's own folder (with its honest ok.py) and the attacker's (a planted ok.py);
    the study created from the worker's folder."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    (mine / "ok.py").write_text("raise SystemExit(0)\n")
    (theirs / "ok.py").write_text(PLANTED.format(marker=str(tmp_path / "pwned")))
    (mine / "team.toml").write_text(CONFIG)
    created = run_cli("init", "team.toml", "--storage", team_db, cwd=mine)
    assert created.returncode == 0, created.stderr
    stored = optuna.load_study(study_name="team", storage=team_db).user_attrs["config"]
    assert stored["workload"].get("workdir", ".") == "."  # each worker's own folder
    return mine, theirs


def _tamper(url: str, table: str, key: str, value: object) -> None:
    """What anyone with write access to the database can do: rewrite the stored config."""
    study = optuna.load_study(study_name="team", storage=url)
    document = json.loads(json.dumps(study.user_attrs["config"]))
    document.setdefault(table, {})[key] = value
    study.set_user_attr("config", document)


def _worker(url: str, folder: Path, *flags: str) -> tuple[int, list[str]]:
    ran = run_cli(
        "worker", "team", "--storage", url, "--n-trials", "1", "--allow-command", ALLOWED,
        *flags, cwd=folder, env={"LOADER_SEARCH_LOCK_DIR": str(folder / "locks")},
    )  # fmt: skip
    assert "Traceback" not in ran.stderr
    return ran.returncode, ran.stderr.strip().splitlines()


@pytest.mark.parametrize(
    ("table", "key", "value", "flag"),
    [
        ("workload", "workdir", "THEIRS", "--workdir"),
        ("workload", "val_loss_pattern", r"(.?.?)*Z([0-9])", "--val-loss-pattern"),
        ("workload", "train_loader", 2, "--train-loader"),
        ("training", "ranks", 1024, "--ranks"),
    ],
)
def test_a_stored_value_that_decides_what_runs_is_refused(
    team_db: str, folders: tuple[Path, Path], table: str, key: str, value: object, flag: str
) -> None:
    mine, theirs = folders
    _tamper(team_db, table, key, str(theirs) if value == "THEIRS" else value)
    code, lines = _worker(team_db, mine)
    assert code == 2
    assert len(lines) == 1, lines
    assert f"stored {table}.{key}" in lines[0] and flag in lines[0]
    assert not (theirs.parent / "pwned").exists()  # the planted file never ran
    assert optuna.load_study(study_name="team", storage=team_db).trials == []


def test_a_folder_the_operator_names_is_the_one_that_runs(
    team_db: str, folders: tuple[Path, Path]
) -> None:
    mine, theirs = folders
    _tamper(team_db, "workload", "workdir", str(theirs))
    # Its operator trusts that folder: the command runs there (the planted file, here).
    _worker(team_db, mine, "--workdir", str(theirs))
    assert (theirs.parent / "pwned").read_text() == "ran"


def test_the_workers_own_values_pass_and_the_command_runs_in_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    stored = CommandConfig(("python", "ok.py"), ".", r"loss=([0-9.]+)", 2)
    own = OwnCommand(None, r"loss=([0-9.]+)", 2, 4)
    assert trusted_command(stored, 4, ["python ok.py"], own).workdir == str(tmp_path)
    elsewhere = OwnCommand(str(tmp_path / "sub"), r"loss=([0-9.]+)", 2, "auto")
    trusted = trusted_command(stored, "auto", ["python ok.py"], elsewhere)
    assert trusted.workdir == str(tmp_path / "sub")
    same = CommandConfig(("python", "ok.py"), str(tmp_path / "sub"), r"loss=([0-9.]+)", 2)
    assert trusted_command(same, "auto", ["python ok.py"], elsewhere) == trusted
    with pytest.raises(UserError, match="not allowed"):
        trusted_command(stored, 4, ["python other.py"], own)
    with pytest.raises(UserError, match=r"leave out --val-loss-pattern"):
        plain = CommandConfig(("python", "ok.py"))
        trusted_command(plain, 1, ["python ok.py"], OwnCommand(val_loss_pattern="x(1)"))
