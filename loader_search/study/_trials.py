"""Writing a trial's many attributes in one transaction.

Optuna writes each user attribute in a transaction of its own: a recorded trial's ~30
attributes cost ~30 commits, ~90 statements. `write_user_attrs` writes them in one, through
two private pieces of Optuna's `RDBStorage` (``_set_trial_attr_without_commit``, the statement
behind ``set_trial_user_attr``, and ``_create_scoped_session``); where a storage lacks them it
falls back to the public call, with the same result, slower.

(Reads need no such help: Optuna wraps an `RDBStorage` in its `_CachedStorage`, which keeps
finished trials and fetches only unfinished and new ones.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna


def write_user_attrs(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    """Set every one of ``attrs`` on a running ``trial`` in one transaction: all or none.

    Raises what ``trial.set_user_attr`` raises (`optuna.exceptions.UpdateFinishedTrialError`
    for a finished trial, `optuna.exceptions.StorageInternalError` for a failed commit)."""
    # Under Optuna's cache (which keeps no unfinished trial), the database storage itself.
    storage = getattr(trial.storage, "_backend", trial.storage)
    write = getattr(storage, "_set_trial_attr_without_commit", None)
    scoped = getattr(storage, "scoped_session", None)
    if write is None or scoped is None:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        return
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(scoped) as session:
        for key, value in attrs.items():
            write(session, models.TrialUserAttributeModel, trial._trial_id, key, value)
    # What `trial.user_attrs` reads: Optuna's Trial keeps a copy of the stored trial.
    trial._cached_frozen_trial.user_attrs.update(attrs)
