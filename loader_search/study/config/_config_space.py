"""The ``[space]`` table of a study config: the search space as a user writes it (ranges,
lists, fixed values, ``"search"`` or ``"auto"``), each value checked against its rule in
`loader_search._rules.RANGES` and each mistake named with its file and key."""

from __future__ import annotations

from loader_search._rules import RANGES
from loader_search.params import BACKENDS, START_METHODS
from loader_search.study.config._toml import Table, is_int
from loader_search.study.search import CpuRange, IntRange, SearchSpace, power_of_two_steps


def parse_space(table: Table) -> SearchSpace:
    defaults = SearchSpace()
    batch_sizes = _parse_batch_sizes(table, defaults.batch_sizes)
    workers = _parse_cpu_range(table, "num_workers")
    prefetch = _parse_prefetch(table, defaults.prefetch_factor)
    persistent = _parse_switch(table, "persistent_workers", "search")
    pin_memory = _parse_switch(table, "pin_memory", "auto")
    threads = _parse_threads(table)
    in_order = _parse_switch(table, "in_order", "search", default=True)
    start_method = _parse_choices(table, "start_method", START_METHODS, "default", ())
    backend = _parse_choices(table, "backend", BACKENDS, None, ("process",))
    table.done()
    return SearchSpace(
        batch_sizes=batch_sizes,
        num_workers=workers or defaults.num_workers,
        prefetch_factor=prefetch,
        persistent_workers=persistent,
        pin_memory=pin_memory,
        torch_threads=threads,
        in_order=in_order,
        start_method=start_method,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
    )


def _parse_batch_sizes(table: Table, default: tuple[int, ...]) -> tuple[int, ...]:
    value = table.pop("batch_size", None)
    if value is None:
        return default
    if isinstance(value, list):
        if not value or not all(is_int(v) for v in value):
            raise table.error("batch_size", value, "must be a non-empty list of integers")
        for size in value:
            problem = RANGES["space.batch_size"].problem(size)
            if problem is not None:
                raise table.error("batch_size", value, f"batch size {size} {problem}")
        return tuple(sorted(set(value)))
    if not isinstance(value, dict):
        raise table.error(
            "batch_size", value, "use { min = 32, max = 256 } (power-of-two steps) or a list"
        )
    sub = Table(table.source, f"{table.prefix}.batch_size", value)
    low = sub.int("min", None)
    high = sub.int("max", None)
    step = sub.int("step", None)
    sub.done()
    if low is None or high is None:
        raise table.error("batch_size", value, "needs both min and max")
    sub.check("min", low, "space.batch_size")
    sub.check("max", high, "space.batch_size")
    if high < low:
        raise table.error("batch_size", value, "max is below min: the range is empty")
    if step is None:
        return power_of_two_steps(low, high)
    if step <= 0:
        raise sub.error("step", step, "must be greater than 0")
    return tuple(range(low, high + 1, step))


def _parse_cpu_range(table: Table, key: str) -> CpuRange | None:
    """``{ min = a, max = b | "auto" }`` or one integer (fixes the value)."""
    rule = f"space.{key}"
    value = table.pop(key, None)
    if value is None:
        return None
    if is_int(value):
        table.check(key, value, rule)
        return CpuRange(value, value)
    if not isinstance(value, dict):
        raise table.error(key, value, 'use { min = 0, max = "auto" } or a single integer')
    sub = Table(table.source, f"{table.prefix}.{key}", value)
    low = sub.int("min", int(RANGES[rule].low))
    sub.check("min", low, rule)
    high = sub.pop("max", "auto")
    sub.done()
    if high == "auto":
        return CpuRange(low, None)
    if not is_int(high):
        raise sub.error("max", high, 'must be an integer or "auto" (all usable CPUs)')
    sub.check("max", high, rule)
    if high < low:
        raise table.error(key, value, "max is below min: the range is empty")
    return CpuRange(low, high)


def _parse_prefetch(table: Table, default: IntRange) -> IntRange:
    value = table.pop("prefetch_factor", None)
    if value is None:
        return default
    if is_int(value):
        # 0 passes DataLoader's constructor but fails when the loader iterates: the rule's
        # minimum is 1.
        table.check("prefetch_factor", value, "space.prefetch_factor")
        return IntRange(value, value)
    if not isinstance(value, dict):
        raise table.error("prefetch_factor", value, "use { min = 1, max = 8 } or one integer")
    sub = Table(table.source, f"{table.prefix}.prefetch_factor", value)
    low = sub.int("min", default.low)
    high = sub.int("max", default.high)
    sub.done()
    sub.check("min", low, "space.prefetch_factor")
    sub.check("max", high, "space.prefetch_factor")
    if high < low:
        raise table.error("prefetch_factor", value, "max is below min: the range is empty")
    return IntRange(low, high)


def _parse_choices(
    table: Table,
    key: str,
    choices: tuple[str, ...],
    default_word: str | None,
    default: tuple[str, ...],
) -> tuple[str, ...]:
    """One of ``choices`` (fixed), a list of them or ``"search"`` (all: searched), or
    ``default_word`` (``default``: not set)."""
    value = table.pop(key, None)
    if value is None or (default_word is not None and value == default_word):
        return default
    if value == "search":
        return choices
    picked = value if isinstance(value, list) else [value]
    if not picked or not all(isinstance(v, str) and v in choices for v in picked):
        words = ", ".join(f'"{c}"' for c in (*choices, *([default_word] if default_word else [])))
        raise table.error(key, value, f'use one of {words}, a list of them, or "search"')
    return tuple(dict.fromkeys(picked))


def _parse_switch(
    table: Table, key: str, search_word: str, default: bool | None = None
) -> bool | None:
    """``true`` / ``false`` fix a boolean setting; ``search_word`` leaves it to the search,
    as does a missing key unless ``default`` is given."""
    value = table.pop(key, search_word if default is None else default)
    if value == search_word:
        return None
    if not isinstance(value, bool):
        raise table.error(key, value, f'use true, false or "{search_word}"')
    return value


def _parse_threads(table: Table) -> int | CpuRange | None:
    value = table.data.get("torch_threads", "auto")
    if value == "auto":
        table.pop("torch_threads")
        return None
    if isinstance(value, (dict, int)) and not isinstance(value, bool):
        threads = _parse_cpu_range(table, "torch_threads")
        assert threads is not None
        if threads.low == threads.high:
            return threads.low
        return threads
    raise table.error(
        "torch_threads",
        value,
        'use "auto" (CPUs the workers leave free), an integer, or { min = 1, max = "auto" }',
    )
