"""The rule (range) of every numeric config value, and the checks that apply them: the one place
the bounds are written (`RANGES`), so a check names the key a user wrote, with the value given
and what would be right. No torch import here: configs are validated without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loader_search.errors import ConfigError


def _number_text(value: float) -> str:
    """1048576, 0.5, 1e+308: whole numbers in full, as a user would type them."""
    if math.isfinite(value) and float(value).is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}"


@dataclass(frozen=True)
class Range:
    """The sane values of one numeric config key, inclusive (``low_open``: above ``low``)."""

    low: float
    high: float
    integer: bool = True
    low_open: bool = False
    high_text: str | None = None  # the problem to state above ``high``, if not the default

    def type_problem(self, value: Any) -> str | None:
        """What is wrong with ``value``'s type for this rule (a bool is no number), or None."""
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.integer and not (is_number and isinstance(value, int)):
            return "must be an integer"
        return None if is_number else "must be a number"

    def problem(self, value: float) -> str | None:
        """What is wrong with ``value`` (already of the right type), or None."""
        if not math.isfinite(value):
            return "must be a number"
        if self.low_open and value <= self.low:
            if self.low == 0:
                return "must be greater than 0"
            return f"must be above {_number_text(self.low)}"
        if value < self.low:
            if self.low == 0 and not self.integer:
                return "must not be negative"
            return f"must be at least {_number_text(self.low)}"
        if value > self.high:
            return self.high_text or f"must be at most {_number_text(self.high)}"
        return None

    @property
    def text(self) -> str:
        """The range as the docs print it."""
        low = _number_text(self.low)
        return f"{'> ' if self.low_open else ''}{low} .. {_number_text(self.high)}"


# The rule of every numeric config value, by its TOML key: the one place they are written.
# Upper bounds keep a typo (1e308, 2**63) from exhausting memory or time before anything runs;
# each is far above any real use. docs/configuration.md lists them.
RANGES: dict[str, Range] = {
    "study.trials": Range(1, 100_000),
    "study.timeout_s": Range(0, 31_536_000, integer=False, low_open=True),  # a year
    "study.seed": Range(0, 2**32 - 1, high_text="must be below 2**32 (4294967296)"),
    "study.loss_tolerance": Range(0, 10, integer=False),
    "study.confirm_top": Range(0, 20),
    "study.confirm_min_rounds": Range(2, 100),
    "study.confirm_max_rounds": Range(2, 100),
    "study.confirm_half_width": Range(0, 1, integer=False, low_open=True),
    "sampler.n_startup_trials": Range(0, 100_000),
    "sampler.population_size": Range(2, 100_000),
    "training.train_samples": Range(1, 10**10),
    "training.batch_size": Range(1, 2**20),
    "training.lr": Range(0, math.inf, integer=False, low_open=True),  # a huge one diverges
    "training.warmup_batches": Range(1, 100_000),
    "training.eval_batch_size": Range(1, 2**20),
    "space.batch_size": Range(1, 2**20),
    "space.num_workers": Range(0, 1024),
    "space.prefetch_factor": Range(1, 1024),
    "space.torch_threads": Range(1, 1024),
    "workers.heartbeat_interval_s": Range(1, 3_600),
    "workers.grace_period_s": Range(2, 604_800),  # a week
    "workers.max_retry": Range(0, 100),
    "limits.trial_timeout_s": Range(0, 604_800, integer=False, low_open=True),
    "limits.memory_limit_gb": Range(0, 1_048_576, integer=False, low_open=True),  # 1 PiB
}


def check_value(key: str, value: Any, rule: str | None = None) -> None:
    """Raise `ConfigError` unless ``value`` obeys ``RANGES[rule or key]`` (``key`` is what the
    message names, e.g. ``space.batch_size.min`` checked by the ``space.batch_size`` rule)."""
    allowed = RANGES[rule or key]
    problem = allowed.type_problem(value) or allowed.problem(value)
    if problem is not None:
        raise ConfigError(key, value, problem)


def check_options(values: Mapping[str, Any], rules: Mapping[str, Range]) -> None:
    """A workload's numeric options against their rules: a `ValueError` like ``image_size =
    1000000: must be at most 1024`` for the first that breaks its rule. Upper bounds matter
    here too: a worker builds the options stored with a study, which anyone who can write
    the database may have changed (``train_size = 10**8`` would build for hours)."""
    for name, rule in rules.items():
        value = values[name]
        wrong_type = rule.type_problem(value)
        if wrong_type is not None:
            raise ValueError(f"{name} = {value!r}: {wrong_type}, {rule.text}")
        problem = rule.problem(value)
        if problem is not None:
            raise ValueError(f"{name} = {value!r}: {problem}")


STUDY_NAME_MAX = 128  # characters; Optuna indexes names (MySQL caps indexed strings)


def check_study_name(name: str, key: str = "study.name") -> None:
    """A study name a database can store and a person can type: 1-128 printable characters,
    not blank, without spaces at either end."""
    if not isinstance(name, str):
        raise ConfigError(key, name, "must be a string")
    if not name.strip():
        raise ConfigError(key, name, "must not be blank")
    if len(name) > STUDY_NAME_MAX:
        raise ConfigError(key, name, f"is {len(name)} characters; use at most {STUDY_NAME_MAX}")
    if not name.isprintable() or name != name.strip():
        raise ConfigError(
            key, name, "use printable characters, without control characters or spaces at the ends"
        )


DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def check_device(spec: str, key: str = "training.device") -> None:
    """The forms of a device a study may name; whether this machine has it is checked where
    trials run (`loader_search._system.resolve_device`)."""
    if not isinstance(spec, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,3})?", spec):
        raise ConfigError(key, spec, f"is not a device: use {DEVICES}")


def check_fields(settings: Any, section: str) -> None:
    """Check every field of a (frozen) settings dataclass that has a rule under ``[section]``,
    from its ``__post_init__``; a field left None (not set) is not checked. Integers given
    for a real-valued rule become floats."""
    for item in dataclasses.fields(settings):
        key = f"{section}.{item.name}"
        value = getattr(settings, item.name)
        if key in RANGES and value is not None:
            check_value(key, value)
            if not RANGES[key].integer and not isinstance(value, float):
                # `timeout_s = 30` in a file is 30.0: one type, one stored form
                object.__setattr__(settings, item.name, float(value))
