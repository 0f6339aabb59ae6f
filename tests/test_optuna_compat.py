"""Optuna's private pieces (`loader_search.study._optuna_compat`) against the installed
Optuna, on a real SQLite study: an upgrade that moves one fails here, by name."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.storages import BaseStorage, InMemoryStorage
from optuna.trial import FrozenTrial

from loader_search.study import _optuna_compat as compat


def test_the_installed_optuna_is_within_the_bound() -> None:
    major = int(optuna.__version__.split(".")[0])
    assert major == 5, f"optuna {optuna.__version__}: recheck _optuna_compat, then the bound"


def test_each_private_piece_is_where_the_compat_module_reads_it(tmp_path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'c.db'}")
    study = optuna.create_study(study_name="c", storage=storage, directions=["maximize"])
    trial = study.ask()
    number = compat.trial_id(trial)
    assert isinstance(compat.study_storage(study), BaseStorage)
    assert compat.study_storage(study).get_trial(number).number == trial.number
    frozen = compat.cached_frozen_trial(trial)
    assert isinstance(frozen, FrozenTrial) and frozen.number == trial.number
    with compat.rdb_attr_writer(trial.storage) as write:
        assert write is not None, "RDBStorage lost _set_trial_attr_without_commit"
        write(number, "a", 1)
        write(number, "b", [2, 3])
    study.tell(trial, [1.0])
    again = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'c.db'}")
    assert again.trials[0].user_attrs == {"a": 1, "b": [2, 3]}
    assert compat.trial_id(again.trials[0]) == number
    from optuna.study._frozen import FrozenStudy  # what the dashboard's wrapper returns

    assert all(isinstance(s, FrozenStudy) for s in storage.get_all_studies())


def test_study_names_are_read_without_the_attributes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'n.db'}"
    storage = optuna.storages.RDBStorage(url)
    for name in ("b", "a", "c"):
        optuna.create_study(study_name=name, storage=storage).set_user_attr("k", name)
    assert compat.study_names(storage) == ["b", "a", "c"]  # oldest first, as Optuna lists
    assert compat.study_names(storage) == optuna.study.get_all_study_names(storage)
    cached = compat.study_storage(optuna.load_study(study_name="a", storage=url))
    assert compat.study_names(cached) == ["b", "a", "c"]  # through Optuna's cache too
    import sqlite3

    # A value Optuna's listing cannot decode (its attributes are what it trips on).
    with sqlite3.connect(tmp_path / "n.db") as connection:
        connection.execute(
            "UPDATE study_user_attributes SET value_json = '[' WHERE value_json = '\"b\"'"
        )
    with pytest.raises(ValueError):
        optuna.study.get_all_study_names(storage)
    assert compat.study_names(storage) == ["b", "a", "c"]
    memory = InMemoryStorage()
    optuna.create_study(study_name="m", storage=memory)
    assert compat.study_names(memory) == ["m"]  # the public fallback


def test_without_a_database_the_writer_says_so() -> None:
    with compat.rdb_attr_writer(InMemoryStorage()) as write:
        assert write is None


@pytest.mark.parametrize("name", compat.__all__)
def test_every_name_is_documented(name: str) -> None:
    assert compat.__doc__ is not None and getattr(compat, name).__doc__
