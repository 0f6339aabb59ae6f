"""What each stage of the input pipeline costs, measured inside one training run.

Throughput says how fast a setting is; stage costs say *why*, and let a model predict settings
not yet tried (`loader_search.study.search._pipeline`). Three stages, in CPU seconds, which
unlike wall time do not grow when processes contend for cores:

* **producer**: what a loader worker spends per sample to fetch it (read, decode, augment) and
  per batch to collate it, measured inside the worker (or in the training process when
  ``num_workers=0``) by wrapping the dataset and the collate function;
* **main process**: what the training process's own thread spends per batch outside the
  training step: receiving the batch from the worker queue (unpickling, mapping shared
  memory) and copying it to the device, production excluded;
* **CPU in use**: the CPU seconds the whole process tree (training process and workers) used
  per second of the window, next to the CPUs it may use: contention made visible.

The consumer (the training step itself) is the ceiling (`loader_search.trial._ceiling`).

Each batch carries its own producer timings from the worker to the training process (a
`TimedBatch`, a named tuple, which DataLoader's pinning thread keeps intact), so the costs are
those of the very batches the window measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import psutil
from torch.utils.data import Dataset, default_collate, get_worker_info

from loader_search._system import affinity_cpus, machine_busy_cpu_s

# CPU seconds the current process has spent fetching samples since its last collate: each
# loader worker (a process of its own) and the training process (num_workers=0) keep their own.
_pending = [0.0, 0]


def _cpu_s() -> float:
    """CPU seconds so far: of the whole process inside a loader worker (it does nothing
    else), of this thread in the training process (whose other threads do other work)."""
    return time.process_time() if get_worker_info() is not None else time.thread_time()


class TimedBatch(NamedTuple):
    """A collated batch with what producing it cost."""

    batch: Any
    fetch_cpu_s: float  # fetching (reading, decoding, augmenting) its samples
    collate_cpu_s: float
    samples: int


class TimedDataset(Dataset[Any]):
    """``dataset`` with each sample's fetch timed (see `_pending`)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        start = _cpu_s()
        item = self.dataset[index]
        _pending[0] += _cpu_s() - start
        _pending[1] += 1
        return item


class _TimedBatchedDataset(TimedDataset):
    """For a dataset that fetches a whole batch at once (``__getitems__``, which DataLoader
    uses when it is there)."""

    def __getitems__(self, indices: Sequence[Any]) -> Any:
        start = _cpu_s()
        items = self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        _pending[0] += _cpu_s() - start
        _pending[1] += len(indices)
        return items


def timed_dataset(dataset: Dataset[Any]) -> TimedDataset:
    if callable(getattr(dataset, "__getitems__", None)):
        return _TimedBatchedDataset(dataset)
    return TimedDataset(dataset)


class TimedCollate:
    """The workload's collate function (or the default), timed, returning a `TimedBatch`
    with the fetch cost of the samples fetched since the last batch (this batch's)."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate

    def __call__(self, samples: list[Any]) -> TimedBatch:
        start = _cpu_s()
        batch = self.collate(samples)
        collate_s = _cpu_s() - start
        fetch_s, _ = _pending
        _pending[0], _pending[1] = 0.0, 0
        return TimedBatch(batch, fetch_s, collate_s, len(samples))


def _tree_cpu_s(process: psutil.Process) -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.Error:  # exited between listing and reading: counted once reaped
            continue
        total += child_times.user + child_times.system
    return float(total)


@dataclass(frozen=True)
class StageCosts:
    """A window's stage costs (see the module docstring); None where nothing was measured."""

    producer_cpu_s_per_sample: float | None
    collate_cpu_s_per_batch: float | None
    main_cpu_s_per_batch: float | None
    cpu_used: float | None  # CPU seconds per second: cores busy on average
    cpus_available: int
    # The share of the CPUs this trial may use that other processes kept busy meanwhile (0:
    # none, 1: all of them): a reading taken beside a busy neighbour is not a fair one.
    other_load: float | None = None


class StageMeter:
    """Adds up the stage costs of the batches a `StepMeter` window counts.

    Per batch, in the training loop: ``received(timed, next_cpu_s)`` after ``next()`` (with
    the thread's CPU seconds that ``next()`` took), ``copied(copy_cpu_s)`` after moving it to
    the device. ``open()`` when the window opens; ``snapshot()`` at any time after.
    """

    def __init__(self, cpus_available: int) -> None:
        self._cpus = cpus_available
        self._process = psutil.Process(os.getpid())
        self._open_at: tuple[float, float] | None = None
        self._affinity = affinity_cpus()
        self._machine_at: float | None = None
        self._fetch = self._collate = self._main = 0.0
        self._samples = self._batches = 0

    def open(self) -> None:
        self._open_at = (time.perf_counter(), _tree_cpu_s(self._process))
        self._machine_at = machine_busy_cpu_s(self._affinity)

    @property
    def is_open(self) -> bool:
        return self._open_at is not None

    def received(self, timed: TimedBatch, next_cpu_s: float, in_process: bool) -> None:
        """``in_process``: the batch was produced by this thread inside ``next()`` (no
        workers), so its production is not the main process's overhead."""
        if not self.is_open:
            return
        self._fetch += timed.fetch_cpu_s
        self._collate += timed.collate_cpu_s
        overhead = next_cpu_s
        if in_process:
            overhead -= timed.fetch_cpu_s + timed.collate_cpu_s
        self._main += max(0.0, overhead)
        self._samples += timed.samples
        self._batches += 1

    def copied(self, copy_cpu_s: float) -> None:
        if self.is_open:
            self._main += copy_cpu_s

    def snapshot(self) -> StageCosts:
        cpu_used = other_load = None
        if self._open_at is not None:
            opened, cpu_then = self._open_at
            elapsed = time.perf_counter() - opened
            machine = machine_busy_cpu_s(self._affinity)
            if elapsed > 0:
                ours = _tree_cpu_s(self._process) - cpu_then
                cpu_used = ours / elapsed
                if machine is not None and self._machine_at is not None:
                    cpus = len(self._affinity) if self._affinity else os.cpu_count() or 1
                    others = machine - self._machine_at - ours
                    other_load = min(1.0, max(0.0, others / (elapsed * cpus)))
        batches, samples = self._batches, self._samples
        return StageCosts(
            producer_cpu_s_per_sample=self._fetch / samples if samples else None,
            collate_cpu_s_per_batch=self._collate / batches if batches else None,
            main_cpu_s_per_batch=self._main / batches if batches else None,
            cpu_used=cpu_used,
            cpus_available=self._cpus,
            other_load=other_load,
        )
