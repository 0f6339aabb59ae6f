"""DataLoader settings as a plain value, and the one place that turns them into a DataLoader."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler


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


def build_loader(
    dataset: Dataset[Any],
    params: LoaderParams,
    *,
    shuffle: bool,
    drop_last: bool = False,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A fresh DataLoader with the trial's settings.

    The shuffle order comes from a generator of its own, seeded by ``seed``: every trial sees
    the samples in the same order whatever its loader settings. (Sharing the DataLoader's
    generator would not do: each new iterator draws its workers' base seed from it, so the
    order would depend on ``persistent_workers``.)
    """
    sampler = None
    if shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    return DataLoader(
        dataset,
        sampler=sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + 1),
        collate_fn=collate_fn,
        **params.loader_kwargs(),
    )


def dataloader_snippet(params: LoaderParams, dataset_name: str = "train_dataset") -> str:
    """Ready-to-paste Python for the recommended settings."""
    args = [dataset_name, f"batch_size={params.batch_size}", "shuffle=True"]
    args.append(f"num_workers={params.num_workers}")
    if params.num_workers > 0:
        args.append(f"prefetch_factor={params.prefetch_factor}")
        args.append(f"persistent_workers={params.persistent_workers}")
    args.append(f"pin_memory={params.pin_memory}")
    call = "DataLoader(\n    " + ",\n    ".join(args) + ",\n)"
    return f"torch.set_num_threads({params.torch_threads})\nloader = {call}"
