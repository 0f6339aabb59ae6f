"""Errors that reach the user.

`UserError` is bad input: the CLI prints its one-line message and exits with code 2, without a
traceback (``--debug`` shows one). Everything else is a bug or a failure of the user's own code
and is reported as such.
"""

from __future__ import annotations

import re


class UserError(Exception):
    """Bad input from the user: a wrong config value, URL, workload or study name.

    The message is one line that names the offending value and says how to fix it.
    """


class ConfigError(UserError, ValueError):
    """A config value outside its rule. ``key`` is its TOML path (``study.trials``), so that the
    same check reads right for a config file (the file's name is put in front) and for a
    dataclass built in Python."""

    def __init__(self, key: str, value: object, problem: str, *, joiner: str = ": ") -> None:
        self.key, self.value, self.problem = key, value, problem
        super().__init__(f"{key} = {show_value(value)}{joiner}{problem}")


def show_value(value: object) -> str:
    """``value`` as it is written in TOML (true, "text", {min = 1, max = 2}, [1, 2])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = _escaped(value[:200])
        return f'"{shown}"' if len(value) <= 200 else f'"{shown}..." ({len(value)} chars)'
    if isinstance(value, dict):
        items = (f"{_escaped(str(k))} = {show_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    return repr(value)


def _escaped(text: str) -> str:
    """``text`` on one line: quotes, backslashes and anything unprintable (newlines, NUL,
    escape sequences) escaped as TOML writes them, so a message stays one safe line."""
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


# Characters a terminal acts on: C0 controls (ESC starts colour, cursor and OSC title
# sequences), DEL and C1 controls. Tabs and newlines are left as they are.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: each control character written as ``\\xNN``.
    For every string that comes from a database or a file others write (study names,
    attributes, error messages): an escape sequence planted there must not reach the
    terminal of whoever lists the study."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


class TrainingDiverged(RuntimeError):
    """A trial's training produced a non-finite loss (usually a learning rate too large)."""


class StudyAborted(RuntimeError):
    """The study cannot go on (e.g. the baseline loader does not even train)."""
