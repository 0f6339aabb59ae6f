"""Writing a trial's many attributes in one transaction.

Optuna writes each user attribute in a transaction of its own: a recorded trial's ~30
attributes cost ~30 commits, ~90 statements. `write_user_attrs` writes them in one, through
two private pieces of Optuna's `RDBStorage` (``_set_trial_attr_without_commit``, the statement
behind ``set_trial_user_attr``, and ``_create_scoped_session``, both through
`loader_search.study._optuna_compat`); where a storage lacks them it falls back to the public
call, with the same result, slower.

(Reads need no such help: Optuna wraps an `RDBStorage` in its `_CachedStorage`, which keeps
finished trials and fetches only unfinished and new ones.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from loader_search.study._optuna_compat import cached_frozen_trial, rdb_attr_writer, trial_id


def write_user_attrs(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    """Set every one of ``attrs`` on a running ``trial`` in one transaction: all or none.

    Raises what ``trial.set_user_attr`` raises (`optuna.exceptions.UpdateFinishedTrialError`
    for a finished trial, `optuna.exceptions.StorageInternalError` for a failed commit)."""
    # Under Optuna's cache (which keeps no unfinished trial), the database storage itself.
    with rdb_attr_writer(trial.storage) as write:
        if write is None:
            for key, value in attrs.items():
                trial.set_user_attr(key, value)
            return
        number = trial_id(trial)
        for key, value in attrs.items():
            write(number, key, value)
    # What `trial.user_attrs` reads: Optuna's Trial keeps a copy of the stored trial.
    cached_frozen_trial(trial).user_attrs.update(attrs)
