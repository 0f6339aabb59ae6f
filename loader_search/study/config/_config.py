"""Study config files (TOML), validated strictly.

Every mistake is reported as one `UserError` line naming the file, the key and the value, with
the fix, before any storage is touched: a bad file never creates a study. The reference of all
keys, with the range of each, is in docs/configuration.md; `studies/quickstart.toml` is a
working example. Every range is written once, in `loader_search._rules.RANGES`, and checked by
the dataclasses themselves, so a config built in Python obeys the same rules as a file.
"""

from __future__ import annotations

import copy
import json
import math
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from loader_search._rules import check_device, check_fields, check_study_name
from loader_search._workload_specs import resolve_paths
from loader_search.errors import ConfigError, UserError, shorten, show_value
from loader_search.params import (
    COMPILE_MODES,
    GRADIENT_ACCUMULATION,
    LR_SCALINGS,
    MATMUL_PRECISIONS,
    OBJECTIVES,
    PRECISIONS,
    Objective,
    TrainingSettings,
    TrialLimits,
    WorkersSettings,
)
from loader_search.study.config._command_config import (
    COMMAND_WORKLOAD,
    CommandConfig,
    parse_command,
)
from loader_search.study.config._config_space import parse_space
from loader_search.study.config._toml import Table, is_plain, nesting_depth
from loader_search.study.search import SearchSpace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A study stores its config as JSON in one attribute; MySQL/MariaDB's column holds 64 KiB.
OPTIONS_MAX_BYTES = 16_384
# Lists and tables in one option nest at most this deep: every reader of options (the checks
# here, JSON, the messages that quote them) recurses, and 400 levels exhaust Python's stack.
OPTIONS_MAX_DEPTH = 32
CONFIRM_PROCESSES = ("fork", "fresh")  # study.confirm_process
SamplerName = Literal["tpe", "random", "nsga2", "grid"]
SAMPLERS: tuple[SamplerName, ...] = ("tpe", "random", "nsga2", "grid")


@dataclass(frozen=True)
class SamplerConfig:
    """Which Optuna sampler drives the search (``[sampler]``). ``None`` leaves Optuna's
    default."""

    name: SamplerName = "tpe"
    multivariate: bool | None = None  # tpe
    n_startup_trials: int | None = None  # tpe
    population_size: int | None = None  # nsga2
    # The pipeline model picks the first trials after the baseline
    # (loader_search.study.search._guide); false: the sampler alone, for comparison. The grid
    # sampler measures everything anyway.
    model: bool = True

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ConfigError("sampler.name", self.name, f"use one of {', '.join(SAMPLERS)}")
        check_fields(self, "sampler")
        for key, applies_to in (
            ("multivariate", "tpe"),
            ("n_startup_trials", "tpe"),
            ("population_size", "nsga2"),
        ):
            value = getattr(self, key)
            if value is not None and self.name != applies_to:
                raise ConfigError(
                    f"sampler.{key}",
                    value,
                    f'options apply to sampler.name = "{applies_to}" only, not "{self.name}"',
                )


@dataclass(frozen=True)
class StudyConfig:
    """A whole study: what to train, what to search, how to judge. Defaults are sane.

    Fields are the keys of the config file's ``[study]`` table, then one field per other
    table (``workload``, ``training``, ``space``, ``sampler``, ``workers``, ``limits``); the
    workload's ``name`` and ``options`` are ``workload`` and ``workload_options``, and the
    ``[training]`` key ``device`` is ``device``. Every rule is checked here (`check_fields`),
    so a config built in Python is held to the same rules as a file.
    """

    name: str | None = None
    trials: int = 16
    timeout_s: float | None = None
    seed: int = 0
    loss_tolerance: float = 0.05
    # Before recommending, confirm the fastest ``confirm_top`` candidates against the baseline
    # in paired rounds (0 turns it off; see loader_search.study.stats._confirm): at least
    # ``confirm_min_rounds``, until the leader's 95% interval is within
    # ``confirm_half_width`` of its estimate, at most ``confirm_max_rounds``. One by default:
    # a race of two (its round left out of the claim) cost 1-3 trials for no better choice
    # at the noise of a CPU's readings (benchmarks/selection.py).
    confirm_top: int = 1
    # At least 4 rounds (3 before): on a CPU's bimodal readings three rounds that agree by
    # chance gave intervals too narrow. Replayed on rounds drawn from 23 real studies' own
    # (python -m benchmarks stopping), 4 covered the truth in 94.8% (93.2%), erred 3.5%
    # (3.9%), at a confirmation share of 32% (29%).
    confirm_min_rounds: int = 4
    # The cap: 15 rounds. 10 cost a little less confirmation on the fifteen fresh-process
    # studies on record, but lost 3 of their 11 "faster" verdicts, true 7-8% gains, after 3-10
    # rounds (python -m benchmarks stopping).
    confirm_max_rounds: int = 15
    confirm_half_width: float = 0.05
    # Where a confirmation trial trains: "fresh" (the default), a child of a fresh Python
    # process that built its own workload, as a user's script does, started beside the
    # worker's own start-up and kept for the rounds; "fork", a child forked from the worker,
    # as every search trial (cheaper, its claims more often high: benchmarks/RESULTS.md).
    confirm_process: str = "fresh"
    # What the recommendation and the paired rounds maximise: "throughput" (samples/s, the
    # validation loss within loss_tolerance), or "goodput" (throughput times the statistical
    # efficiency of the batch size at the study's gradient noise scale: the baseline's loss
    # soonest; loader_search.study.stats._goodput).
    objective: Objective = "throughput"
    workload: str = "synthetic-images"
    workload_options: Mapping[str, Any] = field(default_factory=dict)
    # ``[workload] command``: the user's own training script instead of a workload
    # (`workload` is then "command"; loader_search.study.config._command_config).
    command: CommandConfig | None = None
    device: str = "auto"
    # Frozen dataclasses: sharing one default instance is safe.
    training: TrainingSettings = TrainingSettings()  # noqa: RUF009
    space: SearchSpace = SearchSpace()  # noqa: RUF009
    sampler: SamplerConfig = SamplerConfig()
    workers: WorkersSettings = WorkersSettings()  # noqa: RUF009
    limits: TrialLimits = TrialLimits()  # noqa: RUF009
    # The validated TOML document this config came from: stored with the study so that
    # `loader-search worker` on another machine rebuilds the very same config.
    document: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.name is not None:
            check_study_name(self.name)
        check_fields(self, "study")
        check_device(self.device)
        check_options_depth(self.workload_options)
        stored = len(json.dumps(dict(self.workload_options)))
        if stored > OPTIONS_MAX_BYTES:
            raise UserError(
                f"workload.options take {stored:,} bytes as stored with the study; at most"
                f" {OPTIONS_MAX_BYTES:,} fit every database: pass large data as a file path"
                " the workload reads"
            )
        if not self.workload:
            raise ConfigError("workload.name", self.workload, "must be a non-empty string")
        if (self.workload == COMMAND_WORKLOAD) != (self.command is not None):
            raise ConfigError(
                "workload.name", self.workload, "a study trains a workload or a command: one"
            )
        if self.command is not None:
            _check_command(self)
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                "study.objective", self.objective, f"use one of {', '.join(OBJECTIVES)}"
            )
        if self.confirm_process not in CONFIRM_PROCESSES:
            raise ConfigError(
                "study.confirm_process",
                self.confirm_process,
                f"use one of {', '.join(CONFIRM_PROCESSES)}",
            )
        if self.confirm_max_rounds < self.confirm_min_rounds:
            raise ConfigError(
                "study.confirm_max_rounds",
                self.confirm_max_rounds,
                f"must be at least study.confirm_min_rounds ({self.confirm_min_rounds})",
            )
        if self.training.batch_size not in self.space.batch_sizes:
            raise ConfigError(
                "training.batch_size",
                self.training.batch_size,
                f"(the baseline) is not one of the searched batch sizes"
                f" {list(self.space.batch_sizes)}, and the baseline batch size"
                f" {self.training.batch_size} must be measured too; pick one of them or widen"
                " space.batch_size",
                joiner=" ",
            )

    def with_overrides(
        self, *, name: str | None = None, timeout_s: float | None = None
    ) -> StudyConfig:
        """The config with command-line values applied (CLI > file > default). The trial
        budget is not here: `run_study` takes it, as a continued study keeps its own."""
        if name is not None and not name.strip():
            raise UserError("--study-name is empty: give a name, or leave it out")
        if name is not None:
            check_study_name(name, "--study-name")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UserError(f"--timeout {timeout_s}: must be a positive number of seconds")
        return replace(
            self,
            name=name if name is not None else self.name,
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
        )


def _check_command(config: StudyConfig) -> None:
    """What a command's study needs beyond its own keys."""
    if config.workload_options:
        raise ConfigError(
            "workload.options", dict(config.workload_options), "apply to a workload, not a command"
        )
    if (
        config.command is not None
        and "lr" in config.command.placeholders
        and (config.training.lr is None)
    ):
        raise ConfigError(
            "training.lr",
            None,
            "workload.command passes {lr}: set it to the script's own learning rate at"
            " training.batch_size (it is scaled to each trial's batch size by lr_scaling)",
        )


def check_options_depth(options: Mapping[str, Any]) -> None:
    """Refuse an option whose lists and tables nest deeper than `OPTIONS_MAX_DEPTH`, before
    anything recurses into it (the value itself is not quoted: quoting recurses too)."""
    for key, value in options.items():
        depth = nesting_depth(value)
        if depth > OPTIONS_MAX_DEPTH:
            raise UserError(
                f"workload.options.{shorten(str(key), 80)} nests lists and tables {depth:,}"
                f" levels deep; at most {OPTIONS_MAX_DEPTH} are allowed: flatten it, or pass"
                " large data as a file path the workload reads"
            )


def load_config(path: str | Path) -> StudyConfig:
    """Read and validate a study config file."""
    path = Path(path)
    source = str(path)
    text = _read_config_file(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: not valid TOML: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise UserError(
            f"{source}: not valid TOML for a study: an integer of thousands of digits; no"
            " setting takes one (docs/configuration.md lists their ranges)"
        ) from None
    except RecursionError:
        raise UserError(f"{source}: not valid TOML: arrays or tables nested too deep") from None
    config = parse_config(data, source=source)
    if config.name is None:
        config = replace(config, name=path.stem)
    if config.command is not None:  # it runs in the config file's folder, or workdir from it
        workdir = str((path.parent.absolute() / config.command.workdir).resolve())
        return replace(config, command=replace(config.command, workdir=workdir))
    # Relative paths in the file mean "next to this file", wherever the command runs. The
    # stored document keeps them as written: a worker resolves them against its own folder.
    folder = path.parent.absolute()
    spec, options = resolve_paths(config.workload, config.workload_options, folder)
    module_part = spec.rpartition(":")[0]
    if spec != config.workload and not Path(module_part).is_file():
        raise UserError(
            f"{source}: workload.name = {show_value(config.workload)}: no file {module_part!r}"
            f" (a relative path resolves against the config file's folder, {str(folder)!r})"
        )
    return replace(config, workload=spec, workload_options=options)


def command_config(argv: Sequence[str], val_loss_pattern: str | None = None) -> StudyConfig:
    """The study of ``loader-search run [--val-loss-pattern REGEX] -- COMMAND...``: the
    command, run in this process's folder, every other setting at its default, named after the
    script. Its document is stored as a config file's would be, so that workers can join it
    (with the same ``--val-loss-pattern``); its folder is stored as ``"."``: each worker's own
    (`trusted_command`)."""
    workload: dict[str, Any] = {"command": list(argv)}
    if val_loss_pattern is not None:
        workload["val_loss_pattern"] = val_loss_pattern
    config = parse_config({"workload": workload}, source="the command after --")
    assert config.command is not None
    command = replace(config.command, workdir=os.getcwd())
    return replace(config, name=config.command.script, command=command)


# A study config is a page of TOML: anything far larger is not one (/dev/zero, a log).
MAX_CONFIG_BYTES = 1 << 20


def _read_config_file(path: Path) -> str:
    """The text of the config file ``path``: a regular file of at most `MAX_CONFIG_BYTES`, in
    UTF-8 (a device or a FIFO is refused before it is read)."""
    source = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"config file {source!r} does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {source!r}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"config file {source!r} is not a regular file: give a .toml file")
    with os.fdopen(fd, "rb") as file:
        try:
            raw = file.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise UserError(f"cannot read config file {source!r}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UserError(
            f"config file {source!r} is larger than {MAX_CONFIG_BYTES // 1024} KiB: not a study"
            " config; give the .toml file"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"cannot read config file {source!r}: not UTF-8 text ({exc.reason})"
        ) from None


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> StudyConfig:
    """Validate a config already parsed from TOML (or written as a dict in Python, or read
    back from a study, where anyone who can write the database may have put anything)."""
    if not isinstance(data, Mapping):
        raise UserError(f"{source}: must be a table of settings, got {show_value(data)}")
    try:
        document = copy.deepcopy(dict(data))
    except RecursionError:
        raise UserError(f"{source}: nested too deep to be a study config") from None
    top = Table(source, "", data)
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
    trials = study.int("trials", defaults.trials)
    timeout_s = study.number("timeout_s", None)
    seed = study.int("seed", defaults.seed)
    loss_tolerance = study.number("loss_tolerance", defaults.loss_tolerance)
    confirm_top = study.int("confirm_top", defaults.confirm_top)
    if "confirm_repeats" in study.data:
        raise UserError(
            f"{source}: study.confirm_repeats is gone: candidates are now confirmed in paired"
            " rounds; use confirm_min_rounds (and confirm_max_rounds, confirm_half_width)"
        )
    confirm_min_rounds = study.int("confirm_min_rounds", defaults.confirm_min_rounds)
    confirm_max_rounds = study.int("confirm_max_rounds", defaults.confirm_max_rounds)
    confirm_half_width = study.number("confirm_half_width", defaults.confirm_half_width)
    confirm_process = study.string(
        "confirm_process", defaults.confirm_process, choices=CONFIRM_PROCESSES
    )
    objective = study.string("objective", defaults.objective, choices=OBJECTIVES)
    study.done()

    command = parse_command(workload)
    workload_name = workload.string(
        "name", COMMAND_WORKLOAD if command is not None else defaults.workload
    )
    if command is not None and workload_name != COMMAND_WORKLOAD:
        raise workload.error("name", workload_name, "give workload.name or workload.command")
    options = workload.pop("options", {})
    if not isinstance(options, dict):
        raise workload.error("options", options, "must be a table of keyword arguments")
    try:
        check_options_depth(options)
    except UserError as exc:
        raise UserError(f"{workload.source}: {exc}") from None
    for key, value in options.items():
        # Options are stored with the study as JSON: dates, times and NaN are refused here.
        if not is_plain(value):
            raise workload.error(
                f"options.{key}",
                value,
                "use strings, numbers, booleans, lists or tables (no dates, times, nan or inf)",
            )
    workload.done()
    device = training.string("device", defaults.device)
    try:  # the dataclasses check every rule; the file's name goes in front of their message
        return StudyConfig(
            name=name,
            trials=trials,
            timeout_s=timeout_s,
            seed=seed,
            loss_tolerance=loss_tolerance,
            confirm_top=confirm_top,
            confirm_min_rounds=confirm_min_rounds,
            confirm_max_rounds=confirm_max_rounds,
            confirm_half_width=confirm_half_width,
            confirm_process=confirm_process,
            objective=objective,
            workload=workload_name,
            workload_options=options,
            command=command,
            device=device,
            sampler=_parse_sampler(sampler),
            training=_parse_training(training, seed),
            space=parse_space(space),
            workers=_parse_workers(workers),
            limits=_parse_limits(limits),
            document=document,
        )
    except ConfigError as exc:
        raise UserError(f"{source}: {exc}") from None


def _parse_sampler(table: Table) -> SamplerConfig:
    config = SamplerConfig(
        name=table.string("name", "tpe", SAMPLERS),
        multivariate=table.bool("multivariate", None),
        n_startup_trials=table.int("n_startup_trials", None),
        population_size=table.int("population_size", None),
        model=table.bool("model", True),
    )
    table.done()
    return config


def _parse_workers(table: Table) -> WorkersSettings:
    defaults = WorkersSettings()
    settings = WorkersSettings(
        heartbeat_interval_s=table.int("heartbeat_interval_s", defaults.heartbeat_interval_s),
        grace_period_s=table.int("grace_period_s", defaults.grace_period_s),
        max_retry=table.int("max_retry", defaults.max_retry),
    )
    table.done()
    return settings


def _parse_limits(table: Table) -> TrialLimits:
    """``[limits]``: when a trial is killed."""
    defaults = TrialLimits()
    limits = TrialLimits(
        trial_timeout_s=table.number("trial_timeout_s", defaults.trial_timeout_s),
        memory_limit_gb=table.number("memory_limit_gb", None),
    )
    table.done()
    return limits


def _parse_training(table: Table, seed: int) -> TrainingSettings:
    defaults = TrainingSettings()
    settings = TrainingSettings(
        train_samples=table.int("train_samples", defaults.train_samples),
        batch_size=table.int("batch_size", defaults.batch_size),
        lr_scaling=table.string("lr_scaling", defaults.lr_scaling, LR_SCALINGS),
        lr=table.number("lr", None),
        warmup_batches=table.int("warmup_batches", defaults.warmup_batches),
        eval_batch_size=table.int("eval_batch_size", defaults.eval_batch_size),
        seed=seed,
        reuse_val_loss=table.bool("reuse_val_loss", defaults.reuse_val_loss),
        gradient_accumulation=table.string(
            "gradient_accumulation", defaults.gradient_accumulation, GRADIENT_ACCUMULATION
        ),
        precision=table.string("precision", defaults.precision, PRECISIONS),
        matmul_precision=table.string("matmul_precision", None, MATMUL_PRECISIONS),
        compile=_parse_compile(table),
        channels_last=table.bool("channels_last", defaults.channels_last),
        ranks=table.pop("ranks", defaults.ranks),
    )
    table.done()
    return settings


def _parse_compile(table: Table) -> bool | str:
    """``compile``: true, false or one of torch.compile's modes."""
    value = table.pop("compile", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise table.error("compile", value, f"use true, false or a mode: {', '.join(COMPILE_MODES)}")
