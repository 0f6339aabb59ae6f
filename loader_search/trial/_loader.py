"""The one place that turns `LoaderParams` into a DataLoader."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sized
from typing import Any, cast

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from loader_search.params import LoaderParams
from loader_search.team._lockfiles import close_inherited_locks


def build_loader(
    dataset: Dataset[Any],
    params: LoaderParams,
    *,
    shuffle: bool,
    drop_last: bool = False,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
) -> DataLoader[Any]:
    """A fresh DataLoader with the trial's settings, to be iterated by this process.

    The shuffle order comes from a generator of its own, seeded by ``seed``: every trial sees
    the samples in the same order whatever its loader settings. (Sharing the DataLoader's
    generator would not do: each new iterator draws its workers' base seed from it, so the
    order would depend on ``persistent_workers``.) Its workers start with `WorkerStart`, then
    ``worker_init_fn``.
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
        worker_init_fn=WorkerStart(os.getpid(), worker_init_fn),
        **params.loader_kwargs(),
    )


class WorkerStart:
    """A loader worker's first step: live no longer than the process iterating the loader
    (``owner_pid``), keep none of the host lock's descriptors, then run ``then``.

    Torch's workers notice their parent's death only between batches, every 5 s: one blocked
    in the dataset (a read that never returns) outlived a killed trial for good, and with it
    whatever it had inherited: the pipe through which the trial's end is seen, and a copy of
    the host lock (see `close_inherited_locks`). Picklable, for the ``spawn`` start method.
    """

    def __init__(self, owner_pid: int, then: Callable[[int], None] | None = None) -> None:
        self.owner_pid = owner_pid
        self.then = then

    def __call__(self, worker_id: int) -> None:
        _die_with_parent(self.owner_pid)
        close_inherited_locks()
        if self.then is not None:
            self.then(worker_id)


def _die_with_parent(owner_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when the thread that forked it ends
    (``PR_SET_PDEATHSIG``). A worker whose owner died before the request took effect exits
    at once; one whose parent is another live process (a ``forkserver``) keeps going."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != owner_pid and not psutil.pid_exists(owner_pid):
        os._exit(1)
