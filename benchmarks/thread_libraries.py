"""Loading alone (no training): the DataLoader with worker processes, ``torchdata.nodes``
threads and SPDL threads over the quickstart training set and its variable-cost variant
(issue 18: which thread-pool library the thread backend is built on). Needs
``pip install spdl==0.8.0``, which loader-search does not depend on. Run:
``python -m benchmarks.thread_libraries``.
"""

from __future__ import annotations

import functools
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import Dataset, RandomSampler, default_collate

from loader_search.params import LoaderParams
from loader_search.trial import build_loader
from loader_search.workloads.synthetic_images import synthetic_images

BATCH, WORKERS, PREFETCH = 64, 2, 2


def _cpu_s() -> float:
    """CPU time of this process and its reaped children (the loader's worker processes)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _spdl(dataset: Dataset[Any]) -> Iterable[Any]:
    from spdl.pipeline import PipelineBuilder

    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    pipeline = (
        PipelineBuilder()
        .add_source(list(sampler))
        .pipe(dataset.__getitem__, concurrency=WORKERS, output_order="input")
        .aggregate(BATCH)
        .pipe(default_collate)
        .add_sink(PREFETCH)
        .build(num_threads=WORKERS)
    )

    def batches() -> Iterable[Any]:
        with pipeline.auto_stop():
            yield from pipeline

    return batches()


def main() -> None:
    torch.set_num_threads(1)
    for name, slow in (("quickstart", 0.0), ("variable cost", 0.1)):
        dataset = synthetic_images(train_size=4096, val_size=64, slow_fraction=slow).train_dataset
        processes = LoaderParams(BATCH, WORKERS, PREFETCH)
        threads = LoaderParams(BATCH, WORKERS, PREFETCH, backend="thread")
        loaders: dict[str, Callable[[], Iterable[Any]]] = {
            f"DataLoader {WORKERS} processes": functools.partial(
                build_loader, dataset, processes, shuffle=True
            ),
            f"torchdata.nodes {WORKERS} threads": functools.partial(
                build_loader, dataset, threads, shuffle=True
            ),
            f"SPDL {WORKERS} threads": functools.partial(_spdl, dataset),
        }
        readings: dict[str, list[tuple[float, float]]] = {label: [] for label in loaders}
        for _ in range(3):
            for label, make in loaders.items():
                started, cpu = time.perf_counter(), _cpu_s()
                samples = sum(len(targets) for _, targets in make())
                elapsed, used = time.perf_counter() - started, _cpu_s() - cpu
                readings[label].append((samples / elapsed, 1e3 * used / samples))
        for label, values in readings.items():
            rate = statistics.median(v[0] for v in values)
            cpu_ms = statistics.median(v[1] for v in values)
            print(f"{name:14} {label:28} {rate:8,.0f} samples/s  {cpu_ms:.3f} CPU ms/sample")


if __name__ == "__main__":
    main()
