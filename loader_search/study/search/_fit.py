"""Fitting a search space to this machine's shared memory: a loader worker hands each batch to
the training process through ``/dev/shm``, so settings whose batches in flight cannot fit there
are dropped before the search (and reported by ``loader-search doctor``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from loader_search.params import LoaderParams
from loader_search.study.search._space import IntRange, ResolvedSpace

if TYPE_CHECKING:
    from loader_search.workloads import Workload

SHM_FIX = "raise /dev/shm: docker run --shm-size=2g (compose: shm_size: 2g)"


def sample_bytes(workload: Workload) -> int:
    """Bytes of one collated training sample: what a loader worker writes to shared memory per
    sample. A batch of one is built with the workload's ``collate_fn`` (or the default) from a
    few samples of the training set (decoded and augmented, as training sees them); the
    largest counts, should sizes vary."""
    from torch.utils.data import default_collate

    dataset: Any = workload.train_dataset
    collate = workload.collate_fn or default_collate
    n = len(dataset)
    indices = sorted({0, n // 2, n - 1})
    return max(_nbytes(collate([dataset[i]])) for i in indices)


def shm_footprint_bytes(params: LoaderParams, bytes_per_sample: int) -> int:
    """Shared memory a setting's batches in flight take: every worker process holds up to
    ``prefetch_factor`` collated batches in ``/dev/shm`` (none without workers, and none
    for the thread pool, whose batches stay in this process)."""
    if params.backend == "thread":
        return 0
    return params.batches_in_flight * params.micro_batch_size * bytes_per_sample


def fit_space(
    space: ResolvedSpace, bytes_per_sample: int, shm_bytes: int | None
) -> tuple[ResolvedSpace, list[str]]:
    """The space without the loader settings that cannot fit in ``/dev/shm`` here.

    A value goes only if it fails with *every* choice of the other settings (their smallest
    values: the smallest batch size, the fewest workers, the lowest prefetch_factor), so
    nothing that could work is lost; combinations that still overflow fail as trials
    (``worker_killed``) and the search learns from that. In order: workers are dropped if one
    worker with one prefetched smallest batch does not fit; the least ``num_workers`` is
    lowered to what fits with prefetch 1; the most ``prefetch_factor`` to what fits with the
    fewest workers; the most ``num_workers`` to what fits with the lowest prefetch.

    Returns the space and one message per change (naming the setting, the numbers and the
    fix); the messages are also appended to the space's ``notes``. ``shm_bytes`` None (no
    /dev/shm on this platform) changes nothing.
    """
    if shm_bytes is None or space.num_workers.high == 0 or bytes_per_sample <= 0:
        return space, []
    batch = min(space.batch_sizes)
    per_batch = batch * bytes_per_sample
    workers, prefetch = space.num_workers, space.prefetch_factor
    messages: list[str] = []

    def sized(w: int, p: int) -> str:
        return (
            f"{w} worker(s) x prefetch_factor {p} x batch {batch} x"
            f" {size_text(bytes_per_sample)} per sample = {size_text(w * p * per_batch)}"
        )

    shm = f"/dev/shm ({size_text(shm_bytes)})"
    fix = f"; fix: {SHM_FIX}"
    if per_batch > shm_bytes:
        messages.append(
            f"num_workers: even {sized(1, 1)} does not fit in {shm}; searching num_workers = 0"
            f" only{fix}"
        )
        workers = IntRange(0, 0)
    else:
        most_batches = shm_bytes // per_batch  # >= 1 batch in flight fits
        if workers.low > most_batches:
            low = int(most_batches)
            messages.append(
                f"num_workers min {workers.low} lowered to {low}: {sized(workers.low, 1)}"
                f" does not fit in {shm}{fix}"
            )
            workers = IntRange(low, max(low, workers.high))
        fewest = max(1, workers.low)
        most_prefetch = int(most_batches // fewest)
        if prefetch.high > most_prefetch:
            messages.append(
                f"prefetch_factor max {prefetch.high} lowered to {most_prefetch}:"
                f" {sized(fewest, prefetch.high)} does not fit in {shm}{fix}"
            )
            prefetch = IntRange(min(prefetch.low, most_prefetch), most_prefetch)
        most_workers = int(most_batches // prefetch.low)
        if workers.high > most_workers:
            messages.append(
                f"num_workers max {workers.high} lowered to {most_workers}:"
                f" {sized(workers.high, prefetch.low)} does not fit in {shm}{fix}"
            )
            workers = IntRange(min(workers.low, most_workers), most_workers)
    if not messages:
        return space, []
    fitted = replace(
        space,
        num_workers=workers,
        prefetch_factor=prefetch,
        notes=(*space.notes, *messages),
    )
    return fitted, messages


def largest_footprint(space: ResolvedSpace, bytes_per_sample: int) -> int:
    """Shared memory the space's most demanding setting needs."""
    if space.num_workers.high == 0:
        return 0
    return (
        space.num_workers.high
        * space.prefetch_factor.high
        * max(space.batch_sizes)
        * bytes_per_sample
    )


def _nbytes(value: Any) -> int:
    """Bytes of the tensors (and arrays) in a collated batch, however nested."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.element_size() * value.numel()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays from a custom collate
    return int(nbytes) if isinstance(nbytes, int) else 0


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
