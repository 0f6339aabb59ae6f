"""Every use of Optuna's private API, in one place (Optuna ``>=5.0,<6``, pyproject.toml).

Each function says what it reads, and falls back to the public API where there is one.
`tests/test_optuna_compat.py` checks every one against the installed Optuna, so an upgrade
that moves one fails there, by name, instead of deep inside a study.

- ``Trial._trial_id``: the storage's id of a running trial (heartbeats, re-reads). No public
  equivalent (``trial.number`` is the study's count, not the storage's key).
- ``Study._storage``: the storage a loaded study reads through (Optuna's cache over the
  RDB). Public fallback: none on the study; callers that opened the storage keep it.
- ``Trial._cached_frozen_trial``: the copy of the stored trial that ``trial.user_attrs``
  reads, updated after attributes are written behind Optuna's back.
- ``optuna.storages._rdb``: the attribute model and the scoped session, to write many user
  attributes in one transaction (`loader_search.study.work._trials`). Public fallback:
  ``trial.set_user_attr`` one by one.
- ``optuna.study._frozen.FrozenStudy``: the type ``get_all_studies`` returns (the dashboard's
  storage wrapper, `loader_search.reports._dashboard`).
- ``RDBStorage.scoped_session`` and ``optuna.storages._rdb.models.StudyModel``: the study
  names alone (`study_names`). Public fallback: ``optuna.study.get_all_study_names``, which
  decodes every study's attributes on the way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import optuna

# Imported at run time, not only for type checking, so that the layer's face can name it for
# the dashboard's wrapper (optuna.study imports this module anyway: it costs nothing).
from optuna.study._frozen import FrozenStudy

if TYPE_CHECKING:
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

__all__ = [
    "FrozenStudy",
    "cached_frozen_trial",
    "rdb_attr_writer",
    "study_names",
    "study_storage",
    "trial_id",
]


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """The storage's id of ``trial`` (``_trial_id``)."""
    return int(trial._trial_id)


def study_storage(study: optuna.Study) -> BaseStorage:
    """The storage ``study`` reads and writes through (``_storage``)."""
    storage: BaseStorage = study._storage
    return storage


def study_names(storage: BaseStorage) -> list[str]:
    """The names of the studies in ``storage`` (an `RDBStorage`, or Optuna's cache over one),
    oldest first, read without decoding any study's attributes. Optuna's own listing decodes
    them all, so one attribute that cannot be decoded (JSON nested deeper than Python's parser
    goes, written into the shared database by other hands) would hide every study and stop
    every command; each study's attributes are read when it is opened instead."""
    backend = getattr(storage, "_backend", storage)
    scoped = getattr(backend, "scoped_session", None)
    if scoped is None:
        return list(optuna.study.get_all_study_names(storage))
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(scoped) as session:
        query = session.query(models.StudyModel.study_name).order_by(models.StudyModel.study_id)
        return [str(name) for (name,) in query.all()]


def cached_frozen_trial(trial: optuna.Trial) -> FrozenTrial:
    """The stored copy ``trial.user_attrs`` reads (``_cached_frozen_trial``)."""
    frozen: FrozenTrial = trial._cached_frozen_trial
    return frozen


@contextlib.contextmanager
def rdb_attr_writer(storage: Any) -> Iterator[Any | None]:
    """A function ``write(trial_id, key, value)`` that adds a trial's user attribute to one
    open transaction of ``storage`` (an `RDBStorage`, or Optuna's cache over one), committed
    when the block ends; None where ``storage`` is not one, or this Optuna lacks the pieces
    (the caller then uses ``trial.set_user_attr``)."""
    backend = getattr(storage, "_backend", storage)
    write = getattr(backend, "_set_trial_attr_without_commit", None)
    scoped = getattr(backend, "scoped_session", None)
    if write is None or scoped is None:
        yield None
        return
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(scoped) as session:
        yield lambda number, key, value: write(
            session, models.TrialUserAttributeModel, number, key, value
        )
