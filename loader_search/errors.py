"""Errors that reach the user.

`UserError` is bad input: the CLI prints its one-line message and exits with code 2, without a
traceback (``--debug`` shows one). Everything else is a bug or a failure of the user's own code
and is reported as such.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a wrong config value, URL, workload or study name.

    The message is one line that names the offending value and says how to fix it.
    """


class TrainingDiverged(RuntimeError):
    """A trial's training produced a non-finite loss (usually a learning rate too large)."""


class StudyAborted(RuntimeError):
    """The study cannot go on (e.g. the baseline loader does not even train)."""
