"""The one place that turns `LoaderParams` into a DataLoader."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from loader_search.params import LoaderParams


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
    if shuffle:  # map-style datasets are Sized; the Dataset type just does not say so
        sized = cast(Sized, dataset)
        sampler = RandomSampler(sized, generator=torch.Generator().manual_seed(seed))
    return DataLoader(
        dataset,
        sampler=sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + 1),
        collate_fn=collate_fn,
        **params.loader_kwargs(),
    )
