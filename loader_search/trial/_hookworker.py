"""The trial hook's side in the loader workers of a command: what producing a batch costs, and
whether an `IterableDataset` splits its stream across the workers.

The hook (`loader_search.trial._inject`) gives the training loader a `HookCollate` in place
of its collate function (the user's own, or torch's default, still does the collating). The
stage costs it measures are those a built-in trial measures (`loader_search.trial._stages`),
in CPU seconds:

* in a loader worker, which does nothing but produce batches, the collate is timed directly
  and the fetch (reading, decoding, augmenting the samples, or pulling them from an iterable
  stream) is the worker's CPU time from the end of one collate to the start of the next: it
  includes handing the previous batch to the queue, as the built-in's producer cost does not
  (a small share for batches of tensors). A worker's first batch is left out: its start
  (the worker's set-up, the stream's opening) is not a batch's cost;
* in the training process (``num_workers=0``) the collate is timed the same way and the
  measured iterator (`loader_search.trial._hookstate.TrainIter`) takes it from the CPU time
  ``next()`` took: the rest is the fetch.

A worker writes ``<trial dir>/worker-<pid>.json`` (atomically, at most every half second, and
after its first two batches, so the service learns soon whether the stream is split): its
totals over the batches counted, its ``worker_id`` and ``num_workers``, and ``asked``:
whether anything in the worker but the collate (torch's default collate asks, to place its
batch in shared memory) called `torch.utils.data.get_worker_info` (the hook wraps it).
An `IterableDataset` that never asks cannot know which part of the stream is its own: with
two or more workers, each yields the whole stream.

Nothing here may raise into the user's program: an error is written once to
``hook-error-<pid>.txt`` and the batch goes on, uncounted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

WORKER_FILE = "worker-{pid}.json"
_WRITE_EVERY_S = 0.5
_EARLY_WRITES = 2  # batches after which a worker writes at once


class WorkerStats:
    """One loader worker's producer costs, in its own process."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.pid = os.getpid()
        self.fetch_cpu_s = 0.0
        self.collate_cpu_s = 0.0
        self.samples = 0
        self.batches = 0  # counted (a worker's first batch is not)
        self.produced = 0  # every batch the worker collated
        self.asked = False
        self.collating = False  # torch's default collate asks get_worker_info itself
        self.last_end: float | None = None
        self._written_at = 0.0
        self._failed = False

    def collated(self, started: float, ended: float, samples: int) -> None:
        if self.last_end is not None:
            self.fetch_cpu_s += max(0.0, started - self.last_end)
            self.collate_cpu_s += ended - started
            self.samples += samples
            self.batches += 1
        self.last_end = ended
        self.produced += 1
        now = time.monotonic()
        if self.produced <= _EARLY_WRITES or now - self._written_at >= _WRITE_EVERY_S:
            self._written_at = now
            self.write()

    def as_json(self) -> dict[str, Any]:
        info = worker_info()
        return {
            "pid": self.pid,
            "worker_id": getattr(info, "id", None),
            "num_workers": getattr(info, "num_workers", None),
            "fetch_cpu_s": self.fetch_cpu_s,
            "collate_cpu_s": self.collate_cpu_s,
            "samples": self.samples,
            "batches": self.batches,
            "produced": self.produced,
            "asked": self.asked,
        }

    def write(self) -> None:
        path = os.path.join(self.folder, WORKER_FILE.format(pid=self.pid))
        temporary = os.path.join(self.folder, f".worker-{self.pid}.json.tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as file:
                json.dump(self.as_json(), file)
            os.replace(temporary, path)
        except Exception as exc:
            self.fail("writing the worker's state file", exc)

    def fail(self, where: str, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        from loader_search.trial._hookstate import one_line, write_error

        write_error(self.folder, f"{where}: {one_line(exc)}")


_WORKER: WorkerStats | None = None
# The training process's last collate time (num_workers=0), for TrainIter to take from next().
inline_collate_s = [0.0]


def worker_info() -> Any:
    """torch's ``get_worker_info()``, not the hook's wrapper (the hook's own calls do not
    count as the user's)."""
    from torch.utils.data._utils import worker

    original = getattr(worker.get_worker_info, "__wrapped__", worker.get_worker_info)
    return original()


def worker_stats() -> WorkerStats | None:
    """This loader worker's stats (made on first use), None outside a worker or a trial."""
    global _WORKER
    if _WORKER is not None and _WORKER.pid == os.getpid():
        return _WORKER
    folder = os.environ.get("LOADER_SEARCH_TRIAL_DIR")
    if not folder or worker_info() is None:
        return None
    _WORKER = WorkerStats(folder)
    return _WORKER


class HookCollate:
    """The training loader's collate function, timed (see the module docstring). Picklable:
    a spawned worker gets it with the user's own collate inside."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        try:
            stats = worker_stats()
        except Exception:
            stats = None
        if stats is None:  # the training process itself (num_workers=0)
            start = time.thread_time()
            batch = self.collate(samples)
            inline_collate_s[0] = time.thread_time() - start
            return batch
        start = time.process_time()
        stats.collating = True
        try:
            batch = self.collate(samples)
        finally:
            stats.collating = False
        try:
            stats.collated(start, time.process_time(), _count(samples))
        except Exception as exc:
            stats.fail("timing the collate", exc)
        return batch


def _count(samples: Any) -> int:
    try:
        return len(samples)
    except TypeError:
        return 1


def patch_worker_info(modules: list[Any]) -> None:
    """Wrap ``get_worker_info`` where user code finds it, so a worker knows it was asked."""
    from torch.utils.data._utils import worker

    original = getattr(worker.get_worker_info, "__wrapped__", worker.get_worker_info)

    def get_worker_info() -> Any:
        info = original()
        if info is not None:
            try:
                stats = worker_stats()
                if stats is not None and not stats.asked and not stats.collating:
                    stats.asked = True
                    stats.write()
            except Exception:  # never into the user's program
                pass
        return info

    get_worker_info.__wrapped__ = original  # type: ignore[attr-defined]
    get_worker_info.__doc__ = original.__doc__
    for module in [worker, *modules]:
        if module is not None and getattr(module, "get_worker_info", None) is original:
            module.get_worker_info = get_worker_info
