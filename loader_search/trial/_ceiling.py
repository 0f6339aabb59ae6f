"""The ceiling of one trial: the same model and step fed batches already decoded and on the
device, the throughput no loader setting can beat (loader efficiency divides by it).

Also the device synchronisation the training window shares with it: CUDA runs asynchronously,
and a clock that does not wait for the queued work times the queueing, not the work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from loader_search.params import LoaderParams
from loader_search.trial._loader import build_loader
from loader_search.trial._step import Step

# Steps timed on pre-decoded batches, at the least, and for at least this long.
CEILING_WARMUP_STEPS = 2
CEILING_MIN_STEPS = 5
CEILING_MIN_S = 0.5
CEILING_DISTINCT_BATCHES = 2  # cycled: their content does not change the compute


def no_progress() -> None:
    """The progress ping of a run nobody watches."""


def sync_for(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA runs asynchronously); a no-op on CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure_ceiling(
    step: Step,
    optimizer: torch.optim.Optimizer,
    params: LoaderParams,
    progress: Callable[[], None] = no_progress,
) -> float:
    """Samples/s of the same step and batch size fed from batches already decoded and on
    the device: the throughput no loader setting can beat (loader efficiency divides by it).

    A few batches are decoded once, moved to the device, and cycled: their content does not
    change the compute. Timed after ``CEILING_WARMUP_STEPS``, device-synchronised, for at
    least ``CEILING_MIN_STEPS`` steps and ``CEILING_MIN_S`` seconds. It trains the model on
    (so it runs after the evaluation).
    """
    micro = params.micro_batch_size
    plain = LoaderParams(batch_size=micro, torch_threads=params.torch_threads)
    workload = step.workload
    loader = build_loader(
        workload.train_dataset, plain, shuffle=True, collate_fn=workload.collate_fn
    )
    batches = []
    for batch in loader:
        if step.size(batch, micro) < micro:
            break  # a short last batch would compile a new shape and time another step
        batches.append(step.prepare(batch))
        if len(batches) == CEILING_DISTINCT_BATCHES:
            break
    if not batches:
        raise ValueError(f"the training set has fewer than {micro} samples")
    sync = sync_for(step.device)
    step.module.train()
    accumulate = params.accumulation_steps

    def one(i: int) -> int:  # one micro-batch; the optimizer steps after each full batch
        batch = batches[i % len(batches)]
        loss = step.loss(batch)
        if i % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
        step.backward(loss / accumulate if accumulate > 1 else loss)
        if i % accumulate == accumulate - 1:
            step.optimizer_step(optimizer)
        progress()
        return micro

    warmup = CEILING_WARMUP_STEPS * accumulate
    for i in range(warmup):
        one(i)
    sync()
    start = time.perf_counter()
    samples = steps = 0
    while (
        steps < CEILING_MIN_STEPS * accumulate
        or steps % accumulate
        or time.perf_counter() - start < CEILING_MIN_S
    ):
        samples += one(warmup + steps)
        steps += 1
        if steps % CEILING_MIN_STEPS == 0:
            sync()  # the clock must see finished work, not queued work
    sync()
    return samples / (time.perf_counter() - start)
