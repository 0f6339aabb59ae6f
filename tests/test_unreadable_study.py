"""A study attribute nobody can decode, planted in the shared database (JSON nested 200,000
deep: Python's parser gives up with a RecursionError): that study's commands fail in one line
naming it, and every other study still lists, reads, is created beside it and takes workers.
The real CLI on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from tests.conftest import POSTGRES_URL, TINY_CONFIG, invoke, scratch_database

DEPTH = 200_000
BAD = "bad study;x"  # a name a shell would split: the suggestions must quote it


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'studies.db'}"
        return
    with scratch_database(POSTGRES_URL) as url:
        yield url


def plant_deep_attribute(url: str, study: str) -> None:
    """What anyone with write access to the database can do and Optuna itself cannot (its
    json.dumps would recurse too): the text goes straight into the attribute's row."""
    marker = "replaced by the planted value"
    optuna.load_study(study_name=study, storage=url).set_user_attr("deep", marker)
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as connection:
            changed = connection.execute(
                sqlalchemy.text(
                    "UPDATE study_user_attributes SET value_json = :deep"
                    " WHERE value_json = :marker"
                ),
                {"deep": "[" * DEPTH + "]" * DEPTH, "marker": json.dumps(marker)},
            )
            assert changed.rowcount == 1
    finally:
        engine.dispose()


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_an_undecodable_attribute_breaks_its_study_alone(storage: str, tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    for name in ("good", BAD):
        made = invoke(
            "init", str(config), "--study-name", name, "--storage", storage, cwd=tmp_path
        )
        assert made.returncode == 0, made.stderr
    plant_deep_attribute(storage, BAD)

    listed = invoke("studies", "--storage", storage, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("│")[1].strip(): line for line in listed.stdout.splitlines() if "│" in line}
    assert "good" in rows and "damaged" not in rows["good"]
    assert "damaged settings: see `best 'bad study;x'`" in rows[BAD], listed.stdout

    for command in (["best", BAD], ["worker", BAD], ["init", str(config), "--study-name", BAD]):
        line = _one_line(invoke(*command, "--storage", storage, cwd=tmp_path))
        assert line.startswith("error: study 'bad study;x': its attributes cannot be read"), line
        assert "--study-name 'bad study;x'" in line  # the fix, ready to paste

    # Every other study works: created beside it, read, and worked on.
    other = invoke(
        "init", str(config), "--study-name", "other", "--storage", storage, cwd=tmp_path
    )
    assert other.returncode == 0, other.stderr
    best = invoke("best", "good", "--storage", storage, cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    worked = invoke("worker", "good", "--n-trials", "1", "--storage", storage, cwd=tmp_path)
    assert worked.returncode == 0, worked.stderr[-2000:]
    good = optuna.load_study(study_name="good", storage=storage)
    assert len(good.get_trials(states=(TrialState.COMPLETE,))) == 1
