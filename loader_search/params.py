"""The plain values a study passes around: loader settings, training settings, the workers'
and the trials' limits. The rule (range) of every numeric config value is in
`loader_search._rules`; the Python a recommendation prints, in `loader_search._snippets`.

No torch import here: configs are validated, and errors reported, without loading torch.
Field names are the config file's keys, so a check names the key a user wrote.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from loader_search._rules import check_fields, check_value
from loader_search.errors import ConfigError

StartMethod = Literal["fork", "forkserver", "spawn"]
START_METHODS: tuple[StartMethod, ...] = ("fork", "forkserver", "spawn")
Backend = Literal["process", "thread"]
BACKENDS: tuple[Backend, ...] = ("process", "thread")
# LoaderParams fields added after studies were first stored, with their defaults.
_LATER_DEFAULTS: dict[str, Any] = {
    "accumulation_steps": 1,
    "in_order": True,
    "start_method": None,
    "backend": "process",
}

# The types each stored loader setting may have, and its range's rule in `RANGES` (the
# strings are checked against their choices by `LoaderParams` itself).
_STORED_FIELDS: dict[str, tuple[tuple[type, ...], str | None]] = {
    "batch_size": ((int,), "space.batch_size"),
    "num_workers": ((int,), "space.num_workers"),
    "prefetch_factor": ((int, type(None)), "space.prefetch_factor"),
    "pin_memory": ((bool,), None),
    "persistent_workers": ((bool,), None),
    "torch_threads": ((int,), "space.torch_threads"),
    "accumulation_steps": ((int,), "space.batch_size"),
    "in_order": ((bool,), None),
    "start_method": ((str, type(None)), None),
    "backend": ((str,), None),
}


@dataclass(frozen=True)
class LoaderParams:
    """One point of the search space: how to load batches and how many threads train on them.

    The invariants mirror PyTorch's own argument rules, so an instance always builds a loader
    that iterates: ``prefetch_factor`` and ``persistent_workers`` exist only with workers
    (``prefetch_factor=0`` passes the DataLoader constructor but fails on iteration).

    ``batch_size`` is the effective batch, what one optimizer step averages over (what
    convergence sees, and what the learning rate is scaled for). With ``accumulation_steps``
    above 1 it is trained as that many micro-batches of `micro_batch_size`, the DataLoader's
    ``batch_size`` (what memory and speed see), with the gradients accumulated.

    With workers: ``in_order=False`` delivers batches as workers finish them (DataLoader's
    ``in_order``, torch >= 2.6); ``start_method`` is the workers' multiprocessing start method
    (None: the platform's default); ``backend`` ``"thread"`` loads with a pool of
    ``num_workers`` threads in this process (``torchdata.nodes``) instead of worker processes.
    """

    batch_size: int
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    torch_threads: int = 1
    accumulation_steps: int = 1
    in_order: bool = True
    start_method: StartMethod | None = None
    backend: Backend = "process"

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.accumulation_steps < 1 or self.batch_size % self.accumulation_steps:
            raise ValueError(
                f"accumulation_steps must divide batch_size {self.batch_size}, got"
                f" {self.accumulation_steps}"
            )
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.num_workers == 0:
            if self.prefetch_factor is not None:
                raise ValueError("prefetch_factor is only valid with num_workers > 0")
            if self.persistent_workers:
                raise ValueError("persistent_workers is only valid with num_workers > 0")
        elif self.prefetch_factor is None or self.prefetch_factor < 1:
            raise ValueError(
                f"prefetch_factor must be >= 1 with workers, got {self.prefetch_factor}"
            )
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got"
                f" {self.start_method!r}"
            )
        if self.num_workers == 0 and (not self.in_order or self.start_method is not None):
            raise ValueError("in_order and start_method are only valid with num_workers > 0")
        if self.num_workers == 0 and self.backend != "process":
            raise ValueError("backend 'thread' needs num_workers > 0 (its threads)")
        if self.backend == "thread" and (self.start_method is not None or self.persistent_workers):
            raise ValueError("start_method and persistent_workers are for worker processes")

    @property
    def batches_in_flight(self) -> int:
        """Batches the loader holds ready ahead of training: ``prefetch_factor`` per worker
        process, or ``prefetch_factor`` in all for the thread pool."""
        if self.num_workers == 0:
            return 0
        per_worker = 1 if self.backend == "thread" else self.num_workers
        return per_worker * (self.prefetch_factor or 0)

    @property
    def micro_batch_size(self) -> int:
        """The DataLoader's batch size: the effective batch over the accumulation steps."""
        return self.batch_size // self.accumulation_steps

    def as_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        # Settings at their defaults are left out: stored as before they existed.
        for name, default in _LATER_DEFAULTS.items():
            if values[name] == default:
                del values[name]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoaderParams:
        """Settings as `as_dict` stored them, or as Optuna's params hold them. Checked as
        the database may hold anything (other hands write it): a `ValueError` says what is
        wrong with a value of the wrong type or out of range; unknown keys are ignored."""
        if not isinstance(values, Mapping):
            raise ValueError(f"loader settings must be a table, got {type(values).__name__}")
        kwargs: dict[str, Any] = {}
        for name, (kinds, rule) in _STORED_FIELDS.items():
            if name not in values:
                continue
            value = values[name]
            if value is None and type(None) in kinds:
                kwargs[name] = None
                continue
            if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
                raise ValueError(f"loader setting {name} = {value!r} has the wrong type")
            if rule is not None:
                try:
                    check_value(name, value, rule)
                except ConfigError as exc:
                    raise ValueError(f"loader setting {exc}") from None
            kwargs[name] = value
        if "batch_size" not in kwargs:
            raise ValueError("loader settings without a batch_size")
        return cls(**kwargs)  # its own checks raise ValueError too

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader`` (threads are not a loader arg)."""
        kwargs: dict[str, Any] = {
            "batch_size": self.micro_batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
        }
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
            if not self.in_order:  # only when asked: torch before 2.6 has no such argument
                kwargs["in_order"] = False
            if self.start_method is not None:
                kwargs["multiprocessing_context"] = self.start_method
        return kwargs

    def describe(self) -> str:
        """Short one-line form for logs and progress output."""
        batch = f"batch={self.batch_size}"
        if self.accumulation_steps > 1:
            batch += f" ({self.accumulation_steps}x{self.micro_batch_size})"
        # The thread backend's loading threads are not the torch threads named last.
        kind = "loader-threads" if self.backend == "thread" else "workers"
        parts = [batch, f"{kind}={self.num_workers}"]
        if self.num_workers > 0:
            parts.append(f"prefetch={self.prefetch_factor}")
            if self.persistent_workers:
                parts.append("persistent")
            if not self.in_order:
                parts.append("out-of-order")
            if self.start_method is not None:
                parts.append(self.start_method)
        if self.pin_memory:
            parts.append("pinned")
        parts.append(f"threads={self.torch_threads}")
        return " ".join(parts)


LrScaling = Literal["none", "linear", "sqrt"]
# What a study's recommendation and paired rounds maximise: samples per second, or goodput
# (throughput times the statistical efficiency of its batch size; loader_search.study.stats).
Objective = Literal["throughput", "goodput"]
OBJECTIVES: tuple[Objective, ...] = ("throughput", "goodput")
LR_SCALINGS: tuple[LrScaling, ...] = ("none", "linear", "sqrt")
GradientAccumulation = Literal["auto", "off"]
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")
MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: tuple[MatmulPrecision, ...] = ("highest", "high", "medium")
MAX_RANKS = 1024  # ranks of one trial, at most
# The [training] keys of the user's step (loader_search.trial._step)
STEP_KEYS = ("precision", "matmul_precision", "compile", "channels_last", "ranks")
# torch.compile's modes (``compile = true`` is "default")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GRADIENT_ACCUMULATION: tuple[GradientAccumulation, ...] = ("auto", "off")


@dataclass(frozen=True)
class TrainingSettings:
    """How every trial of a study trains (``[training]``); the same for all trials so results
    compare. ``batch_size`` is the baseline's batch size, at which ``lr`` applies."""

    train_samples: int = 8192
    batch_size: int = 64
    lr_scaling: LrScaling = "sqrt"
    lr: float | None = None  # None: the workload's base_lr, at batch_size
    warmup_batches: int = 2
    eval_batch_size: int = 256
    seed: int = 0
    # A trial whose batch size was already evaluated stops early (see
    # loader_search.study.work._plan).
    reuse_val_loss: bool = True
    # "auto": a batch size that does not fit in memory (measured or inferred) is trained as
    # micro-batches that fit, with the gradients accumulated; "off": it is infeasible.
    gradient_accumulation: GradientAccumulation = "auto"
    # The user's step (loader_search.trial._step): autocast precision, float32 matmul
    # precision (None: torch's own), torch.compile (False, True or a mode), channels_last.
    precision: Precision = "fp32"
    matmul_precision: MatmulPrecision | None = None
    compile: bool | str = False
    channels_last: bool = False
    # Ranks per trial (loader_search.trial._ranks): 1, N, or "auto" (one per visible GPU).
    ranks: int | str = 1

    @property
    def compile_mode(self) -> str | None:
        """torch.compile's mode, or None when the model is not compiled."""
        if self.compile is True:
            return "default"
        return self.compile or None  # type: ignore[return-value]

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                "training.precision", self.precision, f"use one of {', '.join(PRECISIONS)}"
            )
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ConfigError(
                "training.matmul_precision",
                self.matmul_precision,
                f"use one of {', '.join(MATMUL_PRECISIONS)}",
            )
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_MODES:
            raise ConfigError(
                "training.compile",
                self.compile,
                f"use true, false or a mode: {', '.join(COMPILE_MODES)}",
            )
        if self.ranks != "auto" and (
            isinstance(self.ranks, bool)
            or not isinstance(self.ranks, int)
            or not 1 <= self.ranks <= MAX_RANKS
        ):
            raise ConfigError(
                "training.ranks",
                self.ranks,
                f'use a whole number of ranks from 1 to {MAX_RANKS}, or "auto"',
            )
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(
                "training.lr_scaling", self.lr_scaling, f"use one of {', '.join(LR_SCALINGS)}"
            )
        if self.gradient_accumulation not in GRADIENT_ACCUMULATION:
            raise ConfigError(
                "training.gradient_accumulation",
                self.gradient_accumulation,
                f"use one of {', '.join(GRADIENT_ACCUMULATION)}",
            )
        check_fields(self, "training")


@dataclass(frozen=True)
class WorkersSettings:
    """How workers prove they are alive (``[workers]``). A RUNNING trial whose worker has not
    written a heartbeat for ``grace_period_s`` is failed by whichever worker sweeps first, and
    queued again with the same settings at most ``max_retry`` times."""

    heartbeat_interval_s: int = 20
    grace_period_s: int = 120
    max_retry: int = 2

    def __post_init__(self) -> None:
        check_fields(self, "workers")
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "workers.grace_period_s",
                self.grace_period_s,
                f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s})",
            )


@dataclass(frozen=True)
class TrialLimits:
    """When the parent kills a trial (``[limits]``).

    ``trial_timeout_s``: no training progress (no training step, no evaluation batch) for
    this long → the trial is killed, reason ``timeout``. ``memory_limit_gb`` (GiB, 2**30
    bytes, as ``docker run --memory 8g`` counts): the proportional set size (PSS) of the child
    and all its descendants (loader workers) above this → killed, reason ``host_oom``
    (infeasible). PSS, not RSS: a forked child and each of its workers map the parent's
    pages, and summing RSS would count them once per process.
    """

    trial_timeout_s: float = 600.0
    memory_limit_gb: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, "limits")

    @property
    def memory_limit_bytes(self) -> int | None:
        if self.memory_limit_gb is None:
            return None
        return max(1, round(self.memory_limit_gb * 2**30))


@dataclass(frozen=True)
class RunPlan:
    """What one trial measures besides training with its settings; the worker decides it.

    ``short_samples``: the throughput window ends when this many samples have trained, the
    same mark for a full and a shortened trial so that they compare (see
    `loader_search.trial._run.short_run_samples`). ``stop_early``: stop training there and skip
    the evaluation, because the study already knows the validation loss of this batch size
    (see `loader_search.study.work._plan`). ``measure_ceiling``: after training, time the same
    model on pre-decoded batches already on the device, the throughput no loader can beat.
    """

    short_samples: int | None = None
    stop_early: bool = False
    measure_ceiling: bool = False

    def __post_init__(self) -> None:
        if self.short_samples is not None and self.short_samples < 1:
            raise ValueError(f"short_samples must be >= 1, got {self.short_samples}")
        if self.stop_early and self.short_samples is None:
            raise ValueError("stop_early needs short_samples")


FULL_RUN = RunPlan()  # train the whole budget and evaluate; nothing else


def scaled_lr(base_lr: float, batch_size: int, base_batch_size: int, rule: LrScaling) -> float:
    """Learning rate for ``batch_size``, scaled from ``base_lr`` at ``base_batch_size``.

    ``linear`` (Goyal et al.) keeps the per-sample step size for SGD; ``sqrt`` keeps the
    gradient noise scale and is the safer default for adaptive optimisers; ``none`` compares
    batch sizes at one learning rate, which penalises large batches.
    """
    ratio = batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr
