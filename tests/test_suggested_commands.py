"""The command lines loader-search suggests (`init`'s worker line, an error's fix) paste into a
shell as they are: a study name with a space or a `;` is quoted, never split or run. The real
CLI on a real SQLite file."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.distributions import IntDistribution
from optuna.trial import create_trial

from tests.conftest import invoke

NAME = "my study; touch pwned"


def test_suggested_command_lines_quote_the_study_name(
    tiny_config: Callable[..., Path], sqlite_url: str, tmp_path: Path
) -> None:
    config = str(tiny_config(trials=3))
    made = invoke("init", config, "--study-name", NAME, "--storage", sqlite_url, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    line = next(x for x in made.stdout.splitlines() if "loader-search worker" in x)
    assert shlex.split(line) == ["loader-search", "worker", NAME, "--storage", "URL"], line

    # A budget below the finished trials: the error's fix is `best NAME`, quoted alike.
    study = optuna.load_study(study_name=NAME, storage=sqlite_url)
    for _ in range(2):
        study.add_trial(
            create_trial(
                values=[100.0, 1.0],
                params={"batch_size": 16},
                distributions={"batch_size": IntDistribution(16, 32)},
            )
        )
    below = invoke(
        "init", config, "--study-name", NAME, "--n-trials", "1", "--storage", sqlite_url,
        cwd=tmp_path,
    )  # fmt: skip
    assert below.returncode == 2, below.stderr
    assert f"`loader-search best {shlex.quote(NAME)}`" in below.stderr, below.stderr
