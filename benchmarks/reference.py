"""A plain training loop, written as a user would write it: the yardstick for the service's
readings.

It shares no code with `loader_search.trial` (the trial runner it checks): only the workload's
data, model, loss and optimizer come from `loader_search.workloads`, and the settings from
the study config. Each reading is a fresh Python process (`benchmarks._fresh`), as a user's
training script is:

1. ``torch.set_num_threads``, a seeded model and optimizer, the learning rate of the batch
   size (the study's rule), a ``torch.utils.data.DataLoader`` built with the setting's
   arguments and nothing else (the platform's start method, shuffling, the workload's collate).
2. ``for epoch: for inputs, targets in loader:`` forward, loss, backward, step.
3. The first ``warmup`` batches are not timed (worker start-up, the prefetch burst); then
   ``windows`` consecutive windows of ``window_batches`` batches each, timed with
   ``time.perf_counter`` between the ends of two steps. The reading is the median window
   (samples/s); the windows run across epoch boundaries as training does. Each window's minor
   page faults (``getrusage``, read at the same edges) come with it: a diagnostic to set
   beside a trial's ``window_minor_faults``.

Nothing else runs in the process: no meters, no progress pings, no memory sampling.
"""

from __future__ import annotations

import itertools
import math
import resource
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks._fresh import in_fresh_process

WARMUP_BATCHES = 10
WINDOWS = 3
WINDOW_BATCHES = 40
# For --quick runs of the benchmarks: checks the code path, not timings.
QUICK_WINDOW = {"warmup": 2, "windows": 2, "window_batches": 4}


def train_and_time(
    config_path: Path | str,
    params: dict[str, Any],
    *,
    warmup: int = WARMUP_BATCHES,
    windows: int = WINDOWS,
    window_batches: int = WINDOW_BATCHES,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the config's workload (its options updated with ``options``) with ``params`` (a
    `LoaderParams.as_dict`) in this process and time it (see the module docstring). Returns
    the median window and every window."""
    import torch
    from torch.utils.data import DataLoader

    from loader_search.study import load_config
    from loader_search.workloads import load_workload

    config = load_config(config_path)
    workload = load_workload(config.workload, {**config.workload_options, **(options or {})})
    training = config.training
    batch_size = int(params["batch_size"])
    workers = int(params.get("num_workers", 0))
    torch.set_num_threads(int(params.get("torch_threads") or torch.get_num_threads()))
    torch.manual_seed(training.seed)
    base_lr = training.lr if training.lr is not None else workload.base_lr
    ratio = batch_size / training.batch_size
    lr = {"linear": base_lr * ratio, "sqrt": base_lr * math.sqrt(ratio)}.get(
        training.lr_scaling, base_lr
    )
    model = workload.make_model()
    optimizer = workload.make_optimizer(model.parameters(), lr)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "shuffle": True, "num_workers": workers}
    if workers:
        kwargs["prefetch_factor"] = int(params.get("prefetch_factor") or 2)
        kwargs["persistent_workers"] = bool(params.get("persistent_workers"))
    kwargs["pin_memory"] = bool(params.get("pin_memory"))
    loader = DataLoader(workload.train_dataset, collate_fn=workload.collate_fn, **kwargs)

    needed = warmup + windows * window_batches
    marks: list[tuple[float, int, int]] = []  # (time, samples, faults) at each window's edges
    done = samples = 0
    model.train()
    while done < needed:
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            done += 1
            samples += len(targets)
            if done >= warmup and (done - warmup) % window_batches == 0:
                faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                marks.append((time.perf_counter(), samples, faulted))
            if done >= needed:
                break
    edges = list(itertools.pairwise(marks))
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0, _), (t1, s1, _) in edges]
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"training diverged (loss {loss.item()})")
    faults = [f1 - f0 for (_, _, f0), (_, _, f1) in edges]
    return {
        "throughput": statistics.median(rates),
        "windows": rates,
        "minor_faults": faults,
        "faults_per_batch": statistics.median(faults) / window_batches,
    }


def reading(
    config_path: Path,
    params: dict[str, Any],
    options: Mapping[str, Any] | None = None,
    **window: int,
) -> dict[str, Any]:
    """One reading in a fresh process (see the module docstring); raises on its failure."""
    result: dict[str, Any] = in_fresh_process(
        train_and_time,
        str(config_path),
        params,
        options=dict(options or {}),
        what=f"the reference loop for {params}",
        **window,
    )
    return result
