"""``loader_search.report``: a command workload's script tells the trial its validation loss.

Cheap and free of side effects to import (no torch): a script calls it whether it runs inside
a trial or not, and outside one (``LOADER_SEARCH_TRIAL_DIR`` unset) it does nothing.
"""

from __future__ import annotations

import os
from typing import SupportsFloat

_ENV_DIR = "LOADER_SEARCH_TRIAL_DIR"  # the same name as loader_search.trial._hookstate's


def report_val_loss(val_loss: SupportsFloat) -> None:
    """Record ``val_loss`` (a float, or a one-element tensor) with the time it was reported,
    in this process's trial state file, written at once. Never raises: a value that is no
    number is written to the trial's ``hook-error-<pid>.txt`` instead."""
    folder = os.environ.get(_ENV_DIR)
    if not folder:
        return
    try:
        from loader_search.trial import _hookstate

        state = _hookstate.current(create=True)
        if state is not None:
            state.add_val_loss(float(val_loss))
    except Exception as exc:
        from loader_search.trial._hookstate import one_line, write_error

        kind = type(val_loss).__name__  # not its repr: a tensor's runs over many lines
        write_error(folder, f"loader_search.report(val_loss=<{kind}>): {one_line(exc)}")
