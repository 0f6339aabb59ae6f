"""Errors that reach the user.

`UserError` is bad input: the CLI prints its one-line message and exits with code 2, without a
traceback (``--debug`` shows one). Everything else is a bug or a failure of the user's own code
and is reported as such.
"""

from __future__ import annotations

import re
from collections.abc import Iterator


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


# The most characters of one value an error quotes: a message stays one readable line even
# for a value of megabytes (a list of 8,192 CPUs, a pasted file), and still shows its start.
SHOWN_CHARS = 200


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with its length said when it was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} chars)"


def show_value(value: object) -> str:
    """``value`` as it is written in TOML (true, "text", {min = 1, max = 2}, [1, 2]), cut
    after about `SHOWN_CHARS` characters and `_SHOWN_LEVELS` levels of nesting."""
    return _shown(value, 0)


# Deeper lists and tables are shown as [...] and {...}: a value nested hundreds deep (a
# hostile config) must not exhaust the stack of the very message that refuses it.
_SHOWN_LEVELS = 8


def _shown(value: object, level: int) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = _escaped(value[:SHOWN_CHARS])
        if len(value) <= SHOWN_CHARS:
            return f'"{shown}"'
        return f'"{shown}..." ({len(value):,} chars)'
    if isinstance(value, dict):
        if level >= _SHOWN_LEVELS:
            return "{...}"
        items = (f"{_escaped(str(k))} = {_shown(v, level + 1)}" for k, v in value.items())
        return _enclosed("{", items, "}", len(value))
    if isinstance(value, (list, tuple)):
        if level >= _SHOWN_LEVELS:
            return "[...]"
        return _enclosed("[", (_shown(v, level + 1) for v in value), "]", len(value))
    return shorten(repr(value))


def _enclosed(opening: str, items: Iterator[str], closing: str, count: int) -> str:
    """The items between brackets, as many as fit in `SHOWN_CHARS`; the others counted."""
    shown: list[str] = []
    size = 0
    for item in items:
        if shown and size + len(item) > SHOWN_CHARS:
            return f"{opening}{', '.join(shown)}, ...{closing} ({count:,} items)"
        shown.append(item)
        size += len(item) + 2
    return opening + ", ".join(shown) + closing


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
