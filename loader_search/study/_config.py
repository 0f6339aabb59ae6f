"""Study config files (TOML), validated strictly.

Every mistake is reported as one `UserError` line naming the file, the key and the value, with
the fix, before any storage is touched: a bad file never creates a study. The reference of all
keys is in README.md ("Config reference"); `studies/quickstart.toml` is a working example.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from loader_search.errors import UserError
from loader_search.params import LR_SCALINGS, TrainingSettings
from loader_search.study._space import CpuRange, IntRange, SearchSpace, power_of_two_steps
from loader_search.team._storage import Heartbeat
from loader_search.trial._supervisor import TrialLimits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SamplerName = Literal["tpe", "random", "nsga2", "grid"]
SAMPLERS: tuple[SamplerName, ...] = ("tpe", "random", "nsga2", "grid")


@dataclass(frozen=True)
class SamplerConfig:
    """Which Optuna sampler drives the search. ``None`` leaves Optuna's default."""

    name: SamplerName = "tpe"
    multivariate: bool | None = None  # tpe
    n_startup_trials: int | None = None  # tpe
    population_size: int | None = None  # nsga2


@dataclass(frozen=True)
class StudyConfig:
    """A whole study: what to train, what to search, how to judge. Defaults are sane."""

    name: str | None = None
    trials: int = 16
    timeout_s: float | None = None
    seed: int = 0
    loss_tolerance: float = 0.05
    # Before recommending, re-measure the fastest ``confirm_top`` candidates and the baseline
    # until each has ``confirm_repeats`` measurements (0 turns it off).
    confirm_top: int = 3
    confirm_repeats: int = 3
    workload: str = "synthetic-images"
    workload_options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"
    # Frozen dataclasses: sharing one default instance is safe.
    training: TrainingSettings = TrainingSettings()  # noqa: RUF009
    space: SearchSpace = SearchSpace()  # noqa: RUF009
    sampler: SamplerConfig = SamplerConfig()
    heartbeat: Heartbeat = Heartbeat()  # noqa: RUF009
    limits: TrialLimits = TrialLimits()  # noqa: RUF009
    # The validated TOML document this config came from: stored with the study so that
    # `loader-search worker` on another machine rebuilds the very same config.
    document: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.training.base_batch_size not in self.space.batch_sizes:
            raise ValueError(
                f"the baseline batch size {self.training.base_batch_size} is not one of the"
                f" searched batch sizes {list(self.space.batch_sizes)}"
            )
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in 0 .. 2**32 - 1, got {self.seed}")
        if self.loss_tolerance < 0:
            raise ValueError(f"loss_tolerance must be >= 0, got {self.loss_tolerance}")
        if self.confirm_top < 0 or self.confirm_repeats < 1:
            raise ValueError(
                f"confirm_top must be >= 0 and confirm_repeats >= 1, got {self.confirm_top}"
                f" and {self.confirm_repeats}"
            )

    def with_overrides(
        self, *, name: str | None = None, timeout_s: float | None = None
    ) -> StudyConfig:
        """The config with command-line values applied (CLI > file > default). The trial
        budget is not here: `run_study` takes it, as a continued study keeps its own."""
        if name is not None and not name.strip():
            raise UserError("--study-name is empty: give a name, or leave it out")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UserError(f"--timeout {timeout_s}: must be a positive number of seconds")
        return replace(
            self,
            name=name if name is not None else self.name,
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
        )


class _Table:
    """One TOML table being read: typed getters, and unknown keys reported at the end."""

    def __init__(self, source: str, prefix: str, data: Any) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(data, dict):
            raise UserError(f"{source}: [{prefix}] must be a table, got {_show(data)}")
        self.data = dict(data)

    def error(self, key: str, value: Any, problem: str) -> UserError:
        return UserError(f"{self.source}: {self.prefix}.{key} = {_show(value)}: {problem}")

    def pop(self, key: str, default: Any = None) -> Any:
        return self.data.pop(key, default)

    def table(self, key: str) -> _Table:
        prefix = f"{self.prefix}.{key}" if self.prefix else key
        return _Table(self.source, prefix, self.pop(key, {}))

    def int(self, key: str, default: Any, *, minimum: int | None = None) -> Any:
        value = self.pop(key, default)
        if value is None:
            return None
        if not _is_int(value):
            raise self.error(key, value, "must be an integer")
        if minimum is not None and value < minimum:
            raise self.error(key, value, f"must be at least {minimum}")
        return value

    def number(self, key: str, default: Any, *, positive: bool = False) -> Any:
        value = self.pop(key, default)
        if value is None:
            return None
        if not _is_number(value) or not math.isfinite(value):
            raise self.error(key, value, "must be a number")
        if positive and value <= 0:
            raise self.error(key, value, "must be greater than 0")
        if value < 0:
            raise self.error(key, value, "must not be negative")
        return float(value)

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
                f" (known keys are listed in README.md, 'Config reference')"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_plain(value: Any) -> bool:
    """JSON-representable: what a study can store and compare."""
    if isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def load_config(path: str | Path) -> StudyConfig:
    """Read and validate a study config file."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"config file {source!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config file {source!r}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: not valid TOML: {exc}") from None
    config = parse_config(data, source=source)
    if config.name is None:
        config = replace(config, name=path.stem)
    return config


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> StudyConfig:
    """Validate a config already parsed from TOML (or written as a dict in Python)."""
    document = copy.deepcopy(dict(data))
    top = _Table(source, "", data)
    study = top.table("study")
    sampler = top.table("sampler")
    workload = top.table("workload")
    training = top.table("training")
    space = top.table("space")
    workers = top.table("workers")
    limits = top.table("limits")
    if top.data:
        key = sorted(top.data)[0]
        raise UserError(
            f"{source}: unknown table or key {key!r}"
            " (use [study], [sampler], [workload], [training], [space], [workers], [limits])"
        )
    defaults = StudyConfig()
    name = study.string("name", None)
    trials = study.int("trials", defaults.trials, minimum=1)
    timeout_s = study.number("timeout_s", None, positive=True)
    seed = study.int("seed", defaults.seed, minimum=0)
    if seed >= 2**32:
        raise study.error("seed", seed, "must be below 2**32 (4294967296)")
    loss_tolerance = study.number("loss_tolerance", defaults.loss_tolerance)
    confirm_top = study.int("confirm_top", defaults.confirm_top, minimum=0)
    confirm_repeats = study.int("confirm_repeats", defaults.confirm_repeats, minimum=1)
    study.done()

    sampler_config = _parse_sampler(sampler)
    workload_name = workload.string("name", defaults.workload)
    options = workload.pop("options", {})
    if not isinstance(options, dict):
        raise workload.error("options", options, "must be a table of keyword arguments")
    for key, value in options.items():
        # Options are stored with the study as JSON: dates, times and NaN are refused here.
        if not _is_plain(value):
            raise UserError(
                f"{source}: workload.options.{key} = {_show(value)}: use strings, numbers,"
                " booleans, lists or tables (no dates, times, nan or inf)"
            )
    workload.done()

    device = training.string("device", defaults.device)
    settings = _parse_training(training, seed)
    search_space = _parse_space(space)
    heartbeat = _parse_workers(workers)
    trial_limits = _parse_limits(limits)

    if settings.base_batch_size not in search_space.batch_sizes:
        raise UserError(
            f"{source}: training.batch_size = {settings.base_batch_size} (the baseline) is not"
            f" one of the searched batch sizes {list(search_space.batch_sizes)}; pick one of"
            " them or widen space.batch_size"
        )
    return StudyConfig(
        name=name,
        trials=trials,
        timeout_s=timeout_s,
        seed=seed,
        loss_tolerance=loss_tolerance,
        confirm_top=confirm_top,
        confirm_repeats=confirm_repeats,
        workload=workload_name,
        workload_options=options,
        device=device,
        training=settings,
        space=search_space,
        sampler=sampler_config,
        heartbeat=heartbeat,
        limits=trial_limits,
        document=document,
    )


def _parse_sampler(table: _Table) -> SamplerConfig:
    name = table.string("name", "tpe", SAMPLERS)
    config = SamplerConfig(
        name=name,
        multivariate=table.bool("multivariate", None),
        n_startup_trials=table.int("n_startup_trials", None, minimum=0),
        population_size=table.int("population_size", None, minimum=2),
    )
    if name != "tpe" and (config.multivariate is not None or config.n_startup_trials is not None):
        raise UserError(
            f"{table.source}: sampler.multivariate and sampler.n_startup_trials apply to"
            f' sampler.name = "tpe" only, not "{name}"'
        )
    if name != "nsga2" and config.population_size is not None:
        raise UserError(
            f'{table.source}: sampler.population_size applies to sampler.name = "nsga2" only'
        )
    table.done()
    return config


def _parse_workers(table: _Table) -> Heartbeat:
    defaults = Heartbeat()
    interval = table.int("heartbeat_interval_s", defaults.interval_s, minimum=1)
    grace = table.int("grace_period_s", defaults.grace_period_s, minimum=2)
    if grace <= interval:
        raise table.error(
            "grace_period_s", grace, f"must exceed heartbeat_interval_s ({interval})"
        )
    retries = table.int("max_retry", defaults.max_retry, minimum=0)
    table.done()
    return Heartbeat(interval_s=interval, grace_period_s=grace, max_retry=retries)


def _parse_limits(table: _Table) -> TrialLimits:
    """``[limits]``: when a trial is killed. ``memory_limit_gb`` is in GiB (2**30 bytes), as
    ``docker run --memory 8g`` counts."""
    defaults = TrialLimits()
    timeout_s = table.number("trial_timeout_s", defaults.timeout_s, positive=True)
    memory_gb = table.number("memory_limit_gb", None, positive=True)
    table.done()
    memory = None if memory_gb is None else max(1, round(memory_gb * 2**30))
    return TrialLimits(timeout_s=timeout_s, memory_limit_bytes=memory)


def _parse_training(table: _Table, seed: int) -> TrainingSettings:
    defaults = TrainingSettings()
    settings = TrainingSettings(
        train_samples=table.int("train_samples", defaults.train_samples, minimum=1),
        base_batch_size=table.int("batch_size", defaults.base_batch_size, minimum=1),
        lr_scaling=table.string("lr_scaling", defaults.lr_scaling, LR_SCALINGS),
        lr=table.number("lr", None, positive=True),
        warmup_batches=table.int("warmup_batches", defaults.warmup_batches, minimum=1),
        eval_batch_size=table.int("eval_batch_size", defaults.eval_batch_size, minimum=1),
        seed=seed,
        reuse_val_loss=table.bool("reuse_val_loss", defaults.reuse_val_loss),
    )
    table.done()
    return settings


def _parse_space(table: _Table) -> SearchSpace:
    defaults = SearchSpace()
    batch_sizes = _parse_batch_sizes(table, defaults.batch_sizes)
    workers = _parse_cpu_range(table, "num_workers", minimum=0)
    prefetch = _parse_prefetch(table, defaults.prefetch_factor)
    persistent = _parse_switch(table, "persistent_workers", "search")
    pin_memory = _parse_switch(table, "pin_memory", "auto")
    threads = _parse_threads(table)
    table.done()
    return SearchSpace(
        batch_sizes=batch_sizes,
        num_workers=workers or defaults.num_workers,
        prefetch_factor=prefetch,
        persistent_workers=persistent,
        pin_memory=pin_memory,
        torch_threads=threads,
    )


def _parse_batch_sizes(table: _Table, default: tuple[int, ...]) -> tuple[int, ...]:
    value = table.pop("batch_size", None)
    if value is None:
        return default
    if isinstance(value, list):
        if not value or not all(_is_int(v) for v in value):
            raise table.error("batch_size", value, "must be a non-empty list of integers")
        if any(v <= 0 for v in value):
            raise table.error("batch_size", value, "batch sizes must be greater than 0")
        return tuple(sorted(set(value)))
    if not isinstance(value, dict):
        raise table.error(
            "batch_size", value, "use { min = 32, max = 256 } (power-of-two steps) or a list"
        )
    sub = _Table(table.source, f"{table.prefix}.batch_size", value)
    low = sub.int("min", None)
    high = sub.int("max", None)
    step = sub.int("step", None)
    sub.done()
    if low is None or high is None:
        raise table.error("batch_size", value, "needs both min and max")
    if low <= 0:
        raise sub.error("min", low, "batch size must be greater than 0")
    if high < low:
        raise table.error("batch_size", value, "max is below min: the range is empty")
    if step is None:
        return power_of_two_steps(low, high)
    if step <= 0:
        raise sub.error("step", step, "must be greater than 0")
    return tuple(range(low, high + 1, step))


def _parse_cpu_range(table: _Table, key: str, *, minimum: int) -> CpuRange | None:
    """``{ min = a, max = b | "auto" }`` or one integer (fixes the value)."""
    value = table.pop(key, None)
    if value is None:
        return None
    if _is_int(value):
        if value < minimum:
            raise table.error(key, value, f"must be at least {minimum}")
        return CpuRange(value, value)
    if not isinstance(value, dict):
        raise table.error(key, value, 'use { min = 0, max = "auto" } or a single integer')
    sub = _Table(table.source, f"{table.prefix}.{key}", value)
    low = sub.int("min", minimum, minimum=minimum)
    high = sub.pop("max", "auto")
    sub.done()
    if high == "auto":
        return CpuRange(low, None)
    if not _is_int(high):
        raise sub.error("max", high, 'must be an integer or "auto" (all usable CPUs)')
    if high < low:
        raise table.error(key, value, "max is below min: the range is empty")
    return CpuRange(low, high)


def _parse_prefetch(table: _Table, default: IntRange) -> IntRange:
    value = table.pop("prefetch_factor", None)
    if value is None:
        return default
    if _is_int(value):
        if value < 1:  # 0 passes DataLoader's constructor but fails when the loader iterates
            raise table.error("prefetch_factor", value, "must be at least 1")
        return IntRange(value, value)
    if not isinstance(value, dict):
        raise table.error("prefetch_factor", value, "use { min = 1, max = 8 } or one integer")
    sub = _Table(table.source, f"{table.prefix}.prefetch_factor", value)
    # 0 passes DataLoader's constructor but fails when the loader iterates: refuse it here.
    low = sub.int("min", default.low, minimum=1)
    high = sub.int("max", default.high, minimum=1)
    sub.done()
    if high < low:
        raise table.error("prefetch_factor", value, "max is below min: the range is empty")
    return IntRange(low, high)


def _parse_switch(table: _Table, key: str, search_word: str) -> bool | None:
    """``true`` / ``false`` fix a boolean setting; ``search_word`` leaves it to the search."""
    value = table.pop(key, search_word)
    if value == search_word:
        return None
    if not isinstance(value, bool):
        raise table.error(key, value, f'use true, false or "{search_word}"')
    return value


def _parse_threads(table: _Table) -> int | CpuRange | None:
    value = table.data.get("torch_threads", "auto")
    if value == "auto":
        table.pop("torch_threads")
        return None
    if isinstance(value, (dict, int)) and not isinstance(value, bool):
        threads = _parse_cpu_range(table, "torch_threads", minimum=1)
        assert threads is not None
        if threads.low == threads.high:
            return threads.low
        return threads
    raise table.error(
        "torch_threads",
        value,
        'use "auto" (CPUs the workers leave free), an integer, or { min = 1, max = "auto" }',
    )
