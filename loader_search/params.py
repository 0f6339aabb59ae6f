"""The plain values a study passes around: loader settings and training settings.

No torch import here: configs are validated, and errors reported, without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LoaderParams:
    """One point of the search space: how to load batches and how many threads train on them.

    The invariants mirror PyTorch's own argument rules, so an instance always builds a loader
    that iterates: ``prefetch_factor`` and ``persistent_workers`` exist only with workers
    (``prefetch_factor=0`` passes the DataLoader constructor but fails on iteration).
    """

    batch_size: int
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoaderParams:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader`` (threads are not a loader arg)."""
        kwargs: dict[str, Any] = {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
        }
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
        return kwargs

    def describe(self) -> str:
        """Short one-line form for logs and progress output."""
        parts = [f"batch={self.batch_size}", f"workers={self.num_workers}"]
        if self.num_workers > 0:
            parts.append(f"prefetch={self.prefetch_factor}")
            if self.persistent_workers:
                parts.append("persistent")
        if self.pin_memory:
            parts.append("pinned")
        parts.append(f"threads={self.torch_threads}")
        return " ".join(parts)


LrScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS: tuple[LrScaling, ...] = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class TrainingSettings:
    """How every trial of a study trains; the same for all trials so results compare."""

    train_samples: int = 8192
    base_batch_size: int = 64
    lr_scaling: LrScaling = "sqrt"
    lr: float | None = None  # None: the workload's base_lr, at base_batch_size
    warmup_batches: int = 2
    eval_batch_size: int = 256
    seed: int = 0
    # A trial whose batch size was already evaluated stops early (see loader_search.study._plan).
    reuse_val_loss: bool = True

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {LR_SCALINGS}, got {self.lr_scaling!r}")
        for name in ("train_samples", "base_batch_size", "warmup_batches", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RunPlan:
    """What one trial measures besides training with its settings; the worker decides it.

    ``short_samples``: the throughput window ends when this many samples have trained, the
    same mark for a full and a shortened trial so that they compare (see
    `loader_search.trial._run.short_run_samples`). ``stop_early``: stop training there and skip
    the evaluation, because the study already knows the validation loss of this batch size
    (see `loader_search.study._plan`). ``measure_ceiling``: after training, time the same
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


def dataloader_snippet(
    params: LoaderParams, dataset_name: str = "train_dataset", lr: float | None = None
) -> str:
    """Ready-to-paste Python for the recommended settings.

    ``lr`` is the learning rate the trial trained with: a different batch size than the
    user's comes with its scaled learning rate, and the snippet says so.
    """
    lines = []
    if lr is not None:
        lines.append(f"# train with lr={lr:.4g} at this batch size (as measured)")
    lines.append(f"torch.set_num_threads({params.torch_threads})")
    args = [dataset_name, f"batch_size={params.batch_size}", "shuffle=True"]
    args.append(f"num_workers={params.num_workers}")
    if params.num_workers > 0:
        args.append(f"prefetch_factor={params.prefetch_factor}")
        args.append(f"persistent_workers={params.persistent_workers}")
    args.append(f"pin_memory={params.pin_memory}")
    lines.append("loader = DataLoader(\n    " + ",\n    ".join(args) + ",\n)")
    return "\n".join(lines)
