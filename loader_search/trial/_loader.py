"""The one place that turns `LoaderParams` into a DataLoader."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import psutil
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)

from loader_search._inherited import close_inherited_locks
from loader_search.params import LoaderParams


def build_loader(
    dataset: Dataset[Any],
    params: LoaderParams,
    *,
    shuffle: bool,
    drop_last: bool = False,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    sampler: Sampler[int] | None = None,
) -> DataLoader[Any] | ThreadLoader:
    """A fresh DataLoader with the trial's settings, to be iterated by this process (a
    `ThreadLoader` for ``backend = "thread"``).

    The shuffle order comes from a generator of its own, seeded by ``seed``: every trial sees
    the samples in the same order whatever its loader settings. (Sharing the DataLoader's
    generator would not do: each new iterator draws its workers' base seed from it, so the
    order would depend on ``persistent_workers``.) Its workers start with `WorkerStart`, then
    ``worker_init_fn``. A ``sampler`` given (a rank's `DistributedSampler`) replaces that
    order.
    """
    if (
        sampler is None and shuffle
    ):  # map-style datasets are Sized; the Dataset type just does not say so
        sized = cast(Sized, dataset)
        sampler = RandomSampler(sized, generator=torch.Generator().manual_seed(seed))
    if params.backend == "thread":
        return ThreadLoader(dataset, params, sampler, drop_last, collate_fn)
    return DataLoader(
        dataset,
        sampler=sampler,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed + 1),
        collate_fn=collate_fn,
        worker_init_fn=WorkerStart(os.getpid(), worker_init_fn),
        **params.loader_kwargs(),
    )


class ThreadLoader:
    """The ``thread`` backend: ``params.num_workers`` threads of this process call the
    dataset's ``__getitem__`` (``torchdata.nodes.ParallelMapper``), a background thread
    collates and keeps ``prefetch_factor`` batches ready (``Prefetcher``). The same dataset,
    sampler and collate function as the DataLoader, so the batches hold the same samples in
    the same order (with ``in_order``). No worker start-up, no copies between processes, no
    shared memory; the threads share this process's GIL where the dataset holds it.

    Each ``iter()`` is one epoch, as a DataLoader's is.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        params: LoaderParams,
        sampler: Sampler[int] | None,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        try:
            from torchdata import nodes
        except ImportError:
            raise ImportError(
                "backend 'thread' needs torchdata: pip install 'loader-search[threads]'"
            ) from None
        self.dataset = dataset
        self.sampler = sampler
        sized = cast(Sized, dataset)
        node: Any = nodes.SamplerWrapper(
            sampler if sampler is not None else SequentialSampler(sized)
        )
        node = nodes.ParallelMapper(
            node,
            map_fn=dataset.__getitem__,
            num_workers=params.num_workers,
            in_order=params.in_order,
            method="thread",
        )
        node = nodes.Batcher(node, batch_size=params.micro_batch_size, drop_last=drop_last)
        node = nodes.Mapper(node, collate_fn or default_collate)
        node = nodes.Prefetcher(node, prefetch_factor=params.prefetch_factor or 1)
        if params.pin_memory:
            node = nodes.PinMemory(node)
        self._loader = nodes.Loader(node)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)


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


_forked_from: int | None = None  # this process's parent when it was forked (a fork's child)


def _remember_parent() -> None:
    global _forked_from
    _forked_from = os.getppid()


# Run in every forked child (a loader worker among them) before a worker's init: the parent
# it was forked from, to tell from the parent it has by the time it asks to die with it.
os.register_at_fork(after_in_child=_remember_parent)


def _die_with_parent(owner_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when the thread that forked it ends
    (``PR_SET_PDEATHSIG``).

    The request covers only a parent still alive when it is made: a worker whose parent died
    between the fork and here (re-parented, to init or to a child subreaper) exits at once,
    as does one whose owner is gone or a zombie (an owner killed and not yet reaped still
    "exists"). One whose parent is another live process (a ``forkserver``) keeps going."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    parent = os.getppid()  # after the request: a parent that dies later kills this worker
    if parent == owner_pid:
        return
    if _forked_from is not None and _forked_from != parent:  # re-parented since the fork
        os._exit(1)
    if not _alive(owner_pid):
        os._exit(1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: neither gone nor a zombie (dead, its exit not yet collected)."""
    try:
        status: str = psutil.Process(pid).status()
        return bool(status != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not allowed to look: it exists
        return True
