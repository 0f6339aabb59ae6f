"""Reading one table of a TOML document: typed getters that name the file, the key and the
value in every error, and unknown keys reported when the table is done. The rules (ranges) of
the values are not here: the settings dataclasses check them (`loader_search._rules.RANGES`).
"""

from __future__ import annotations

import math
from typing import Any

from loader_search._rules import check_value
from loader_search.errors import ConfigError, UserError, show_value


class Table:
    """One TOML table being read: typed getters, and unknown keys reported at the end."""

    def __init__(self, source: str, prefix: str, data: Any) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(data, dict):
            raise UserError(f"{source}: [{prefix}] must be a table, got {show_value(data)}")
        self.data = dict(data)

    def error(self, key: str, value: Any, problem: str) -> UserError:
        return UserError(f"{self.source}: {ConfigError(f'{self.prefix}.{key}', value, problem)}")

    def check(self, key: str, value: Any, rule: str) -> None:
        """``value`` (named ``prefix.key``) against the rule ``rule`` of `RANGES`."""
        try:
            check_value(f"{self.prefix}.{key}", value, rule)
        except ConfigError as exc:
            raise UserError(f"{self.source}: {exc}") from None

    def pop(self, key: str, default: Any = None) -> Any:
        return self.data.pop(key, default)

    def table(self, key: str) -> Table:
        prefix = f"{self.prefix}.{key}" if self.prefix else key
        return Table(self.source, prefix, self.pop(key, {}))

    def int(self, key: str, default: Any) -> Any:
        """An integer; its range is checked where the rule is (`loader_search._rules.RANGES`)."""
        value = self.pop(key, default)
        if value is not None and not is_int(value):
            raise self.error(key, value, "must be an integer")
        return value

    def number(self, key: str, default: Any) -> Any:
        value = self.pop(key, default)
        if value is None:
            return None
        if not is_number(value) or not math.isfinite(value):
            raise self.error(key, value, "must be a number")
        return value  # as written: its rule names it so, and makes it a float

    def string(self, key: str, default: Any, choices: tuple[str, ...] | None = None) -> Any:
        value = self.pop(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise self.error(key, value, "must be a non-empty string")
        if choices is not None and value not in choices:
            raise self.error(key, value, f"use one of {', '.join(choices)}")
        return value

    def bool(self, key: str, default: Any) -> Any:
        value = self.pop(key, default)
        if value is not None and not isinstance(value, bool):
            raise self.error(key, value, "must be true or false")
        return value

    def done(self) -> None:
        if self.data:
            key = sorted(self.data)[0]
            raise UserError(
                f"{self.source}: unknown key {self.prefix}.{key}"
                f" (known keys are listed in docs/configuration.md)"
            )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def nesting_depth(value: Any) -> int:
    """How deep lists and tables nest in ``value`` (a scalar: 0, ``[[1]]``: 2), counted one
    level at a time without recursion, so that a value nested thousands deep is measured
    (and refused) instead of exhausting Python's stack."""
    depth = 0
    level = [value]
    while True:
        containers = [item for item in level if isinstance(item, (list, dict))]
        if not containers:
            return depth
        depth += 1
        level = [
            item
            for container in containers
            for item in (container.values() if isinstance(container, dict) else container)
        ]


def is_plain(value: Any) -> bool:
    """JSON-representable: what a study can store and compare."""
    if isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False
